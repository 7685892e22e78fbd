from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import reference as ref
from engram import TokenizerCompression
from engram.addressing.compression import resolve_tokenizer, tokenizer_fingerprint


def test_deepseek_v4_map_is_exact(ds_compression, vectors):
    assert ds_compression.vocab_size == 129280
    assert ds_compression.size == 99092 == vectors["compressed_vocab_size"]
    digest = hashlib.sha256(ds_compression.lookup.astype("<i8").tobytes()).hexdigest()
    assert digest == vectors["compression_lookup_sha256"]
    assert int(ds_compression.lookup[2]) == vectors["compressed_pad_id"]


def test_map_matches_plain_python_normaliser(ds_tokenizer, ds_compression):
    n = ds_tokenizer.get_vocab_size(with_added_tokens=True)
    decoded = [ds_tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
    raw = [ds_tokenizer.id_to_token(i) for i in range(n)]
    assert ref.compression_lookup(decoded, raw) == ds_compression.lookup.tolist()


def test_building_is_fast(ds_tokenizer):
    t0 = time.perf_counter()
    TokenizerCompression.from_tokenizer(ds_tokenizer)
    assert time.perf_counter() - t0 < 10  # seconds, not minutes (about 1 s here)


def test_sources_agree(ds_tokenizer, ds_compression, tmp_path):
    path = tmp_path / "tokenizer.json"
    ds_tokenizer.save(str(path))

    class FakeTransformers:  # what a transformers fast tokenizer exposes
        backend_tokenizer = ds_tokenizer

    for src in (str(path), path, tmp_path, FakeTransformers()):
        comp = TokenizerCompression.from_tokenizer(src)
        assert np.array_equal(comp.lookup, ds_compression.lookup)
        assert comp.fingerprint == ds_compression.fingerprint


def test_known_merges(ds_tokenizer, ds_compression):
    vocab = ds_tokenizer.get_vocab()
    lut = ds_compression.lookup
    assert lut[vocab["Apple"]] == lut[vocab["apple"]] == lut[vocab["Ġapple"]]
    assert lut[vocab["the"]] != lut[vocab["then"]]


def test_compress_and_groups(ds_compression, ds_tokenizer):
    ids = np.array([[0, 1, 2], [3, 4, 5]])
    assert np.array_equal(ds_compression.compress(ids), ds_compression.lookup[ids])
    groups = ds_compression.top_groups(3, ds_tokenizer)
    counts = [g["count"] for g in groups]
    assert counts == sorted(counts, reverse=True) and counts[0] > 1
    assert all(len(g["members"]) == min(g["count"], 12) for g in groups)


def test_save_load_round_trip(ds_compression, ds_tokenizer, tmp_path):
    path = tmp_path / "map.safetensors"
    ds_compression.save(path)
    back = TokenizerCompression.load(path, tokenizer=ds_tokenizer)
    assert np.array_equal(back.lookup, ds_compression.lookup)
    assert back.fingerprint == ds_compression.fingerprint and back.size == 99092
    assert back.keys == ds_compression.keys
    assert not back.lookup.flags.writeable


def _toy_tokenizer(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_map_for_another_tokenizer_is_refused(ds_compression, tmp_path):
    path = tmp_path / "map.safetensors"
    ds_compression.save(path)
    other = _toy_tokenizer(["[UNK]", "Apple", "apple", "pear"])
    with pytest.raises(ValueError, match="another tokenizer"):
        TokenizerCompression.load(path, tokenizer=other)


def test_toy_tokenizer_map():
    tok = _toy_tokenizer(["[UNK]", "Apple", "apple", "pear", "Pear", "café", "cafe"])
    comp = TokenizerCompression.from_tokenizer(tok)
    assert comp.lookup.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert comp.size == 4
    assert tokenizer_fingerprint(tok) == comp.fingerprint


def test_bad_files_and_sources(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read compression map"):
        TokenizerCompression.load(bad)
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"weights": np.zeros(3, dtype=np.int64)}, str(other))
    with pytest.raises(ValueError, match="not an Engram compression map"):
        TokenizerCompression.load(other)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        resolve_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="cannot make a tokenizer"):
        resolve_tokenizer(42)


def test_lookup_must_be_dense():
    with pytest.raises(ValueError, match="dense"):
        TokenizerCompression(lookup=np.array([0, 2]), fingerprint="x")
