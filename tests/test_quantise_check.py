"""`engram quantise-check` (engram.cli.quantise; engram.apps.tools.quantise_check, quantise_report) on
a tiny trained run of the small LM and a tiny engram.hf folder: the float reference's loss is `engram
eval`'s / `hf-eval`'s exactly, FP8 and INT8 cost little, 4-bit more, the gate's exit status both ways,
the seed summary's verdicts, bad input refused with one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_setup import CPU, refused
from engram.apps.tools import quantise_check as Q
from engram.apps.tools import quantise_report as R
from engram.cli import main
from engram.rowformat.formats import RowFormat
from training_setup import tiny_cfg, write_corpus

pytestmark = pytest.mark.slow


def run_json(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict]:
    code = main(["quantise-check", *map(str, argv), "--threads", "1", "--json", *CPU])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory) -> Path:
    """A finished 30-step tiny run with one Engram layer of 32-wide rows (one scale block a row)."""
    from engram.apps.lm.train import Trainer, build_model, prepare_data

    out = tmp_path_factory.mktemp("run") / "run"
    cfg = tiny_cfg(corpus, steps=30, eval_every=0, engram_kw={"head_dim": 32}, threads=1)
    data = prepare_data(cfg)
    Trainer(cfg, data, build_model(cfg, data), out_dir=out).run()
    return out


@pytest.fixture(scope="module")
def checked(run_dir) -> dict:
    """quantise-check's result on the run, every format (the library call the command makes)."""
    torch.set_num_threads(1)
    return Q.check_folder(run_dir, tuple(RowFormat), top=3)


def by_format(result: dict) -> dict[str, dict]:
    return {r["format"]: r for r in result["formats"]}


def test_float_reference_is_engram_eval_and_formats_cost_in_order(run_dir, checked, capsys):
    assert main(["eval", "--checkpoint", str(run_dir), "--threads", "1", "--json", *CPU]) == 0
    own = json.loads(capsys.readouterr().out)["results"]["model"]
    f = by_format(checked)
    assert list(f) == ["float", "fp8", "int8", "int8-row", "int4"]
    assert (
        f["float"]["loss"] == own["loss"] and f["float"]["tokens"] == own["tokens"]
    )  # the same sums, bit for bit
    assert f["float"]["loss_change"] == 0.0
    for name in ("fp8", "int8", "int8-row", "int4"):
        assert f[name]["loss_change"] == f[name]["loss"] - own["loss"]
        assert f[name]["tokens"] == own["tokens"]
    # INT8 keeps ~8 bits a value, FP8 ~4 significant bits, 4-bit ~3: the tables' relative errors in order,
    # and the loss moves with them (the tiny model's changes: int8 ~3e-7, fp8 ~1e-5, int4 ~6e-5)
    rel = {k: f[k]["table_relative_error"] for k in f}
    assert rel["int8"] < rel["fp8"] < rel["int4"] and rel["int8"] < 0.01 and rel["int4"] < 0.2
    assert abs(f["int8"]["loss_change"]) < abs(f["fp8"]["loss_change"]) < abs(f["int4"]["loss_change"])
    assert abs(f["fp8"]["loss_change"]) < 1e-3 and abs(f["int8"]["loss_change"]) < 1e-4
    # 32-wide rows are one scale block: int8 and int8-row are the same bytes, so the same model
    assert f["int8"]["loss"] == f["int8-row"]["loss"] and f["int8-row"]["bytes_per_row"] == 34


def test_sizes_accuracy_split_and_worst_rows(run_dir, checked):
    f = by_format(checked)
    assert [(f[k]["bytes_per_row"], f[k]["v41_bytes_per_row"]) for k in f] == [
        (128, 1024),
        (33, 264),
        (34, 272),
        (34, 258),
        (18, 144),
    ]
    assert f["fp8"]["v41_table_gb"] == pytest.approx(768_022_850 * 264 / 1e9)  # V4.1's two tables
    nt = f["float"]["next_token"]
    assert nt["memory_tokens"] + nt["generalisation_tokens"] <= nt["tokens"] == f["float"]["tokens"]
    assert nt["memory_tokens"] > 0 and nt["generalisation_tokens"] > 0 and checked["ngram"] == 4
    # the worst rows are the largest |error| of the table, recomputed here from the stored rows
    from engram.apps.lm.run_checkpoint import load_trained_model
    from engram.model.table import dequantize_table, quantize_table

    w = load_trained_model(run_dir)[1].engrams["1"].table.weight.detach()
    back = dequantize_table(*quantize_table(w, "int4"), torch.float32)
    err = (back - w).abs().amax(dim=1)
    worst = f["int4"]["worst_rows"]
    assert [r["row"] for r in worst] == err.topk(3).indices.tolist() and {r["layer"] for r in worst} == {"1"}
    assert worst[0]["max_abs_error"] == pytest.approx(float(err.max()))
    r0 = worst[0]["row"]
    assert worst[0]["relative_error"] == pytest.approx(
        float((back[r0] - w[r0]).norm() / w[r0].norm()), rel=1e-5
    )


