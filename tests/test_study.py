"""`engram study` at tiny size: every study writes its records, report and plot; runs are cached
and resumed; the plans hold what they promise; bad input is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engram.apps.study import STUDIES, plan_study, run_key, run_study, study_base
from engram.apps.study_report import compare
from engram.apps.train import build_model, prepare_data
from engram.cli import main
from test_cli_hostile import refused
from training_setup import tiny_cfg

SEEDS = (0, 1)


@pytest.fixture(scope="module")
def base(corpus):
    return tiny_cfg(corpus, steps=3, eval_every=2, eval_tokens=256, threads=1)


@pytest.fixture(scope="module")
def studied(base, tmp_path_factory):
    """Every study, quick, into one folder (shared runs), the memory study with two seeds."""
    out = tmp_path_factory.mktemp("study")
    results = {}
    for name in STUDIES:
        seeds = SEEDS if name == "memory" else (0,)
        results[name] = run_study(name, base, seeds=seeds, quick=True, out_dir=out, progress=False)
    return out, results


@pytest.mark.parametrize("name", STUDIES)
def test_study_writes_records_report_and_plot(studied, base, name):
    out, _ = studied
    folder = out / name
    saved = json.loads((folder / "results.json").read_text())
    seeds = SEEDS if name == "memory" else (0,)
    plan = plan_study(name, base, seeds, quick=True, vocab=saved["vocab_size"])
    assert [(r["variant"], r["seed"]) for r in saved["runs"]] == [(s.variant, s.seed) for s in plan]
    for r in saved["runs"]:
        assert math.isfinite(r["held_out_loss"]) and r["held_out"]["tokens"] == saved[
            "held_out_tokens"
        ] - 1 - ((saved["held_out_tokens"] - 1) % base.seq_len)
        assert {"dim", "engram", "row_hash", "moe_experts"} <= set(r["settings"])
        assert (out / "runs" / f"{r['key']}.json").is_file()
    report = (folder / "report.md").read_text()
    assert "## What was found" in report and f"![{name}]({name}.png)" in report
    assert (folder / f"{name}.png").stat().st_size > 1000
    assert len(saved["summary"]) == len(plan) // len(seeds)
    for v in saved["summary"]:
        assert f"{v['mean']:.4f} ± {v['spread']:.4f}" in report  # every number carries its spread
    assert saved["findings"]


def test_memory_study_words_and_spread(studied):
    _, results = studied
    mem = results["memory"]
    assert all(v["spread"] >= 0 and len(v["losses"]) == 2 for v in mem["summary"])
    assert any("per doubling of the rows" in f for f in mem["findings"])
    assert all(("seed spread" in f) for f in mem["findings"][:-2])
    assert [v["x"] for v in mem["summary"][1:]] == sorted(v["x"] for v in mem["summary"][1:])


def test_studies_share_runs_and_a_second_invocation_trains_nothing(studied, base):
    out, results = studied
    # the ablations reuse the memory study's baseline and reference table (seed 0)
    assert sum(r["cached"] for r in results["ablations"]["runs"]) == 2
    again = run_study("memory", base, seeds=SEEDS, quick=True, out_dir=out, progress=False)
    assert again["new_runs"] == 0
    assert [r["held_out_loss"] for r in again["runs"]] == [
        r["held_out_loss"] for r in results["memory"]["runs"]
    ]


def test_interrupted_study_resumes(base, tmp_path):
    first = run_study("allocation", base, seeds=(0,), quick=True, out_dir=tmp_path, progress=False)
    gone = first["runs"][1]
    (tmp_path / "runs" / f"{gone['key']}.json").unlink()  # as if stopped before this run ended
    (tmp_path / "runs" / f"{first['runs'][2]['key']}.json").write_text("{trunc")  # a damaged record
    again = run_study("allocation", base, seeds=(0,), quick=True, out_dir=tmp_path, progress=False)
    assert again["new_runs"] == 2
    assert [r["cached"] for r in again["runs"]] == [True, False, False]
    assert again["runs"][1]["held_out_loss"] == gone["held_out_loss"]  # the same run, bit for bit


def test_run_key(base):
    k = run_key(base, "fp")
    assert run_key(base.replace(threads=2), "fp") == k  # threads change speed only
    assert run_key(base.replace(seed=1), "fp") != k
    assert run_key(base, "other corpus") != k
    assert run_key(base.replace(row_hash="random"), "fp") != k


def test_full_plans(base, corpus):
    data = prepare_data(base, with_engram=False)
    v = data.vocab_size
    abl = {s.variant: s.cfg for s in plan_study("ablations", base, (0,), vocab=v)}
    assert {"gate fixed at 1", "compression off", "random rows", "position rows", "capacity 1"} <= set(abl)
    assert {"order 2 only", "orders 2-4", "1 head per order", "8 heads per order"} <= set(abl)
    ref_rows = _rows(abl["engram base 500"])
    for name in ("order 2 only", "orders 2-4", "1 head per order", "8 heads per order"):
        assert _rows(abl[name]) == pytest.approx(ref_rows, rel=0.05), name  # same total rows
    assert _rows(abl["capacity 1"]) < 50
    mem = plan_study("memory", base, (0, 1), vocab=v)
    assert [s.seed for s in mem] == [0] * 5 + [1] * 5
    assert [s.x for s in mem[1:5]] == sorted(s.x for s in mem[1:5])
    # baselines: the dense models of the same total parameters are within 10 % of Engram's
    bl = plan_study("baselines", base, (0,), vocab=v)
    params = {}
    for s in bl:
        d = prepare_data(s.cfg)
        params[s.variant] = build_model(s.cfg, d).num_params()["total"]
    engram_total = params[bl[0].variant]
    wide, deep = bl[3], bl[4]
    assert params[wide.variant] == pytest.approx(engram_total, rel=0.1)
    d, h = base.dim, base.mlp_hidden
    assert (
        abs(params[deep.variant] - engram_total) <= (4 * d * d + 3 * d * h + 2 * d) / 2 + 1
    )  # nearest depth
    assert params["hashed n-gram input embedding"] < engram_total
    # allocation: the sparse budget is the same for every split, ratios from 0 to 1
    al = plan_study("allocation", base, (0,), vocab=v)
    assert [round(s.x, 1) for s in (al[0], al[-1])] == [0.0, 1.0]
    sparse = []
    for s in al:
        p = build_model(s.cfg, prepare_data(s.cfg)).num_params()
        sparse.append(p["engram_tables"] + p["moe_idle_experts"])
    assert max(sparse) == pytest.approx(min(sparse), rel=0.1)


def _rows(cfg) -> int:
    from engram.apps.study import table_rows

    return table_rows(cfg.engram)


def test_compare_words():
    def v(losses, seeds=(0, 1, 2)):
        import statistics

        return {
            "losses": list(losses),
            "seeds": list(seeds),
            "mean": statistics.fmean(losses),
            "spread": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        }

    ref = v([4.0, 4.01, 3.99])
    assert compare(ref, v([3.9, 3.91, 3.89]))["clear"]
    c = compare(ref, v([3.995, 4.02, 3.98]))
    assert not c["clear"] and "within the seed spread" in c["words"]
    assert "one seed" in compare(v([4.0], (0,)), v([3.0], (0,)))["words"]


def test_cli_custom_corpus_file(corpus, tmp_path, capsys):
    text = "\n".join(p.read_text() for p in sorted(Path(corpus).glob("*.txt")))
    f = tmp_path / "book.txt"
    f.write_text(text)
    out = tmp_path / "out"
    argv = ["study", "memory", "--corpus", str(f), "--size", "tiny", "--steps", "2", "--seeds", "1"]
    argv += ["--quick", "--out", str(out), "--no-progress", "--threads", "1", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got[0]["study"] == "memory" and len(got[0]["summary"]) == 4
    saved = json.loads((out / "memory" / "results.json").read_text())
    assert saved["corpus"] == str(f) and saved["base_config"]["steps"] == 2


def test_study_base_quick_and_sizes():
    q = study_base(quick=True)
    assert q.dim == 64 and q.steps == 150  # the tiny model
    assert study_base("demo").steps == 240 and study_base("demo", steps=50).warmup == 10
    with pytest.raises(ValueError, match="--size 'huge'"):
        study_base("huge")


def test_bad_input_is_refused(capsys, tmp_path):
    refused(capsys, ["study", "nonsense"], "invalid choice", "nonsense")
    refused(capsys, ["study", "memory", "--seeds", "0"], "--seeds", "0")
    refused(capsys, ["study", "memory", "--corpus", str(tmp_path / "none.txt")], "none.txt")
    small = tmp_path / "small.txt"
    small.write_text(
        "In the beginning God created the heaven and the earth.\n" * 40
    )  # 10 % held out: 4 lines
    refused(
        capsys,
        [
            "study",
            "memory",
            "--corpus",
            str(small),
            "--size",
            "tiny",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        "the held-out split has",
        "fewer than one window",
    )
    with pytest.raises(ValueError, match="unknown study 'x'"):
        plan_study("x", study_base("tiny"), (0,), vocab=100)
    with pytest.raises(ValueError, match="seeds"):
        run_study("memory", study_base("tiny"), seeds=(), out_dir=tmp_path)
