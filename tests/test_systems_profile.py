"""engram.systems.profile: counts against a plain count, the file round trip, refusals of a profile
made for another layout or tokenizer, and `engram profile`."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch

from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.addressing.hashing import NgramHasher
from engram.checkpoint.files import open_tensors, save_tensors
from engram.cli import main
from engram.config import EngramConfig
from engram.systems.planner import plan_memory
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


def _rewrite(src, dst, tensors=None, **meta):
    """A copy of profile file `src` at `dst` with some tensors or metadata replaced."""
    f = open_tensors(src)
    t = {k: f.tensor(k).clone() for k in f}
    save_tensors(dst, t | (tensors or {}), dict(f.metadata) | meta)
    return dst


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"rows": "huge"},
            r"lists row 1000000000000 \(rows\.1\[0\]\), but layer 1 has \d+ rows; write a new",
        ),
        ({"rows": "negative"}, r"rows\.1\[2\] = -4: row ids are >= 0; write it again with `engram profile`"),
        ({"rows": "float"}, r"rows\.1 is float64 .* must be a 1-D integer array"),
        ({"counts": "negative"}, r"counts\.1\[0\] = -3: a count is how often the text used the row, >= 1"),
        ({"counts": "nan"}, r"counts\.1 is float32 .* whole numbers"),
        ({"tokens": "-5"}, r"tokens=-5 must be a whole number >= 1; write it again with `engram profile`"),
        ({"batch_tokens": "0"}, r"batch_tokens=0 must be a whole number >= 1"),
        ({"batch_tokens": "2.5"}, r"batch_tokens='2.5' is not a whole number"),
    ],
)
def test_nonsense_profiles_refused(comp, tmp_path, change, match):
    cfg = EngramConfig.preset("tiny")
    hasher = NgramHasher(cfg, comp)
    prof = build_profile(
        hasher, np.random.default_rng(2).integers(0, cfg.vocab_size, 3000), 256, "random ids"
    )
    good = tmp_path / "p.safetensors"
    save_profile(prof, good)
    rows, counts = torch.from_numpy(prof.rows[0].copy()), torch.from_numpy(prof.counts[0].copy())
    tensors, meta = {}, {}
    for key, how in change.items():
        if key == "rows":
            r = rows.clone()
            if how == "huge":
                r[0] = 10**12
            elif how == "negative":
                r[2] = -4
            tensors["rows.1"] = r.double() + 0.5 if how == "float" else r
        elif key == "counts":
            c = counts.clone()
            c[0] = -3
            tensors["counts.1"] = torch.full(c.shape, float("nan")) if how == "nan" else c
        else:
            meta[key] = how
    bad = _rewrite(good, tmp_path / "bad.safetensors", tensors, **meta)
    with pytest.raises(ValueError, match=match) as e:
        load_profile(bad, hasher)
    assert str(bad) in str(e.value)


def test_plan_memory_refuses_profile_rows_past_the_table(comp):
    cfg = EngramConfig.preset("tiny")
    hasher = NgramHasher(cfg, comp)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 2000)
    prof = build_profile(hasher, ids, 100, "random ids")
    rows = hasher.hash(ids)
    t_rows = int(prof.rows[0].max())  # one row short of the profile's largest id
    with pytest.raises(ValueError, match=rf"lists row {t_rows} .* layer 1 has {t_rows} rows"):
        plan_memory(rows, [1], [t_rows], 264, 264 * 10, 264 * 100, 1e4, policy="pinned", profile=prof)
    with pytest.raises(ValueError, match=r"counts\.1 are not hottest first"):
        dataclasses.replace(prof, counts=(prof.counts[0][::-1].copy(),))


def test_cli_cache_sim_refuses_a_nonsense_profile(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    good = tmp_path / "p.safetensors"
    assert main(["profile", "--preset", "tiny", "--text-file", str(text), "--out", str(good)]) == 0
    bad = _rewrite(good, tmp_path / "bad.safetensors", tokens="-5")
    capsys.readouterr()
    argv = ["cache-sim", "--preset", "tiny", "--text-file", str(text), "--profile", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tokens=-5" in err and str(bad) in err and "Traceback" not in err
