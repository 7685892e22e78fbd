"""`engram study` at tiny size: every study writes its records, report and plot; runs are cached
and resumed; the plans hold what they promise; bad input is refused in one line."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest

from cli_setup import CPU
from engram.apps.lm.train import build_model, prepare_data
from engram.apps.study.report import compare
from engram.apps.study.studies import STUDIES, plan_study, run_key, run_study, study_base
from engram.cli import main
from engram.device import Precision
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
    # float32 (no precision given) keys are those of runs cached before precisions; bf16's are others;
    # the device is never in a key (a run cached on the GPU serves the CPU)
    blob = {
        k: v
        for k, v in base.to_dict().items()
        if k not in ("threads", "extra", "keep_checkpoints", "checkpoint_every")
    }
    old = hashlib.sha256(json.dumps({"v": 1, "config": {**blob, "corpus": "fp"}}, sort_keys=True).encode())
    assert k == run_key(base, "fp", Precision.FLOAT32) == old.hexdigest()[:20]
    assert run_key(base, "fp", Precision.BF16) != k


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
    from engram.apps.study.studies import table_rows

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
    argv += ["--quick", "--out", str(out), "--no-progress", "--threads", "1", "--json", *CPU]
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


# ---------------------------------------------------------------------------- the optimizers study
def test_optimizers_plan(base):
    from engram.apps.study.plans import (
        OPTIMIZER_LR_STEP,
        QUICK_RECIPE_EMBEDDING_LR_FACTORS,
        RECIPE_EMBEDDING_LR_FACTORS,
        optimizer_lrs,
    )

    opts = ("sinkhorn", "adam", "dense-adam", "adagrad")
    for quick, n_lrs in ((False, 3), (True, 2)):
        plan = plan_study("optimizers", base, (0, 1, 2), quick=quick, vocab=100)
        factors = QUICK_RECIPE_EMBEDDING_LR_FACTORS if quick else RECIPE_EMBEDDING_LR_FACTORS
        per_seed = 4 * n_lrs + len(factors) + 1
        assert len(plan) == 3 * per_seed and [s.seed for s in plan] == [
            s // per_seed for s in range(len(plan))
        ]
        sweep = [s for s in plan[:per_seed] if s.x is not None]
        assert [s.cfg.table_optimizer for s in sweep] == [o for o in opts for _ in range(n_lrs)]
        for o in opts:
            lrs = [s.cfg.table_lr for s in sweep if s.cfg.table_optimizer == o]
            assert (
                lrs
                == list(optimizer_lrs(base, o, quick))
                == [s.x for s in sweep if s.cfg.table_optimizer == o]
            )
            assert all(
                b / a == pytest.approx(OPTIMIZER_LR_STEP, rel=0.01) for a, b in itertools.pairwise(lrs)
            )
            assert optimizer_lrs(base, o)[1] in lrs  # quick keeps the centre
        assert all(s.cfg.embedding_optimizer == "adamw" for s in sweep)
        assert all(s.cfg.replace(table_optimizer="adam", table_lr=base.table_lr) == base for s in sweep)
        *recipes, adamw = plan[per_seed - 1 - len(factors) : per_seed]
        assert adamw.variant == "AdamW everywhere" and adamw.x is None
        for recipe, factor in zip(recipes, factors, strict=True):
            assert recipe.variant == f"V4.1 recipe, embedding lr {base.lr * factor:g}" and recipe.x is None
            assert recipe.cfg.table_optimizer == "sinkhorn" and recipe.cfg.embedding_optimizer == "sinkhorn"
            assert recipe.cfg.table_lr == optimizer_lrs(base, "sinkhorn")[1]
            assert recipe.cfg.embedding_lr == pytest.approx(base.lr * factor)
        assert adamw.cfg.table_optimizer == "dense-adam" and adamw.cfg.embedding_optimizer == "adamw"
        # AdamW everywhere is the dense Adam run at its centre: the same cache key, trained once
        same = [s for s in sweep if s.cfg == adamw.cfg]
        assert len(same) == 1 and run_key(same[0].cfg, "fp") == run_key(adamw.cfg, "fp")
    quick = study_base(quick=True)
    assert quick.dim == 64 and optimizer_lrs(quick, "adam", True)[0] == 2 * quick.table_lr


def test_optimizer_state_is_recorded(studied):
    """The records hold each table optimizer's measured state: the documented bytes per parameter."""
    from engram.apps.study.report import state_bytes_per_param

    _, results = studied
    seen = set()
    for r in results["optimizers"]["runs"]:
        st, opt = r["table_state"], r["settings"]["table_optimizer"]
        seen.add(opt)
        per, dim = st["state_bytes"] / st["params"], st["dim"]
        if opt == "sinkhorn":
            assert 0 < st["active_rows"] <= st["rows"]
            assert per == pytest.approx(state_bytes_per_param(opt, dim, st["active_rows"] / st["rows"]))
        else:
            assert st["active_rows"] is None
            assert per == pytest.approx(state_bytes_per_param(opt, dim), rel=1e-3)  # Adam's step counters
        emb = r["embedding_state"]
        if r["settings"]["embedding_optimizer"] == "sinkhorn":
            assert 0 < emb["active_rows"] <= emb["rows"]
        else:
            assert emb["state_bytes"] / emb["params"] == pytest.approx(8.0, rel=1e-3)  # AdamW's two moments
    assert seen == {"sinkhorn", "adam", "dense-adam", "adagrad"}


