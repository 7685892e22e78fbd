from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from engram import EngramConfig, NgramHasher, TokenizerCompression


def reference_rows(hasher: NgramHasher, ids: np.ndarray, dead: np.ndarray | None) -> np.ndarray:
    """(B, T, layers, heads) from the plain implementation, one sequence and one layer at a time."""
    c = hasher.config
    primes = ref.primes(c.layer_ids, c.engram_vocab_size, c.n_heads)
    pad = int(hasher.compression.lookup[c.pad_token_id])
    out = []
    for b in range(ids.shape[0]):
        xc = [int(hasher.compression.lookup[t]) for t in ids[b]]
        d = None if dead is None else [bool(x) for x in dead[b]]
        per_layer = [
            ref.hash_sequence(
                xc,
                d,
                pad,
                primes[lid],
                ref.multipliers(lid, c.max_ngram_size, c.compressed_vocab_size, c.seed),
                c.max_ngram_size,
            )
            for lid in c.layer_ids
        ]
        out.append(np.stack([np.array(p) for p in per_layer], axis=1))
    return np.stack(out)


def test_golden_vectors(v41_hasher, vectors):
    for case in vectors["cases"]:
        ids = np.array(case["token_ids"])
        dead = np.array(case["dead_mask"]) if "dead_mask" in case else None
        assert v41_hasher.compression.lookup[ids].tolist() == case["compressed_ids"]
        rows = v41_hasher.hash(ids, dead)
        assert rows.shape == (len(ids), 2, 24) and rows.dtype == np.int64
        for li, lid in enumerate(("1", "14")):
            assert rows[:, li].tolist() == case["rows"][lid], case["text"]


def test_golden_vectors_through_tokenizer(v41_hasher, vectors, ds_tokenizer):
    for case in vectors["cases"]:
        if "dead_mask" in case:
            continue
        assert ds_tokenizer.encode(case["text"], add_special_tokens=False).ids == case["token_ids"]


def test_random_ids_match_reference(v41_hasher):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 129280, size=(3, 40))
    dead = rng.random((3, 40)) < 0.15
    assert np.array_equal(v41_hasher.hash(ids), reference_rows(v41_hasher, ids, None))
    assert np.array_equal(v41_hasher.hash(ids, dead), reference_rows(v41_hasher, ids, dead))


def test_real_text_matches_reference(v41_hasher, ds_tokenizer):
    text = "In the beginning God created the heaven and the earth. 戴安娜王妃是威尔士王妃。 Ünïcödé, APPLE apple."
    ids = np.array([ds_tokenizer.encode(text, add_special_tokens=False).ids])
    dead = np.zeros_like(ids, dtype=bool)
    dead[0, 5:8] = True
    assert np.array_equal(v41_hasher.hash(ids, dead), reference_rows(v41_hasher, ids, dead))


@pytest.mark.parametrize("preset", ["demo-v1", "tiny"])
def test_other_presets_match_reference(preset, ds_compression):
    h = NgramHasher(EngramConfig.preset(preset), ds_compression)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 129280, size=(2, 30))
    dead = rng.random((2, 30)) < 0.2
    rows = h.hash(ids, dead)
    assert rows.shape == (2, 30, h.config.n_layers, h.config.rows_per_token)
    assert np.array_equal(rows, reference_rows(h, ids, dead))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_matches_reference(tiny_hasher, data):
    t = data.draw(st.integers(1, 24))
    ids = np.array(data.draw(st.lists(st.integers(0, 129279), min_size=t, max_size=t)))[None]
    dead = np.array(data.draw(st.lists(st.booleans(), min_size=t, max_size=t)))[None]
    assert np.array_equal(tiny_hasher.hash(ids, dead), reference_rows(tiny_hasher, ids, dead))


@pytest.fixture(scope="module")
def tiny_hasher(ds_compression):
    return NgramHasher(EngramConfig.preset("tiny"), ds_compression)


