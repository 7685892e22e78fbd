"""engram.hf.EngramCollator: padding on either side (dead, so the rows of each sequence are those
of the sequence alone), labels, and its bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

import hf_setup as S
from engram.addressing.hashing import NgramHasher
from engram.hf import EngramCollator

pytest.importorskip("transformers")


def _hasher():
    return NgramHasher(S.engram_config(), S.compression())


@pytest.mark.parametrize("side", ["left", "right"])
def test_each_row_hashes_as_the_sequence_alone(side):
    hasher = _hasher()
    seqs = [S.batch(1, n, seed=n)[0].tolist() for n in (3, 7, 5)]
    out = EngramCollator(hasher, pad_token_id=0, padding_side=side)([{"input_ids": s} for s in seqs])
    assert out["input_ids"].shape == (3, 7) and out["engram_rows"].shape == (3, 7, 1, 4)
    for i, s in enumerate(seqs):
        sl = slice(7 - len(s), 7) if side == "left" else slice(0, len(s))
        assert out["input_ids"][i, sl].tolist() == s
        assert out["attention_mask"][i].sum() == len(s)
        np.testing.assert_array_equal(out["engram_rows"][i, sl].numpy(), hasher.hash(np.array(s)))
        assert (out["labels"][i, sl] == out["input_ids"][i, sl]).all()
        assert (out["labels"][i][out["attention_mask"][i] == 0] == -100).all()


def test_given_labels_kept_and_max_length_cuts():
    out = EngramCollator(_hasher(), pad_token_id=0, max_length=4)(
        [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]}, [5, 6]]
    )
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, 8], [5, 6, -100, -100]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="Engram attached"):
        EngramCollator(S.llama(), pad_token_id=0)
    with pytest.raises(ValueError, match="padding_side='middle'"):
        EngramCollator(_hasher(), pad_token_id=0, padding_side="middle")
    with pytest.raises(ValueError, match="empty list"):
        EngramCollator(_hasher(), pad_token_id=0)([])
    with pytest.raises(ValueError, match="outside the tokenizer's ids"):
        EngramCollator(_hasher(), pad_token_id=0)([[1, 2, 10_000]])