def _fabricated_optimizer_results(losses: dict[tuple[str, float | None, str], list[float]]) -> dict:
    """run_study's results for the optimizers study from made-up losses: (table optimizer, table lr
    (None: part 2), embedding optimizer) -> one loss per seed."""
    runs = []
    dim, rows = 32, 1000
    for key, ls in losses.items():
        opt, lr, emb, emb_lr = (*key, None) if len(key) == 3 else key
        for seed, loss in enumerate(ls):
            active = 250 if opt == "sinkhorn" else None
            n = active if opt == "sinkhorn" else rows
            state = {"adam": 4 * n * dim + 8 * n, "adagrad": 4 * n, "dense-adam": 8 * n * dim}.get(
                opt, 4 * n * dim + 8 * n
            )
            name = (
                f"{opt} {lr}"
                if lr is not None
                else (f"V4.1 recipe, embedding lr {emb_lr:g}" if emb == "sinkhorn" else "AdamW everywhere")
            )
            table_lr = lr if lr is not None else 0.05
            runs.append(
                {
                    "key": f"{opt}/{table_lr}/{emb}/{emb_lr}/{seed}",  # AdamW everywhere: dense Adam 0.05's runs
                    "cached": False,
                    "variant": name,
                    "seed": seed,
                    "x": lr,
                    "note": "",
                    "settings": {
                        "table_optimizer": opt,
                        "table_lr": table_lr,
                        "embedding_optimizer": emb,
                        "embedding_lr": emb_lr,
                        "engram": {"head_dim": dim},
                    },
                    "held_out_loss": loss,
                    "params": {"total": 1, "activated": 1},
                    "tokens_per_s": 1.0,
                    "table_state": {
                        "params": rows * dim,
                        "rows": rows,
                        "dim": dim,
                        "state_bytes": state,
                        "active_rows": active,
                    },
                    "embedding_state": {
                        "params": 10,
                        "rows": 5,
                        "dim": 2,
                        "state_bytes": 80,
                        "active_rows": None,
                    },
                }
            )
    return {
        "study": "optimizers",
        "command": "engram study optimizers",
        "corpus": "kjv",
        "train_tokens": 1,
        "held_out_tokens": 1,
        "vocab_size": 1,
        "seeds": [0, 1, 2],
        "base_config": {
            "table_lr": 0.05,
            "tokenizer": "bpe",
            "steps": 1,
            "batch_size": 1,
            "seq_len": 1,
            "n_layers": 1,
            "dim": 1,
            "engram": {"layer_ids": [1], "n_heads": 1, "head_dim": dim, "max_ngram_size": 3},
        },
        "runs": runs,
        "new_runs": len({r["key"] for r in runs}),
        "wall_seconds": 1.0,
    }


