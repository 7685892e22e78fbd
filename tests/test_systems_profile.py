"""engram.systems.profile: counts against a plain count, the file round trip, refusals of a profile
made for another layout or tokenizer, and `engram profile`."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.addressing.hashing import NgramHasher
from engram.cli import main
from engram.config import EngramConfig
from engram.systems.profile import build_profile, count_rows, load_profile, save_profile


@pytest.fixture(scope="module")
def comp():
    return TokenizerCompression.from_tokenizer(resolve_tokenizer("deepseek-v4"))


def test_counts_match_a_plain_count():
    rows = np.random.default_rng(0).integers(0, 30, (50, 2, 3))
    for batch_tokens in (1, 7, 100):
        got = count_rows(rows, batch_tokens)
        for li, (ids, counts) in enumerate(got):
            plain: Counter[int] = Counter()
            for s in range(0, 50, batch_tokens):
                plain.update(set(rows[s : s + batch_tokens, li].ravel().tolist()))
            expect = sorted(plain.items(), key=lambda kv: (-kv[1], kv[0]))  # hottest first, ties by id
            assert list(zip(ids.tolist(), counts.tolist(), strict=True)) == expect
    with pytest.raises(ValueError, match="batch_tokens=0"):
        count_rows(rows, 0)
    with pytest.raises(ValueError, match=r"\(tokens, layers, heads\)"):
        count_rows(rows[0], 4)


def test_round_trip_and_refusals(comp, tmp_path):
    cfg = EngramConfig.preset("tiny")
    hasher = NgramHasher(cfg, comp)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 3000)
    prof = build_profile(hasher, ids, 256, "random ids")
    path = tmp_path / "p.safetensors"
    save_profile(prof, path)
    back = load_profile(path, hasher)
    assert back.layer_ids == prof.layer_ids and back.batch_tokens == 256 and back.tokens == 3000
    assert all(np.array_equal(a, b) for a, b in zip(back.rows, prof.rows, strict=True))
    assert np.array_equal(back.hottest(1, 5), prof.rows[0][:5])
    save_profile(prof, tmp_path / "top.safetensors", top=10)
    assert load_profile(tmp_path / "top.safetensors").rows[0].shape == (10,)
    other = NgramHasher(cfg.replace(seed=1), comp)  # other multipliers: every row id means another n-gram
    with pytest.raises(ValueError, match=r"another layout .* Write a new profile with `engram profile`"):
        load_profile(path, other)
    save_profile(dataclasses.replace(prof, tokenizer_fingerprint="0" * 64), tmp_path / "tok.safetensors")
    with pytest.raises(ValueError, match=r"another tokenizer \(fingerprint 000000000000"):
        load_profile(tmp_path / "tok.safetensors", hasher)
    with pytest.raises(ValueError, match="not layer 7"):
        prof.hottest(7)
    comp.save(tmp_path / "map.safetensors")  # a safetensors file of another kind
    with pytest.raises(ValueError, match="is not an Engram row profile"):
        load_profile(tmp_path / "map.safetensors")
    with pytest.raises(ValueError, match="holds no tokens"):
        build_profile(hasher, np.empty(0, dtype=np.int64), 256, "empty")


def test_cli_profile(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    out = tmp_path / "p.safetensors"
    assert main(["profile", "--preset", "tiny", "--text-file", str(text), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"][0]["layer_id"] == 1 and summary["tokens"] > 0
    prof = load_profile(out)
    assert prof.source == str(text) and prof.config["name"] == "tiny"
    assert (
        main(
            [
                "profile",
                "--preset",
                "tiny",
                "--corpus",
                "kjv-held-out",
                "--max-chars",
                "5000",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "kjv-held-out" in capsys.readouterr().out
