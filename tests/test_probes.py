"""engram.apps.study.probes on hand-made token streams and a model that always predicts id + 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engram.apps.study import probes as P

V = 10


class PlusOne(torch.nn.Module):
    """Logits with the maximum at (id + 1) mod V at every position."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.nn.functional.one_hot((input_ids + 1) % V, V).float() + self.w
        return SimpleNamespace(logits=logits)


def test_ngram_set_does_not_cross_streams():
    assert P.ngram_set([[1, 2, 3], [4, 5]], 2) == {(1, 2), (2, 3), (4, 5)}
    assert P.ngram_set([[1, 2]], 3) == set()
    with pytest.raises(ValueError, match="n-gram length 0"):
        P.ngram_set([[1]], 0)


def test_seen_mask_marks_the_ngram_ending_at_the_target():
    blocks = torch.tensor([[1, 2, 3, 9]])
    seen = {(1, 2, 3)}
    # targets 2, 3, 9: the first has no full 3-gram, (1,2,3) seen, (2,3,9) not
    assert P.seen_mask(blocks, seen, 3).tolist() == [[P.NO_NGRAM, P.SEEN, P.UNSEEN]]
    assert P.seen_mask(blocks, {(1, 2)}, 2).tolist() == [[P.SEEN, P.UNSEEN, P.UNSEEN]]


def test_split_accuracy_by_mask():
    blocks = torch.tensor([[1, 2, 3, 9]])
    pred = P.greedy_predictions(PlusOne(), blocks)
    assert pred.tolist() == [[2, 3, 4]]  # right, right, wrong
    mask = torch.tensor([[P.NO_NGRAM, P.SEEN, P.UNSEEN]], dtype=torch.int8)
    r = P.split_accuracy(pred, blocks, mask)
    assert r["accuracy"] == pytest.approx(2 / 3) and r["tokens"] == 3
    assert (r["memory"], r["memory_tokens"]) == (1.0, 1)
    assert (r["generalisation"], r["generalisation_tokens"]) == (0.0, 1)
    none = P.split_accuracy(pred, blocks, torch.full_like(mask, P.NO_NGRAM))
    assert none["memory"] is None and none["generalisation"] is None
    with pytest.raises(ValueError, match="one prediction and one mask value per target"):
        P.split_accuracy(pred[:, :2], blocks, mask)


def test_cloze_phrases_frequent_in_training_and_present_in_held_out():
    train = [1, 2, 3] * 6 + [4, 5, 6] * 2 + [7, 8, 0] * 9
    held = [9, 1, 2, 3, 9, 4, 5, 6, 9]
    got = P.cloze_phrases(train, held, 3, min_count=5)
    assert got == [(1, 2, 3)]  # (4,5,6) too rare; (7,8,0) never in held-out; rotations not in held-out
    assert P.cloze_phrases(train, held, 3, min_count=2) == [(1, 2, 3), (4, 5, 6)]
    assert P.cloze_phrases(train, held, 3, min_count=2, exclude=[5]) == [(1, 2, 3)]
    assert P.cloze_phrases(train, held, 3, min_count=2, max_phrases=1) == [(1, 2, 3)]
    assert P.cloze_phrases(train, held, 3, min_count=2) == P.cloze_phrases(train, held, 3, min_count=2)


def test_cloze_items_and_accuracy():
    held = [5, 6, 1, 2, 3, 0, 7, 8, 9, 0, 1, 2, 3, 7, 8, 9]
    items = P.cloze_items(held, [(1, 2, 3), (7, 8, 9)], context=2, blank=1)
    assert items.prompts.tolist() == [[5, 6, 1, 2], [3, 0, 7, 8], [9, 0, 1, 2], [2, 3, 7, 8]]
    assert items.answers.tolist() == [[3], [9], [3], [9]]
    r = P.cloze_accuracy(PlusOne(), items, batch_size=3)
    assert r == {"accuracy": 1.0, "token_accuracy": 1.0, "items": 4, "phrases": 2}
    one = P.cloze_items(held, [(1, 2, 3)], context=2, blank=2, max_per_phrase=1)
    assert one.prompts.tolist() == [[5, 6, 1]] and one.answers.tolist() == [[2, 3]]
    assert P.cloze_accuracy(PlusOne(), one)["accuracy"] == 1.0  # 1 -> 2 -> 3, fed back
    wrong = P.cloze_items([0, 0, 4, 6], [(4, 6)], context=2)
    assert P.cloze_accuracy(PlusOne(), wrong) == {
        "accuracy": 0.0,
        "token_accuracy": 0.0,
        "items": 1,
        "phrases": 1,
    }


def test_cloze_bad_input():
    with pytest.raises(ValueError, match="no cloze phrases"):
        P.cloze_items([1, 2], [])
    with pytest.raises(ValueError, match="blank 3"):
        P.cloze_items([1, 2, 3], [(1, 2, 3)], blank=3)
    with pytest.raises(ValueError, match="give n >= 2"):
        P.cloze_phrases([1], [1], 1)
    empty = P.cloze_items([1, 2, 3], [(7, 8)], context=1)
    assert len(empty) == 0 and P.cloze_accuracy(PlusOne(), empty)["accuracy"] is None


def test_predictions_and_loss_in_one_pass():
    blocks = torch.tensor([[1, 2, 3, 9], [4, 5, 6, 7]])
    pred, loss = P.greedy_predictions_and_loss(PlusOne(), blocks, batch_size=1)
    assert pred.tolist() == [[2, 3, 4], [5, 6, 7]]
    logits = PlusOne()(blocks).logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1), blocks[:, 1:].flatten())
    assert loss["loss"] == pytest.approx(float(want)) and loss["tokens"] == 6