def test_optimizers_report_on_fabricated_runs(tmp_path):
    from engram.apps.study.report import study_lines, write_study_report

    def grid(opt, best_at, best, step=0.05):
        """Three lrs 0.025 / 0.05 / 0.1, the loss lowest (`best`) at `best_at`, 3 seeds a little apart."""
        out = {}
        for lr in (0.025, 0.05, 0.1):
            m = best + (0 if lr == best_at else step)
            out[(opt, lr, "adamw")] = [m - 0.002, m, m + 0.002]
        return out

    losses = (
        grid("sinkhorn", 0.1, 4.10)
        | grid("adam", 0.05, 4.20)
        | grid("dense-adam", 0.05, 4.201)
        | grid("adagrad", 0.025, 4.30)
    )
    losses[("sinkhorn", None, "sinkhorn", 0.012)] = [4.098, 4.10, 4.102]
    losses[("sinkhorn", None, "sinkhorn", 0.024)] = [4.118, 4.12, 4.122]
    losses[("dense-adam", None, "adamw")] = losses[("dense-adam", 0.05, "adamw")]
    res = _fabricated_optimizer_results(losses)
    write_study_report(res, tmp_path)
    f = res["findings"]
    assert f[0].startswith("Sinkhorn: best table lr 0.1 of 0.025 / 0.05 / 0.1, 4.1000 ± 0.0020")
    assert "the highest lr of the grid: the optimum may lie beyond it" in f[0]
    assert "best table lr 0.05" in f[1] and "optimum may lie beyond" not in f[1]  # SparseRowAdam, inside
    assert "the lowest lr of the grid" in f[3]  # Adagrad
    claim = next(x for x in f if x.startswith("Sinkhorn (best, lr 0.1) vs SparseRowAdam (best, lr 0.05)"))
    assert "-0.1000 nats/token" in claim and "larger than the seed spread" in claim and "holds here" in claim
    dense = next(x for x in f if x.startswith("dense Adam (best, lr 0.05) vs SparseRowAdam"))
    assert "within the seed spread" in dense  # 0.001 apart, spread 0.002
    recipe = next(x for x in f if x.startswith("V4.1 recipe, embedding lr 0.012 vs AdamW everywhere"))
    assert "not the best lr of part 1 for Sinkhorn" in recipe and "-0.1010" in recipe
    assert "the recipe's best embedding lr 0.012 of 0.012 / 0.024" in recipe
    state = f[-1]
    assert "SparseRowAdam 4.25" in state and "dense Adam 8" in state and "row-wise Adagrad 0.125" in state
    assert "Sinkhorn 1.06 (25% of the rows active at the end)" in state  # 0.25 * (4 + 8 / 32)
    table = "\n".join(study_lines(res))
    assert "vs adam 0.05 (- is lower)" in table and "| 1.06 (25% of rows active) |" in table
    report = (tmp_path / "report.md").read_text()
    assert "## What was found" in report and (tmp_path / "optimizers.png").stat().st_size > 1000
    assert "(42 runs trained, 0 from the cache, 3 shared by two variants this time" in report

    # Adam ahead by more than the spread: the claim does not hold; level: neither confirmed nor refuted
    worse = _fabricated_optimizer_results(grid("sinkhorn", 0.05, 4.30) | grid("adam", 0.05, 4.20))
    write_study_report(worse, tmp_path / "worse")
    assert any("does not hold here: it is worse" in x for x in worse["findings"])
    level = _fabricated_optimizer_results(grid("sinkhorn", 0.05, 4.201) | grid("adam", 0.05, 4.20))
    write_study_report(level, tmp_path / "level")
    assert any("neither confirmed nor refuted" in x for x in level["findings"])


def test_state_bytes_per_param():
    from engram.apps.study.report import state_bytes_per_param

    assert state_bytes_per_param("adam", 32) == 4.25 and state_bytes_per_param("adagrad", 32) == 0.125
    assert state_bytes_per_param("dense-adam", 32) == 8.0
    assert (
        state_bytes_per_param("sinkhorn", 32, 0.5) == 2.125 and state_bytes_per_param("sinkhorn", 32) is None
    )
    with pytest.raises(ValueError, match="unknown table optimizer 'sgd'"):
        state_bytes_per_param("sgd", 32)
