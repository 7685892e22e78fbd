"""Tests for engram.apps.tools.run_layer: `engram run-layer`, the V4.1 path end to end on a scaled checkpoint.

The report's rows are checked against `NgramHasher` for the scaled config, and layer 1's gates against
a plain recomputation of SPEC §6 from the checkpoint's bytes. Small tables (prime-search base 512) and
the session's compression map keep the file to a few seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engram import EngramConfig, NgramHasher
from engram.apps.tools.run_layer import DEFAULT_TEXT, pseudo_embedding, run_layer
from engram.checkpoint.convert import make_scaled_v41_checkpoint
from engram.checkpoint.v41 import load_engram_modules
from engram.cli import build_parser

BASE = 512  # ~14-18K rows a layer, ~4 MB a table


def scaled_config(base: int = BASE, hidden_size: int = 64) -> EngramConfig:
    return EngramConfig.preset("deepseek-v4.1").replace(
        engram_vocab_size=(base,) * 3, hidden_size=hidden_size
    )


def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def report(ds_compression) -> dict:
    return run_layer(base=BASE, compression=ds_compression)


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("scaled")
    make_scaled_v41_checkpoint(d, base=BASE, hidden_size=64, seed=0)
    return d


def test_report_of_the_default_text(report):
    assert report["ok"] and report["built"] and report["checkpoint"] is None
    assert report["config"] == f"deepseek-v4.1-scaled-{BASE}" and report["compressed_vocab_size"] == 99092
    assert report["n_tokens"] == 13 == len(report["tokens"])
    assert "".join(t["text"] for t in report["tokens"]) == DEFAULT_TEXT
    assert report["tokens"][2]["id"] == report["tokens"][6]["id"]  # " the" twice ...
    assert [layer["layer_id"] for layer in report["layers"]] == report["layer_ids"] == [1, 14]
    for layer in report["layers"]:
        assert layer["table"] == "MmapFP8Table" and layer["row_width"] == 256
        assert layer["table_bytes"] == layer["table_rows"] * (256 + 8)
        assert layer["bytes_read_per_token"] == 24 * 264
        assert layer["rows_in_range"] and 0 <= layer["row_min"] <= layer["row_max"] < layer["table_rows"]
        assert layer["max_abs_delta_h"] > 0  # both layers wrote into the streams
    assert report["max_abs_delta_h"] > 0
    for tok in report["tokens"]:
        assert sorted(tok["layers"]) == ["1", "14"]
        for lid, d in tok["layers"].items():
            table_rows = next(x["table_rows"] for x in report["layers"] if str(x["layer_id"]) == lid)
            assert len(d["rows"]) == 24 and d["rows_ok"]
            assert all(0 <= r < table_rows for r in d["rows"])
            assert len(d["gates"]) == 4 and all(0.0 < g < 1.0 for g in d["gates"])
    # ... with the same pseudo-embedding but other n-gram contexts, so other rows and other gates
    same = [report["tokens"][i]["layers"]["1"] for i in (2, 6)]
    assert same[0]["rows"] != same[1]["rows"] and same[0]["gates"] != same[1]["gates"]


def test_rows_are_the_hashers(report, ds_tokenizer, ds_compression):
    config = scaled_config()
    ids = np.array([t["id"] for t in report["tokens"]])
    assert ids.tolist() == ds_tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False).ids
    rows = NgramHasher(config, ds_compression).hash(ids)  # (T, n_layers, 24)
    for li, lid in enumerate(config.layer_ids):
        got = np.array([t["layers"][str(lid)]["rows"] for t in report["tokens"]])
        np.testing.assert_array_equal(got, rows[:, li])
    assert [t["compressed_id"] for t in report["tokens"]] == ds_compression.lookup[ids].tolist()


def test_prebuilt_checkpoint_gives_the_same_run(report, prebuilt, ds_compression):
    r2 = run_layer(prebuilt, compression=ds_compression)
    assert r2["ok"] and not r2["built"] and r2["checkpoint"] == str(prebuilt)
    assert r2["tokens"] == report["tokens"]  # same seed: same weights, embeddings, rows and gates
    assert r2["max_abs_delta_h"] == report["max_abs_delta_h"]


def test_gates_match_plain_reference(report, prebuilt):
    """Layer 1's gates and layer 14's input, recomputed from SPEC §6 with in-memory tables."""
    config, modules = load_engram_modules(prebuilt, mmap=False)
    ids = np.array([t["id"] for t in report["tokens"]])
    h = pseudo_embedding(ids, config.hc_mult, config.hidden_size, seed=0).double()  # (1, T, hc, dim)
    for lid in config.layer_ids:
        m = modules[lid]
        rows = torch.tensor([t["layers"][str(lid)]["rows"] for t in report["tokens"]])  # (T, 24)
        e = m.table.to_float(torch.float64)[rows].flatten(-2)  # (T, 6144)
        kv = (e @ m.wkv.weight.double().T).view(len(ids), config.hc_mult + 1, config.hidden_size)
        key, v = kv[:, :4], kv[:, 4]
        w = (m.q_weight * m.k_weight).double()
        x = h[0]
        dot = (x * w * key).sum(-1)
        dot = dot / torch.sqrt(x.pow(2).mean(-1) + 1e-6) / torch.sqrt(key.pow(2).mean(-1) + 1e-6)
        dot = dot / config.hidden_size**0.5
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())  # (T, hc)
        got = torch.tensor([t["layers"][str(lid)]["gates"] for t in report["tokens"]], dtype=torch.float64)
        torch.testing.assert_close(got, gate, rtol=1e-4, atol=1e-5)
        h = h + gate[None, :, :, None] * v[None, :, None, :]


def test_pseudo_embedding():
    x = pseudo_embedding(np.array([5, 7, 5]), hc=4, dim=16, seed=1)
    assert x.shape == (1, 3, 4, 16) and x.dtype == torch.float32
    assert torch.equal(x[0, 0], x[0, 2]) and not torch.equal(x[0, 0], x[0, 1])
    assert all(torch.equal(x[0, :, 0], x[0, :, m]) for m in range(4))  # identical streams
    assert not torch.equal(x, pseudo_embedding(np.array([5, 7, 5]), hc=4, dim=16, seed=2))


def test_command_json(capsys):
    args = parser().parse_args(["run-layer", "--base", str(BASE), "--hidden-size", "32", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["n_tokens"] == 13 and out["dim"] == 32 and out["hc"] == 4
    assert "build_checkpoint" in out["seconds"]


def test_command_text_on_a_checkpoint(prebuilt, capsys, monkeypatch, ds_compression):
    from engram.addressing.compression import TokenizerCompression

    # the JSON test built the map the slow way already; reuse the session's here
    monkeypatch.setattr(TokenizerCompression, "from_tokenizer", classmethod(lambda cls, tok: ds_compression))
    args = parser().parse_args(["run-layer", "--checkpoint", str(prebuilt), "--text", "北京是中国的首都。"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"from {prebuilt}" in out and "layer 1: MmapFP8Table" in out and "layer 14: MmapFP8Table" in out
    assert "OUT OF RANGE" not in out and out.rstrip().endswith("ok")


def test_refusals(prebuilt, ds_compression):
    with pytest.raises(ValueError, match=r"--base size the checkpoint run-layer builds, but --checkpoint"):
        run_layer(prebuilt, base=512, compression=ds_compression)
    with pytest.raises(ValueError, match=r"seed=-1 must be an int >= 0"):
        run_layer(seed=-1, compression=ds_compression)
    with pytest.raises(ValueError, match="is empty"):
        run_layer(text="  ", compression=ds_compression)
    with pytest.raises(ValueError, match=r"--base 16000000 would write 202\.8 GB of tables"):
        run_layer(base=16_000_000, compression=ds_compression)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        run_layer(prebuilt / "nope", compression=ds_compression)


def test_a_damaged_checkpoint_names_the_real_cause(prebuilt, tmp_path, monkeypatch, ds_compression, capsys):
    from safetensors.torch import load_file, save_file

    from engram.cli import main
    from engram.storage import integrity

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for p in prebuilt.iterdir():
        (ckpt / p.name).write_bytes(p.read_bytes())
    shard = next(ckpt.glob("*.safetensors"))
    good = load_file(str(shard))
    row = run_layer(prebuilt, compression=ds_compression)["tokens"][2]["layers"]["14"]["rows"][1]

    t = dict(good)
    t["layers.1.engram.wkv.weight"] = t["layers.1.engram.wkv.weight"].clone()
    t["layers.1.engram.wkv.weight"][3, 4] = float("nan")
    save_file(t, str(shard))
    with pytest.raises(ValueError, match=r"tensor 'layers.1.engram.wkv.weight': 1 of its .* NaN or Inf"):
        run_layer(ckpt, compression=ds_compression)

    t = dict(good)
    raw = t["layers.14.engram.embed.weight"].clone().view(torch.uint8)
    raw[row, 10] = 0xFF  # NaN in e4m3, in a row the text reads
    t["layers.14.engram.embed.weight"] = raw.view(torch.float8_e4m3fn)
    save_file(t, str(shard))
    with pytest.raises(ValueError, match=rf"at row {row}, column 10"):  # small table: scanned at load
        run_layer(ckpt, compression=ds_compression)
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 1024)  # as if the table were large
    with (
        pytest.warns(integrity.UnscannedTableWarning),
        pytest.raises(
            ValueError,
            match=rf"layer 14's table .* is damaged: row {row}, read for token 2 .*1 value byte\(s\) "
            r"0x7F / 0xFF .* run with --verify",
        ),
    ):
        run_layer(ckpt, compression=ds_compression)
    monkeypatch.setattr(
        "engram.addressing.compression.TokenizerCompression.from_tokenizer",
        classmethod(lambda cls, tok: ds_compression),
    )
    assert main(["run-layer", "--checkpoint", str(ckpt), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram run-layer: error: ") and f"at row {row}, column 10" in err


def test_convert_refuses_what_run_layer_refuses(prebuilt, tmp_path, ds_compression, capsys):
    """`engram convert` used to write a checkpoint whose config.json run-layer refuses (a compressed
    vocabulary the DeepSeek-V4 map contradicts): both check it with `check_tokenizer_fit`. The tables
    are rewritten without metadata, as DeepSeek's own files are (no layout fingerprint to refuse them)."""
    from safetensors.torch import load_file, save_file

    from engram.checkpoint.convert import convert_table
    from engram.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for p in prebuilt.iterdir():
        (ckpt / p.name).write_bytes(p.read_bytes())
        if p.suffix == ".safetensors":
            save_file(load_file(str(ckpt / p.name)), str(ckpt / p.name), metadata={"format": "pt"})
    good = json.loads((ckpt / "config.json").read_text())
    fits = rf"{ckpt / 'config.json'} does not fit the deepseek-v4 tokenizer's compression map: "
    (ckpt / "config.json").write_text(json.dumps(good | {"engram_compressed_vocab_size": 5000}))
    with pytest.raises(ValueError, match=fits + ".*compressed_vocab_size=5000"):
        run_layer(ckpt, compression=ds_compression)
    with pytest.raises(ValueError, match=fits + ".*compressed_vocab_size=5000"):
        convert_table(ckpt, tmp_path / "dst", to="float")
    assert not (tmp_path / "dst").exists()  # refused before anything is written
    assert main(["convert", str(ckpt), str(tmp_path / "dst"), "--to", "float"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram convert: error: ") and "compressed_vocab_size=5000" in err
    (ckpt / "config.json").write_text(json.dumps(good | {"vocab_size": 100000}))
    with pytest.raises(ValueError, match=fits + ".*covers 129280 tokenizer ids .* vocab_size=100000"):
        convert_table(ckpt, tmp_path / "dst", to="float")