def test_rows_lie_in_their_head_slice(v41_hasher):
    ids = np.random.default_rng(2).integers(0, 129280, size=(4, 64))
    rows = v41_hasher.hash(ids)
    for li, layer in enumerate(v41_hasher.layout.layers):
        lo, hi = layer.offsets, layer.offsets + layer.flat_primes
        assert ((rows[:, :, li] >= lo) & (rows[:, :, li] < hi)).all()


def test_order_matters_and_heads_share_mix(v41_hasher, ds_tokenizer):
    vocab = ds_tokenizer.get_vocab()
    a, b = vocab["Great"], vocab["could"]
    ab = v41_hasher.hash(np.array([a, b]))[1]
    ba = v41_hasher.hash(np.array([b, a]))[1]
    assert not np.array_equal(ab[:, :8], ba[:, :8])


def test_dead_position_pads_everything(v41_hasher):
    ids = np.array([10, 20, 30, 40, 50])
    dead = np.array([False, False, True, False, False])
    rows = v41_hasher.hash(ids, dead)
    alone = v41_hasher.hash(np.array([2]))  # the pad token alone: (pad, pad, pad, pad)
    assert np.array_equal(rows[2], alone[0])  # a dead position sees only pads
    # after the dead span, position 3 sees (40, pad, pad, pad): the same as a sequence starting at 40
    assert np.array_equal(rows[3], v41_hasher.hash(np.array([40]))[0])
    assert np.array_equal(rows[4], v41_hasher.hash(np.array([40, 50]))[1])


def test_1d_2d_and_torch_inputs(v41_hasher):
    ids = np.random.default_rng(3).integers(0, 129280, size=(2, 17))
    rows = v41_hasher.hash(ids)
    assert np.array_equal(v41_hasher.hash(ids[1]), rows[1])
    t = v41_hasher.hash(torch.from_numpy(ids))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64
    assert np.array_equal(t.numpy(), rows)
    assert np.array_equal(v41_hasher.hash(ids.astype(np.int32)), rows)
    assert np.array_equal(v41_hasher.hash(ids.tolist()), rows)
    dead = torch.zeros(2, 17, dtype=torch.bool)
    assert np.array_equal(v41_hasher.hash(torch.from_numpy(ids), dead).numpy(), rows)


@pytest.mark.parametrize(
    ("ids", "exc", "pattern"),
    [
        (np.array([1.0, 2.0]), TypeError, "float64"),
        (torch.tensor([1.0]), TypeError, "float32"),
        (np.array([True]), TypeError, "bool"),
        (np.array([5, -3, 7]), ValueError, r"id -3 at position \(1,\)"),
        (np.array([[5, 6], [7, 129280]]), ValueError, r"id 129280 at position \(1, 1\).*\[0, 129280\)"),
        (np.array([], dtype=np.int64), ValueError, "empty"),
        (np.zeros((1, 2, 3), dtype=np.int64), ValueError, r"shape \[T\] or \[B, T\]"),
    ],
)
def test_bad_ids(v41_hasher, ids, exc, pattern):
    with pytest.raises(exc, match=pattern):
        v41_hasher.hash(ids)


def test_bad_dead_mask(v41_hasher):
    with pytest.raises(TypeError, match="boolean"):
        v41_hasher.hash(np.array([1, 2]), np.array([0, 1]))
    with pytest.raises(ValueError, match="shape"):
        v41_hasher.hash(np.array([1, 2]), np.array([True]))


def test_mismatched_compression_is_refused(ds_compression):
    small = TokenizerCompression(lookup=np.arange(129280) % 99000, fingerprint="x")
    with pytest.raises(ValueError, match=r"99000 compressed ids.*compressed_vocab_size=99092"):
        NgramHasher(EngramConfig.preset("deepseek-v4.1"), small)
    short = TokenizerCompression(lookup=np.arange(1000), fingerprint="x")
    with pytest.raises(ValueError, match=r"1000 tokenizer ids.*vocab_size=129280"):
        NgramHasher(EngramConfig.preset("deepseek-v4.1"), short)
