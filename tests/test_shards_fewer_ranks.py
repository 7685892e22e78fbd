"""A training checkpoint written by fewer ranks than it records (issue 29, bad input): 3 ranks wrote
their row shards, one rank's file is gone. Through the HF path (`load_table_shards`, resumed at 3 ranks
and at 2) and through `engram train --distributed --resume` (3 processes of the CLI), every rank
refuses it naming the rows no file holds, and the CLI says so in one line, without a traceback.
The checkpoints are written by jobs of the suite's 3-rank launch (tests/dist_launch.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_launch as L
import gloo_ranks
from cli_setup import CPU

MISSING = r"rows \[(\d+), (\d+)\) of table '{table}' are in no shard file .*a rank's file is missing"


def _hf_model():
    import hf_setup as S
    from engram.hf import add_engram

    return add_engram(S.llama(seed=3), S.engram_config(), compression=S.compression(), seed=1)


def _resume_hf(folder: Path, group) -> str | None:
    """A fresh born-sharded model on `group`, the optimizer state loaded, then its rows read back from
    `folder`'s shard files: the error (None: it resumed)."""
    from engram.distributed import load_table_shards, prepare_data_parallel
    from engram.hf import build_optimizer

    model = _hf_model()
    prepare_data_parallel(model, "sharded", group=group)
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer="adam")
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    try:
        load_table_shards(model, folder)
    except ValueError as e:
        return str(e)
    return None


def hf_job(ctx) -> dict:
    """3 ranks train one step of a born-sharded model and save their shards (SparseRowAdam state
    too); rank 1's file is removed; resumed at 3 ranks, then at 2 (ranks 0 and 1)."""
    from engram.distributed import prepare_data_parallel, save_table_shards
    from engram.hf import build_optimizer

    rank = dist.get_rank()
    folder = ctx.root / "fewer-ranks-hf"
    model = _hf_model()
    prepare_data_parallel(model, "sharded")
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer="adam")
    ids = torch.randint(1, 250, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    folder.mkdir(exist_ok=True)
    save_table_shards(model, folder)
    if rank == 0:
        torch.save(opt.state_dict(), folder / "optimizer.pt")
    dist.barrier()
    files = sorted(p.name for p in (folder / "engram-shards").iterdir())
    dist.barrier()
    if rank == 0:
        (folder / "engram-shards" / "rank-00001.safetensors").unlink()
    dist.barrier()
    res = {"files": files, "rows": model.engram.table_sync.tables[0].num_rows}
    res["w3"] = _resume_hf(folder, None)
    pair = dist.new_group([0, 1])  # (every rank makes it)
    res["w2"] = _resume_hf(folder, pair) if rank < 2 else None
    dist.barrier()
    return res


def train_job(ctx) -> dict:
    """`engram train --distributed`'s trainer on 3 ranks, born sharded, sharded checkpoints: 2 of the
    run's 6 steps, checkpointed (what the CLI test resumes); rank 0 writes the run's config file."""
    from engram.apps.lm.train import prepare_data
    from engram.apps.lm.train_distributed import DistributedTrainer, build_distributed_model
    from training_setup import dist_cfg

    cfg = dist_cfg(ctx.corpus).replace(eval_every=0)
    data = prepare_data(cfg)
    out = ctx.root / "fewer-ranks-train"
    model = build_distributed_model(cfg, data)
    trainer = DistributedTrainer(cfg, data, model, out_dir=out, sharded_checkpoints=True)
    trainer.run(until=2)
    if dist.get_rank() == 0:
        (ctx.root / "fewer-ranks-train.json").write_text(json.dumps(cfg.to_dict()))
    ckpt = out / "checkpoints" / "step-0000002"
    return {"files": sorted(p.name for p in (ckpt / "engram-shards").iterdir())}


L.register(__name__, 3, "fewer-ranks-hf", "test_shards_fewer_ranks:hf_job")
L.register(__name__, 3, "fewer-ranks-train", "test_shards_fewer_ranks:train_job")


def test_hf_checkpoint_missing_a_ranks_file_is_refused_on_every_rank(dist_launch):
    """Resumed at 3 ranks (the world that wrote it) and at 2: every rank raises the same ValueError,
    naming the rows that were rank 1's, before any row changed."""
    pytest.importorskip("transformers")
    res = L.results(dist_launch(3), "fewer-ranks-hf")
    names = [f"rank-0000{r}.safetensors" for r in range(3)]
    assert all(r["files"] == names for r in res)
    n = res[0]["rows"]
    lo, hi = n // 3, 2 * n // 3  # rank 1's rows of 3
    for world, ranks in (("w3", res), ("w2", res[:2])):
        errors = [r[world] for r in ranks]
        assert all(e == errors[0] for e in errors), errors  # the same on every rank
        err = errors[0]
        assert err is not None and "resuming the Engram tables from" in err, err
        found = re.search(MISSING.format(table="layers.1.table"), err)
        assert found is not None, err
        assert (int(found[1]), int(found[2])) == (lo, hi), err
        print(f"{world}: {err}")


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_cli_resume_missing_a_ranks_file_says_one_line(dist_launch):
    """`engram train --distributed --resume` on 3 processes, over the 3-rank checkpoint whose rank-1
    shard file was removed: every process ends with exit status 2 and one line naming the missing
    rows and the checkpoint, no traceback, no hang."""
    root = dist_launch(3)
    (res,) = {tuple(r["files"]) for r in L.results(root, "fewer-ranks-train")}
    assert res == tuple(f"rank-0000{r}.safetensors" for r in range(3))
    out = root / "fewer-ranks-train"
    ckpt = out / "checkpoints" / "step-0000002"
    (ckpt / "engram-shards" / "rank-00001.safetensors").unlink()
    cmd = [sys.executable, "-m", "engram", "train", "--config", str(root / "fewer-ranks-train.json")]
    cmd += ["--distributed", "--out", str(out), "--resume", "--sharded-checkpoints", "--no-progress"]
    cmd += ["--collective-timeout", "60", *CPU]  # gloo, as the ranks that wrote it
    port = gloo_ranks.free_port()
    procs = []
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("engram train: error:")]
        assert len(lines) == 1, err[-3000:]
        assert f"no intact checkpoint in {out / 'checkpoints'}" in lines[0], lines[0]
        assert re.search(MISSING.format(table=r"engrams\.\d\.table"), lines[0]), lines[0]
        assert not stdout.strip(), stdout
    print(lines[0])
