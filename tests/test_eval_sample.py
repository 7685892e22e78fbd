"""The periodic evaluation's sample (`TokenStream.sample_starts`): every held-out document scored,
deterministic for a seed, and an estimate that agrees with the full evaluation."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engram.apps.lm.data import EOS, Document, TokenStream

WORDS = [f"w{i}" for i in range(50)]


def word_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([EOS, "\n", *WORDS])}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def stream(lengths: list[int], seed: int = 0) -> TokenStream:
    rng = np.random.default_rng(seed)
    docs = [
        Document(f"doc{d}", " ".join(rng.choice(WORDS, size=n)), category=f"c{d % 3}")
        for d, n in enumerate(lengths)
    ]
    return TokenStream(docs, word_tokenizer())


def overlaps(starts: np.ndarray, seq_len: int, lo: int, hi: int) -> bool:
    """Whether any window [s, s + seq_len] (inputs and targets) overlaps tokens [lo, hi)."""
    return bool(np.any((starts < hi) & (starts + seq_len >= lo)))


@pytest.mark.parametrize("lengths", [[5000, 300, 40, 2000, 900, 7000, 60, 3000, 1500], [200] * 30])
def test_sample_covers_every_document(lengths):
    s = stream(lengths)
    seq = 64
    got = s.eval_starts(seq, 2048)
    full = s.eval_starts(seq)
    assert set(got) <= set(full)  # a subset of the full evaluation's windows
    assert np.all(np.diff(got) > 0)
    for d in range(len(lengths)):
        lo, hi = s.doc_offsets[d], s.doc_offsets[d + 1]
        assert overlaps(got, seq, lo, hi), f"document {d} ({hi - lo} tokens) is not scored"
    assert len(got) <= max(2048 // seq, len(lengths)) + len(lengths)


def test_sample_is_deterministic_for_a_seed():
    s = stream([4000, 2500, 800, 6000])
    a, b = s.eval_starts(32, 4096, seed=3), s.eval_starts(32, 4096, seed=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, s.eval_starts(32, 4096, seed=4))
    assert np.array_equal(s.eval_starts(32), np.arange(0, len(s) - 32, 32))  # None: every window


def test_sample_proportional_to_document_length():
    s = stream([8000, 2000, 2000, 4000])
    seq = 16
    got = s.eval_starts(seq, 4000)
    doc_of = np.searchsorted(s.doc_offsets, got, side="right") - 1
    share = np.bincount(doc_of, minlength=4) / len(got)
    assert share == pytest.approx(np.array([8, 2, 2, 4]) / 16, abs=0.02)


def test_sampled_estimate_matches_full():
    """A per-token 'loss' that differs by document (as the Bible's books do): the first-tokens prefix
    is far off, the stratified sample is close to the mean over every token."""
    lengths = [6000, 1200, 900, 1500, 3000, 700, 4000, 1800, 2500]
    s = stream(lengths)
    rng = np.random.default_rng(0)
    level = np.repeat(np.linspace(3.0, 5.0, len(lengths)), np.diff(s.doc_offsets))
    per_token = level + rng.normal(0, 1.0, len(s))
    seq = 64

    def score(starts: np.ndarray) -> float:
        return float(per_token[starts[:, None] + 1 + np.arange(seq)].mean())

    full = score(s.eval_starts(seq))
    sampled = [score(s.eval_starts(seq, 4096, seed=k)) for k in range(5)]
    prefix = score(np.arange(0, 4096 - seq + 1, seq))  # the old periodic evaluation: the first tokens
    assert abs(prefix - full) > 0.5
    assert max(abs(x - full) for x in sampled) < 0.06


def test_bad_sample_size_refused():
    with pytest.raises(ValueError, match="max_tokens=0"):
        stream([500]).eval_starts(16, 0)


def test_periodic_evaluation_leaves_training_alone_and_tracks_the_full_one(corpus):
    """Evaluating every few steps changes no weight (the sample uses its own RNG), and the last
    sampled point is close to the final evaluation on every held-out token."""
    import torch

    from engram.apps.lm.train import Trainer, build_model, prepare_data
    from training_setup import tiny_cfg

    finals = []
    for every in (0, 4):
        cfg = tiny_cfg(corpus, steps=12, eval_every=every, eval_tokens=1024, threads=1)
        data = prepare_data(cfg)
        t = Trainer(cfg, data, build_model(cfg, data))
        t.run()
        finals.append((t.model.state_dict(), t))
    (a, _), (b, t) = finals
    assert all(torch.equal(a[k], b[k]) for k in a)
    sampled = t.history[-1]["held_out_loss"]
    assert (
        t.data.held_out.eval_starts(t.cfg.seq_len, 1024).size
        < t.data.held_out.eval_starts(t.cfg.seq_len).size
    )
    assert abs(sampled - t.evaluate()["loss"]) < 0.1