def test_each_table_is_quantised_once_per_format_and_measured_as_served(run_dir, monkeypatch):
    """The bytes the model is scored with are the bytes the errors are measured on: one quantisation a
    table and format, and the table's relative error is that of those bytes."""
    calls: list[str] = []
    real = Q.quantize_table

    def counted(weight, fmt):
        calls.append(RowFormat(fmt).value)
        return real(weight, fmt)

    monkeypatch.setattr(Q, "quantize_table", counted)
    torch.set_num_threads(1)
    f = by_format(Q.check_folder(run_dir, (RowFormat.INT4_BLOCK32, RowFormat.FP8), top=1))
    assert calls == ["int4", "fp8"]  # one Engram layer: once each
    from engram.apps.lm.run_checkpoint import load_trained_model
    from engram.model.table import dequantize_table

    w = load_trained_model(run_dir)[1].engrams["1"].table.weight.detach()
    for name in ("int4", "fp8"):
        back = dequantize_table(*real(w, name), torch.float32)
        e = Q.row_errors(w, *real(w, name))
        assert e.table_rel == f[name]["table_relative_error"]
        assert e.table_rel == pytest.approx(float((back - w).double().norm() / w.double().norm()), rel=1e-9)
        assert torch.equal(e.max_abs, (back - w).abs().amax(dim=1))


def test_the_gate_exits_1_naming_the_format_and_0_within(run_dir, capsys):
    code = main(
        [
            "quantise-check",
            str(run_dir),
            "--formats",
            "int4",
            "--max-loss-increase",
            "0",
            "--threads",
            "1",
            *CPU,
        ]
    )
    out = capsys.readouterr()
    assert code == 1
    assert "engram quantise-check: gate: int4 raises the held-out loss of" in out.err
    assert "more than --max-loss-increase 0" in out.err and "int4" in out.out
    # two folders (here the run and a copy of it, one seed): the seed summary, no spread, a gate that passes
    import shutil

    copy = run_dir.parent / "copy"
    if not copy.exists():
        shutil.copytree(run_dir, copy)
    code, r = run_json(capsys, run_dir, copy, "--formats", "int8,fp8", "--max-loss-increase", "1")
    assert code == 0 and r["gate"] == {"max_loss_increase": 1.0, "failed": []}
    assert [s["format"] for s in r["seed_summary"]] == ["int8", "fp8"]
    assert r["seed_summary"][0]["float_seed_spread"] is None  # one seed: unknown, not 0


def test_seed_summary_says_which_format_loses_more_than_the_seed_spread():
    def result(loss: float, changes: dict[str, float], seed: int) -> dict:
        rows = [{"format": "float", "loss": loss, "loss_change": 0.0}]
        return {
            "folder": "x",
            "seed": {"seed": seed},
            "formats": rows + [{"format": k, "loss_change": v} for k, v in changes.items()],
        }

    seeds = [result(4.20, {"int8": 0.001, "int4": 0.05}, 0), result(4.22, {"int8": -0.001, "int4": 0.07}, 1)]
    s = {d["format"]: d for d in R.seed_summary(seeds)}
    spread = 0.02 / 2**0.5  # the float losses' standard deviation
    assert s["int8"]["float_seed_spread"] == pytest.approx(spread) and s["int8"]["within_seed_spread"]
    assert s["int4"]["loss_change_mean"] == pytest.approx(0.06) and not s["int4"]["within_seed_spread"]
    lines = R.format_summary(R.seed_summary(seeds), 2)
    assert "int8" in lines[1] and "+0.00000 +- 0.00141: within the seed spread (0.00x)" in lines[1]
    assert "int4" in lines[2] and "LOSES MORE than the seed spread (4.24x)" in lines[2]
    assert R.gate_failures(seeds, 0.06) == [
        "int4 raises the held-out loss of x by +0.070000 nats/token, more than --max-loss-increase 0.06"
    ]
    with pytest.raises(ValueError, match="2 or more folders"):
        R.seed_summary(seeds[:1])


