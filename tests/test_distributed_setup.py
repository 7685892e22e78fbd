"""engram.distributed without spawned worlds: shard layouts, argument checks, the optimizers on an
empty shard, the CLI's `--distributed` options (a 1-rank group in this process) and one torchrun run
of `engram train --distributed` end to end. The spawned 2- and 3-rank comparisons are in
tests/test_distributed.py."""

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
from safetensors.torch import load_file

import gloo_ranks
from cli_setup import CPU
from dist_worker import CHUNKED_ROWS
from engram.apps.lm.train import TrainConfig, evaluate, load_trained_model, prepare_data
from engram.checkpoint.shard_format import SHARDS_FOLDER, shard_file
from engram.distributed import chunked_normal, shard_bounds, table_owners
from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from training_setup import dist_cfg


@pytest.fixture(scope="module")
def cfg(corpus) -> TrainConfig:
    return dist_cfg(corpus)


@pytest.fixture(scope="module")
def data(cfg):
    return prepare_data(cfg)


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


def test_shard_bounds_with_owners():
    """Owners split the rows in rank order; a non-owner's range is empty where it stands."""
    assert shard_bounds(10, 3, owners=None) == shard_bounds(10, 3, owners=(0, 1, 2)) == [0, 3, 6, 10]
    assert shard_bounds(10, 3, owners={0}) == [0, 10, 10, 10]
    assert shard_bounds(10, 3, owners={0, 1}) == [0, 5, 10, 10]
    assert shard_bounds(10, 3, owners=[2, 1]) == [0, 0, 5, 10]  # any order: rows follow rank order
    assert shard_bounds(11, 4, owners=(0, 2)) == [0, 5, 5, 11, 11]
    for bad in ((), (3,), (0, 0), (-1,)):
        with pytest.raises(ValueError, match=r"world size is 3.*None for every rank"):
            shard_bounds(10, 3, owners=bad)
    with pytest.raises(TypeError, match="ints"):
        shard_bounds(10, 3, owners=(True,))


def test_table_ranks_validation():
    assert (
        table_owners(None, 3) == (0, 1, 2) and table_owners(1, 3) == (0,) and table_owners(3, 3) == (0, 1, 2)
    )
    for n in (0, 4, -1):
        with pytest.raises(ValueError, match=rf"--table-ranks {n}:.*world size 3.*1 <= N <= 3"):
            table_owners(n, 3)


@pytest.mark.parametrize("cls", [SparseRowAdam, SparseRowAdagrad])
def test_sparse_row_optimizers_take_an_empty_shard(cls):
    """A non-owner's table parameter is (0, dim) and its row gradient empty: the step is a no-op,
    the state is empty, and it survives a state_dict round trip (a checkpoint resume)."""
    p = torch.nn.Parameter(torch.empty(0, 8, dtype=torch.float64))
    opt = cls([p])
    for _ in range(2):
        none = torch.empty(1, 0, dtype=torch.int64)
        p.grad = torch.sparse_coo_tensor(
            none, torch.empty(0, 8, dtype=torch.float64), (0, 8), is_coalesced=True, check_invariants=False
        )
        opt.step()
    assert opt.state[p] and all(v.shape[0] == 0 for v in opt.state[p].values())
    again = cls([p])
    again.load_state_dict(opt.state_dict())
    assert {k: v.shape for k, v in again.state[p].items()} == {k: v.shape for k, v in opt.state[p].items()}


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
    assert main(["train", "--preset", "tiny", "--table-ranks", "1", "--out", str(tmp_path / "z")]) == 2
    assert "--table-ranks applies to sharded tables: add --distributed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ tables


def test_sharded_checkpoints_cli(cfg, monkeypatch, capsys, tmp_path):
    """`--sharded-checkpoints` reaches the DistributedTrainer (default off); without --distributed it
    is refused with the fix."""
    from engram.apps.lm import train_distributed
    from engram.cli import main

    gloo_ranks.one_rank_env(monkeypatch)
    seen = []

    def trainer(*args, **kw):
        seen.append(kw.get("sharded_checkpoints"))
        raise ValueError("stopped before training")

    monkeypatch.setattr(train_distributed, "build_distributed_model", lambda *a, **kw: None)
    monkeypatch.setattr(train_distributed, "DistributedTrainer", trainer)
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    base = ["train", "--config", str(conf), "--out", str(tmp_path / "run"), *CPU]
    assert main([*base, "--sharded-checkpoints"]) == 2
    assert "--sharded-checkpoints applies to sharded tables: add --distributed" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        for extra in (["--sharded-checkpoints"], []):
            assert main([*base, "--distributed", *extra]) == 2
            assert "stopped before training" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)  # init_distributed sets this process's threads
    assert seen == [True, False]


def test_table_ranks_cli(cfg, data, monkeypatch, capsys, tmp_path):
    """`--table-ranks N` under --distributed (a 1-rank group in this process): N out of range is a
    ValueError naming N, the world size and the fix; N = 1 reaches the model as owners (0,)."""
    from engram.apps.lm import train_distributed
    from engram.cli import main

    gloo_ranks.one_rank_env(monkeypatch)
    seen = []

    def build(*args, **kw):
        seen.append(kw.get("owners"))
        raise ValueError("stopped before training")

    monkeypatch.setattr(train_distributed, "build_distributed_model", build)
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    base = ["train", "--config", str(conf), "--distributed", "--out", str(tmp_path / "run"), *CPU]
    threads = torch.get_num_threads()
    try:
        for n in ("2", "0"):
            assert main([*base, "--table-ranks", n]) == 2
            err = capsys.readouterr().err
            assert f"--table-ranks {n}:" in err and "world size 1" in err and "1 <= N <= 1" in err, err
        assert main([*base, "--table-ranks", "1"]) == 2
        assert "stopped before training" in capsys.readouterr().err
        assert main(base) == 2
    finally:
        torch.set_num_threads(threads)  # init_distributed sets this process's threads
    assert seen == [(0,), None]


