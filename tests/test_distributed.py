"""engram.distributed against single-process references: 2 and 3 gloo ranks (3: uneven shards).

Each world size is spawned once (module fixture `runs`); the worker (tests/dist_worker.py) saves
what it saw and the tests compare it with TrainableTable / Trainer runs made here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from dist_worker import ADAM_LR, ADAM_STEPS, CHUNKED_ROWS, SIZES, step_inputs, table_inputs, worker
from engram.distributed import chunked_normal, shard_bounds
from engram.optim import SparseRowAdam
from engram.table import TrainableTable
from engram.train import TrainConfig, Trainer, build_model, evaluate, load_checkpoint, prepare_data
from training_setup import tiny_cfg

WORLDS = (2, 3)


@pytest.fixture(scope="module")
def cfg(corpus) -> TrainConfig:
    return tiny_cfg(
        corpus,
        engram_layers=(0, 1),  # two tables: one exchange for both
        steps=6,
        batch_size=6,
        warmup=2,
        eval_every=3,
        eval_tokens=1024,
        threads=1,
    )


@pytest.fixture(scope="module")
def data(cfg):
    return prepare_data(cfg)


@pytest.fixture(scope="module")
def single(cfg, data):
    """The single-process run the distributed ones must reproduce."""
    t = Trainer(cfg, data, build_model(cfg, data))
    initial = t.evaluate(1024)
    t.run()
    return {"history": t.history, "initial_eval": initial, "final_eval": t.evaluate(1024), "model": t.model}


@pytest.fixture(scope="module")
def single64(cfg, data):
    """The single-process run in float64."""
    t = Trainer(cfg, data, build_model(cfg, data).double())
    t.run()
    return {"history": t.history, "model": t.model}


@pytest.fixture(scope="module")
def runs(cfg, tmp_path_factory) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for world in WORLDS:
        d = tmp_path_factory.mktemp(f"world{world}")
        mp.spawn(worker, args=(world, str(d / "init"), str(d), cfg.to_dict()), nprocs=world)
        ranks = [torch.load(d / f"rank-{r}.pt", weights_only=False) for r in range(world)]
        out[world] = {"dir": d, "ranks": ranks}
    return out


# ------------------------------------------------------------------------------------ no processes
def test_shard_bounds_and_chunked_normal():
    assert shard_bounds(10, 3) == [0, 3, 6, 10] and shard_bounds(5, 1) == [0, 5]
    full = chunked_normal(0, CHUNKED_ROWS, 2, seed=1)
    parts = [chunked_normal(a, b, 2, seed=1) for a, b in ((0, 7), (7, 70_000), (70_000, CHUNKED_ROWS))]
    assert torch.equal(torch.cat(parts), full)
    assert not torch.equal(chunked_normal(0, 10, 2, seed=2), full[:10])
    assert abs(float(full.std()) - 0.02) < 1e-3
    with pytest.raises(ValueError, match="num_rows >= 1"):
        shard_bounds(0, 2)
    with pytest.raises(ValueError, match="lo <= hi"):
        chunked_normal(5, 3, 2)


def test_sharded_table_needs_process_group():
    from engram.distributed import ShardedTable

    with pytest.raises(ValueError, match="init_process_group"):
        ShardedTable(10, 4)


def test_distributed_flag_needs_torchrun(monkeypatch, capsys, tmp_path):
    from engram.cli import main

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["train", "--preset", "tiny", "--distributed", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node" in err and "RANK" in err
    assert main(["train", "--preset", "tiny", "--table-init", "chunked", "--out", str(tmp_path / "y")]) == 2
    assert "--distributed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ tables
@pytest.mark.parametrize("world", WORLDS)
def test_gather_matches_unsharded(runs, world):
    full = table_inputs(torch.float32)
    refs = [TrainableTable(n, 8) for n in SIZES]
    for ref, w in zip(refs, full, strict=True):
        ref.weight.data.copy_(w)
    rows = [r for r, _ in step_inputs(0)]
    b = len(rows[0]) // world
    for rank, res in enumerate(runs[world]["ranks"]):
        for t, ref in enumerate(refs):
            local = rows[t][rank * b : (rank + 1) * b]
            assert torch.equal(res["gathered"][t].detach(), ref.gather(local).detach()), (rank, t)
            assert res["bounds"][t] == shard_bounds(SIZES[t], world)
        assert torch.equal(res["gathered_self"], refs[1].gather(rows[1][rank * b : (rank + 1) * b][:, :2]))
    r0 = runs[world]["ranks"][0]
    assert all(torch.equal(f, w) for f, w in zip(r0["full"], full, strict=True))
    assert all(f is None for r in runs[world]["ranks"][1:] for f in r["full"])  # rank 0 only


def _reference_table_run(steps: int) -> tuple[list[torch.Tensor], list[TrainableTable]]:
    """Unsharded fp64 tables: the first step's coalesced gradients, and the tables after `steps`."""
    refs = [TrainableTable(n, 8, dtype=torch.float64) for n in SIZES]
    for ref, w in zip(refs, table_inputs(torch.float64), strict=True):
        ref.weight.data.copy_(w)
    opt = SparseRowAdam([t.weight for t in refs], lr=ADAM_LR)
    grads = []
    for step in range(steps):
        loss = sum((t.gather(r) * c).sum() for t, (r, c) in zip(refs, step_inputs(step), strict=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = [t.weight.grad.coalesce().to_dense() for t in refs]
        opt.step()
    return grads, refs


@pytest.mark.parametrize("world", WORLDS)
def test_sync_grads_match_unsharded(runs, world):
    grads, _ = _reference_table_run(1)
    for rank, res in enumerate(runs[world]["ranks"]):
        for t, g in enumerate(grads):
            lo, hi = res["bounds"][t][rank], res["bounds"][t][rank + 1]
            torch.testing.assert_close(res["grads"][t], g[lo:hi], rtol=0, atol=1e-12)
            layout, idx = res["grad_layout"][t]
            assert layout == torch.sparse_coo and bool((idx[0, 1:] > idx[0, :-1]).all())  # sorted, distinct
        touched = sum(int((res["grads"][1].abs().sum(1) > 0).sum()) for res in runs[world]["ranks"])
        assert touched == int((grads[1].abs().sum(1) > 0).sum())


@pytest.mark.parametrize("world", WORLDS)
def test_sparse_row_adam_steps_match_unsharded(runs, world):
    _, refs = _reference_table_run(ADAM_STEPS)
    start = table_inputs(torch.float64)
    for got, ref, w0 in zip(runs[world]["ranks"][0]["adam"], refs, start, strict=True):
        assert not torch.equal(got, w0)  # the steps moved rows
        torch.testing.assert_close(got, ref.weight.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_tables(runs, world):
    refs = [TrainableTable(n, 8, dtype=torch.bfloat16) for n in SIZES]
    for ref, w in zip(refs, table_inputs(torch.bfloat16), strict=True):
        ref.weight.data.copy_(w)
    inputs = step_inputs(0)
    outs = [t.gather(r, torch.float32) for t, (r, _) in zip(refs, inputs, strict=True)]
    sum((o * c.float()).sum() for o, (_, c) in zip(outs, inputs, strict=True)).backward()
    b = len(inputs[0][0]) // world
    for rank, res in enumerate(runs[world]["ranks"]):
        for t, ref in enumerate(refs):
            assert torch.equal(res["bf16_gathered"][t], outs[t][rank * b : (rank + 1) * b].detach())
            lo, hi = res["bounds"][t][rank], res["bounds"][t][rank + 1]
            got, want = res["bf16_grads"][t], ref.weight.grad.coalesce().to_dense()[lo:hi]
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)  # bf16 sums


@pytest.mark.parametrize("world", WORLDS)
def test_bad_rows_raise_on_every_rank(runs, world):
    errors = [r["bad_row_error"] for r in runs[world]["ranks"]]
    assert all(e is not None for e in errors)
    assert f"row id {SIZES[1]}" in errors[-1] and "outside" in errors[-1]
    assert all(f"rank(s) [{world - 1}]" in e for e in errors[:-1])
    assert all("was not prefetched" in r["stale_error"] for r in runs[world]["ranks"])


def test_chunked_init_is_world_size_independent(runs, cfg, data):
    expected = chunked_normal(0, CHUNKED_ROWS, 4, seed=3)
    for world in WORLDS:
        assert torch.equal(runs[world]["ranks"][0]["chunked"], expected)
        assert all(r["chunked_local_ok"] for r in runs[world]["ranks"])
    (t2, d2), (t3, d3) = (runs[w]["ranks"][0]["chunked_model"] for w in WORLDS)
    assert all(torch.equal(a, b) for a, b in zip(t2, t3, strict=True)) and len(t2) == 2
    assert d2.keys() == d3.keys() and all(torch.equal(d2[k], d3[k]) for k in d2)
    backbone = build_model(cfg, data, engram=False).state_dict()  # the same backbone draws
    assert all(torch.equal(d2[k], v) for k, v in backbone.items())


# ------------------------------------------------------------------------------------ training
def _check_history(got: list[dict], want: list[dict], tol: float) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for a, b in zip(got, want, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=tol), a["step"]
        assert ("held_out_loss" in a) == ("held_out_loss" in b)
        assert a.get("held_out_loss", 0.0) == pytest.approx(b.get("held_out_loss", 0.0), abs=tol), a["step"]


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_single_process_fp64(runs, single64, world):
    """Same model, same global batch: the same losses and parameters up to summation order."""
    res = runs[world]["ranks"][0]
    _check_history(res["history64"], single64["history"], 1e-10)
    want = single64["model"].state_dict()
    assert res["state64"].keys() == want.keys()
    for k, v in want.items():
        assert res["state64"][k].dtype == torch.float64
        torch.testing.assert_close(res["state64"][k], v, rtol=0, atol=1e-9, msg=k)


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_single_process_fp32(runs, single, world):
    """The fp32 run (what the CLI trains): losses within 5e-5 of one process's (measured: <= 1e-5 on
    train losses, <= 9e-5 on the step-6 held-out loss of W=2); the checkpoint in the single-process format."""
    res = runs[world]["ranks"][0]
    _check_history(res["history"][:4], single["history"][:4], 5e-6)  # before drift compounds
    _check_history(res["history"], single["history"], 2e-4)
    assert all(r["history"] == res["history"] for r in runs[world]["ranks"])  # every rank logs the same
    for key in ("initial_eval", "final_eval"):
        assert res[key]["tokens"] == single[key]["tokens"]
        assert res[key]["loss"] == pytest.approx(single[key]["loss"], abs=2e-4)
    assert res["initial_eval"]["loss"] == pytest.approx(
        single["initial_eval"]["loss"], abs=1e-9
    )  # same model
    got = load_file(str(runs[world]["dir"] / "run" / "checkpoints" / "step-0000006" / "model.safetensors"))
    want = single["model"].state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-2, msg=k)  # Adam-amplified fp32 noise
    assert res["num_params"] == single["model"].num_params()


@pytest.mark.parametrize("world", WORLDS)
def test_distributed_resume_is_exact(runs, world):
    res = runs[world]["ranks"][0]
    assert res["resumed_step"] == 3
    assert res["resumed_history"] == res["history"]
    d = runs[world]["dir"]
    a = load_file(str(d / "run" / "checkpoints" / "step-0000006" / "model.safetensors"))
    b = load_file(str(d / "resumed" / "checkpoints" / "step-0000006" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(str(d / "run" / "checkpoints" / "step-0000006" / "optimizer.safetensors"))
    ob = load_file(str(d / "resumed" / "checkpoints" / "step-0000006" / "optimizer.safetensors"))
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)


def test_distributed_checkpoint_resumes_in_one_process(runs, cfg, data, single):
    """A 2-rank checkpoint at step 3 loads into a single-process Trainer (every optimizer state on
    its parameter, tables whole) and continues along the single run's trajectory."""
    path = runs[2]["dir"] / "run" / "checkpoints" / "step-0000003"
    saved = load_file(str(path / "optimizer.safetensors"))
    t = Trainer(cfg, data, build_model(cfg.replace(seed=5), data))
    t.load_checkpoint(path)
    assert t.step == 3
    for name, opt in (("dense", t.opt), ("table", t.table_opt)):
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            assert opt.state[p]["exp_avg"].shape == p.shape, (name, i)
            assert torch.equal(opt.state[p]["exp_avg"], saved[f"{name}.{i}.exp_avg"]), (name, i)
    table = t.model.engrams["1"].table
    assert t.table_opt.state[table.weight]["exp_avg_sq_row"].shape == (table.num_rows,)
    t.run()
    _check_history(t.history, single["history"], 2e-4)
    for k, v in single["model"].state_dict().items():
        torch.testing.assert_close(t.model.state_dict()[k], v, rtol=0, atol=2e-2, msg=k)


def test_batch_size_must_split(runs):
    for world in WORLDS:
        err = runs[world]["ranks"][0]["batch_error"]
        assert f"batch_size=7 does not split evenly over {world} ranks" in err


def test_eval_reads_distributed_checkpoint(runs, capsys):
    from engram.cli import main

    run = runs[3]["dir"] / "run"
    _cfg, model, state = load_checkpoint(run)
    assert (
        state["step"] == 6 and model.engrams["0"].table.weight.shape[0] == model.engrams["0"].table.num_rows
    )
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]["model"]
    assert res["loss"] == pytest.approx(runs[3]["ranks"][0]["history"][-1]["held_out_loss"], abs=0.2)


# ------------------------------------------------------------------------------------ torchrun
def test_torchrun_cli_end_to_end(cfg, data, tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.replace(steps=2, eval_every=0).to_dict()))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "engram", "train"]  # a free port
    cmd += ["--config", str(conf), "--distributed", "--out", str(out), "--no-progress", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # printed by rank 0 only
    assert summary["step"] == 2 and len(proc.stdout.strip().splitlines()) == 1
    print(f"torchrun run: {time.perf_counter() - t0:.1f} s")
    _cfg, model, state = load_checkpoint(out)
    assert state["step"] == 2
    held = evaluate(model, data.held_out, data.held_rows, cfg.seq_len)
    assert held["loss"] == pytest.approx(summary["held_out"]["loss"], abs=1e-5)
    ckpt = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    assert ckpt["train_config"]["steps"] == 2 and sys.executable