# ------------------------------------------------------------------------------------------- HF folders
@pytest.fixture(scope="module")
def hf_out(tmp_path_factory) -> tuple[Path, Path]:
    """(an engram.hf folder hf-train wrote: tiny Llama + Engram at layer 1, 10 steps; its corpus)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import hf_setup as S
    from engram.apps.lm.corpus import kjv_path

    root = tmp_path_factory.mktemp("hf")
    folder = S.save_folder(root / "tiny-llama", layers=3, seed=1)
    corpus = root / "genesis.jsonl"
    with kjv_path().open(encoding="utf-8") as f:
        corpus.write_text("".join(next(f) for _ in range(160)), encoding="utf-8")
    out = root / "out"
    fast = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--threads", "1", "--steps", "10"]
    assert (
        main(
            ["hf-train", str(folder), "--corpus", str(corpus), "--out", str(out), "--lr", "3e-3", *fast, *CPU]
        )
        == 0
    )
    return out, corpus


def test_hf_folder_reference_is_hf_eval_and_every_format_is_scored(hf_out, capsys):
    out, corpus = hf_out
    capsys.readouterr()
    assert main(["hf-eval", str(out), "--corpus", str(corpus), "--threads", "1", "--json", *CPU]) == 0
    own = json.loads(capsys.readouterr().out)
    code, r = run_json(capsys, out, "--worst", "2")  # the corpus and split from the run's engram_train.json
    assert code == 0 and r["seed_summary"] is None
    (res,) = r["folders"]
    f = by_format(res)
    assert res["kind"] == Q.FolderKind.HF and list(f) == ["float", "fp8", "int8", "int8-row", "int4"]
    assert (
        f["float"]["loss"] == pytest.approx(own["loss"], abs=1e-12) and f["float"]["tokens"] == own["tokens"]
    )
    assert all(abs(f[k]["loss_change"]) < 0.01 for k in f) and len(f["int4"]["worst_rows"]) == 2
    assert res["tables"] == [{"layer": "1", "rows": 4392, "dim": 32, "stored": "float32"}]


def test_hf_folder_on_a_held_out_text(hf_out, capsys, tmp_path):
    """--held-text (a `study pretrained` run's held.txt): its blocks scored, the whole corpus the training
    text; the float loss is the probes' loss of those blocks."""
    from engram.apps.hf.corpus import split_blocks
    from engram.apps.hf.folder import load_model, load_tokenizer
    from engram.apps.lm.corpus import kjv_path
    from engram.apps.study.probes import greedy_predictions_and_loss

    out = hf_out[0]
    with kjv_path().open(encoding="utf-8") as f:
        verses = [json.loads(line)["text"] for line in list(f)[400:460]]
    held = tmp_path / "held.txt"
    held.write_text("\n\n".join(verses), encoding="utf-8")
    code, r = run_json(capsys, out, "--held-text", held, "--formats", "int8", "--max-blocks", "6")
    assert code == 0
    (res,) = r["folders"]
    tok = load_tokenizer(str(out))
    blocks = split_blocks(tok(held.read_text(), add_special_tokens=False)["input_ids"], 32, 0.0)[0][:6]
    model = load_model(str(out), tokenizer=tok)  # an Engram model: its part attached
    want = greedy_predictions_and_loss(model, blocks, 8)[1]["loss"]
    assert res["blocks"] == 6 and res["formats"][0]["loss"] == pytest.approx(want, abs=1e-12)
    assert [x["format"] for x in res["formats"]] == ["float", "int8"]


# ------------------------------------------------------------------------------------------- refusals
def test_bad_input_is_refused_with_the_fix(run_dir, hf_out, corpus, tmp_path, capsys):
    refused(
        capsys,
        ["quantise-check", str(run_dir), "--formats", "fp8,int3"],
        "'int3'",
        "fp8, int8, int8-row, int4",
    )
    refused(capsys, ["quantise-check", str(run_dir), "--formats", ","], "names no format")
    refused(capsys, ["quantise-check", str(run_dir), "--max-loss-increase", "-1"], "finite number >= 0")
    refused(
        capsys,
        ["quantise-check", str(hf_out[0]), "--seq-len", "1"],
        "argument --seq-len",
        "no next token to predict",
    )
    refused(capsys, ["quantise-check", str(tmp_path)], "neither a training run", "config.json")
    refused(capsys, ["quantise-check", str(run_dir), "--corpus", str(hf_out[1])], "drop --corpus")
    refused(capsys, ["quantise-check", str(hf_out[0]), "--max-tokens", "100"], "drop --max-tokens")
    refused(capsys, ["quantise-check", str(run_dir), str(hf_out[0])], "two kinds")
    refused(capsys, ["quantise-check", str(hf_out[0]), "--held-out", "0"], "held nothing out", "--held-text")
    base = hf_out[0].parent / "tiny-llama"
    refused(capsys, ["quantise-check", str(base), "--corpus", str(hf_out[1])], "no Engram part")
    # a baseline run: no table
    from engram.apps.lm.train import Trainer, build_model, prepare_data

    cfg = tiny_cfg(corpus, steps=2, eval_every=0, engram=None, threads=1)
    data = prepare_data(cfg)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path / "base").run()
    refused(
        capsys, ["quantise-check", str(tmp_path / "base"), *CPU], "without Engram", "no table to quantise"
    )