def test_one_rank_trains_the_one_process_run_and_resumes_across_table_inits(cfg, monkeypatch, tmp_path):
    """`engram train --distributed` on 1 rank (a group in this process) with the default init (chunked,
    born sharded) writes the checkpoints of one-process `engram train`, bit for bit; a run started
    with the old default (`--table-init copy`) resumes under the new one (checkpoints do not record
    the init: both build the same model) and ends at the same checkpoint, and the other way round."""
    from engram.apps.lm import train_distributed
    from engram.cli import main

    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.replace(steps=4, eval_every=0, checkpoint_every=2).to_dict()))
    base = ["train", "--config", str(conf), "--no-progress", "--json", *CPU]  # gloo, bit for bit the CPU's
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    gloo_ranks.one_rank_env(monkeypatch)
    inits = []
    build = train_distributed.build_distributed_model
    monkeypatch.setattr(
        train_distributed,
        "build_distributed_model",
        lambda *a, **kw: inits.append(kw["init"]) or build(*a, **kw),
    )
    dist = [*base, "--distributed"]
    threads = torch.get_num_threads()
    try:
        assert main([*dist, "--out", str(tmp_path / "born")]) == 0
        resumed = {
            "copy-then-default": (["--table-init", "copy"], []),
            "default-then-copy": ([], ["--table-init", "copy"]),
        }
        for name, (first, then) in resumed.items():
            out = ["--out", str(tmp_path / name)]
            assert main([*dist, *out, *first, "--until", "2"]) == 0
            assert main([*dist, *out, *then, "--resume"]) == 0
    finally:
        torch.set_num_threads(threads)  # init_distributed sets this process's threads
    assert [i.value for i in inits] == ["chunked", "copy", "chunked", "chunked", "copy"]
    for step in (2, 4):
        ckpt = f"checkpoints/step-{step:07d}"
        for part in ("model", "optimizer"):
            want = load_file(str(tmp_path / "one" / ckpt / f"{part}.safetensors"))
            for run in ("born", *resumed):
                got = load_file(str(tmp_path / run / ckpt / f"{part}.safetensors"))
                same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
                assert same, (run, step, part)


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
    cmd += ["--table-ranks", "1", "--sharded-checkpoints"]  # rank 1 holds no table rows, writes no shard
    cmd += CPU  # gloo whatever GPUs there are: the loss is compared with evaluate on the CPU
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # printed by rank 0 only
    assert summary["step"] == 2 and len(proc.stdout.strip().splitlines()) == 1
    print(f"torchrun run: {time.perf_counter() - t0:.1f} s")
    _cfg, model, state = load_trained_model(out)
    assert state["step"] == 2
    held = evaluate(model, data.held_out, data.held_rows, cfg.seq_len)
    assert held["loss"] == pytest.approx(summary["held_out"]["loss"], abs=1e-5)
    ckpt = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    assert ckpt["train_config"]["steps"] == 2 and sys.executable
    assert [p.name for p in (Path(summary["checkpoint"]) / SHARDS_FOLDER).iterdir()] == [shard_file(0)]


def test_collective_timeout_reaches_process_group(monkeypatch):
    """init_distributed(timeout=...) (the CLI's --collective-timeout) is the process group's timeout
    (default 300 s); a timeout <= 0 is refused naming the value."""
    import datetime

    import torch.distributed as dist

    from engram.distributed import DEFAULT_COLLECTIVE_TIMEOUT, init_distributed

    gloo_ranks.one_rank_env(monkeypatch)
    seen = []

    def init(backend, **kw):
        seen.append(kw["timeout"])
        raise RuntimeError("stopped before the group starts")

    monkeypatch.setattr(dist, "init_process_group", init)
    for timeout in (7.5, None):
        with pytest.raises(RuntimeError, match="stopped before"):
            init_distributed("gloo", timeout=timeout)
    assert seen == [datetime.timedelta(seconds=7.5), datetime.timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT)]
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match=f"collective timeout {bad!r}: give the seconds"):
            init_distributed("gloo", timeout=bad)


def test_ranks_launched_differently_end_quickly(cfg, data, tmp_path):
    """Two ranks of `engram train --distributed` launched with different --until and --table-init
    (torchrun's environment set by hand, one command line each): both end within seconds with exit
    status 2 and an error naming the rank and every setting that differs, instead of hanging in a
    collective."""
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.replace(eval_every=0).to_dict()))
    port = gloo_ranks.free_port()
    base = [sys.executable, "-m", "engram", "train", "--config", str(conf), "--distributed"]
    base += ["--out", str(tmp_path / "run"), "--no-progress", "--collective-timeout", "60", *CPU]
    extra = (["--until", "2"], ["--until", "4", "--table-init", "copy"])  # rank 0: the default, chunked
    procs = []
    t0 = time.perf_counter()
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([*base, *extra[rank]], env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    print(f"refused in {time.perf_counter() - t0:.1f} s")
    for rank, (p, err) in enumerate(zip(procs, errors, strict=True)):
        assert p.returncode == 2, err[-3000:]
        assert f"rank {rank}'s training config differs from another rank's" in err, err[-3000:]
        assert "--until (rank 0: 2, rank 1: 4)" in err, err[-3000:]
        assert "--table-init (rank 0: 'chunked', rank 1: 'copy')" in err, err[-3000:]
