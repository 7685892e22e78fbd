"""engram.hf across processes (2 and 3 gloo ranks) against one process: a tiny Llama with Engram, a
plain DistributedDataParallel loop with `build_optimizer`, a global batch of 6 as W x 6/W against 1 x 6,
in float64 throughout (the loss computed here, Llama's RMSNorm kept in float64: HF casts both to
float32, whose rounding moves with the batch split).
With `engram.distributed.prepare_data_parallel` (tables out of DDP's buckets; row-sharded, or
replicated with their sparse row gradients averaged) every parameter, tables included, equals the
one-process run (fp64: 1e-9), for every table optimizer; sharded checkpoints resume at 2 and 3 ranks;
without a mode `EngramOptimizer.step` refuses on every rank (each rank would train its own table), and
ranks that attached different Engram are refused before anything changes. The jobs run in the suite's
launch of their world size (tests/dist_launch.py): starting ranks costs seconds each."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dist_launch as L
import hf_setup as S
from engram.hf import EngramCollator, add_engram, build_optimizer

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

BATCH, STEPS = 6, 3
OPTIMIZERS = ("adam", "sinkhorn")


def _rms_norm_in_its_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm without its cast to float32, so that a float64 model computes in float64 throughout
    (the cast rounds differently once the batch split moves a matmul's last bits)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _model(**config) -> torch.nn.Module:
    model = add_engram(S.llama(seed=3), S.engram_config(**config), compression=S.compression()).double()
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.3)
    return model


def _batches(model) -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of BATCH sequences (collated: rows hashed in the data pipeline)."""
    collate = EngramCollator(model, pad_token_id=0)
    out = []
    for step in range(STEPS):
        ids = S.batch(BATCH, 10, seed=50 + step)
        out.append(collate([{"input_ids": row.tolist()} for row in ids]))
    return out


def _step_loss(model, batch) -> torch.Tensor:
    """The next-token loss in float64 (HF's own loss casts the logits to float32)."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, engram_rows=batch["engram_rows"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@functools.cache
def _single(table_optimizer: str) -> dict[str, torch.Tensor]:
    """The one-process run (computed once: tests/test_distributed_hf_fsdp.py and _misuse.py compare with it too)."""
    with mock.patch.object(LlamaRMSNorm, "forward", _rms_norm_in_its_dtype):
        return _train_single(table_optimizer)


def _train_single(table_optimizer: str) -> dict[str, torch.Tensor]:
    model = _model()
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer=table_optimizer)
    for batch in _batches(model):
        _step_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run_job(rank: int, world: int, job: dict, out: str) -> dict:
    """One DDP job on this rank: `job` = prepare (a mode or None), table_optimizer, table_ranks, and
    optionally save (a folder: after step `save_after` write a resumable checkpoint there: the dense
    model and optimizer state from rank 0, the table shards from every rank unless `no_shards`),
    resume (such a folder: start after its step), part (a folder for engram.distributed.save_engram
    after the last step), rank1_config / rank1_table (rank 1 attaches another config / table) with
    expect_refusal (prepare_data_parallel must refuse)."""
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import (
        export_fp8,
        load_table_shards,
        prepare_data_parallel,
        save_engram,
        save_table_shards,
    )

    model = _model(**(job.get("rank1_config", {}) if rank == 1 else {}))
    if rank == 1 and job.get("rank1_table"):  # rank 1's table drawn from another seed
        with torch.no_grad():
            model.engram.module(1).table.weight.normal_(std=0.02, generator=torch.Generator().manual_seed(9))
    prepare = job["prepare"]
    if job.get("expect_refusal"):
        try:
            prepare_data_parallel(model, prepare)
        except ValueError as e:
            return {"error": str(e)}
        raise AssertionError("prepare_data_parallel accepted ranks that disagree")
    mode = (
        None if prepare is None else prepare_data_parallel(model, prepare, table_ranks=job.get("table_ranks"))
    )
    ddp = DistributedDataParallel(model)
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer=job["table_optimizer"])
    sync = model.engram.table_sync
    res: dict = {"error": None, "mode": mode, "ignored": sorted(ddp.parameters_to_ignore)}
    first = 0
    try:
        if job.get("resume"):
            saved = torch.load(f"{job['resume']}/rank0.pt", weights_only=False)
            model.load_state_dict(saved["model"], strict=False)  # the dense part: no table in it
            opt.load_state_dict(saved["optimizer"])
            if not job.get("skip_restore"):
                load_table_shards(model, job["resume"])
            first = saved["step"]
        local = BATCH // world
        for step, batch in enumerate(_batches(model)):
            if step < first:
                continue
            part = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
            _step_loss(ddp, part).backward()
            opt.step()
            opt.zero_grad()
            if job.get("save") and step + 1 == job["save_after"]:
                if not job.get("no_shards"):
                    save_table_shards(model, job["save"])
                if rank == 0:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
                    torch.save(state, f"{job['save']}/rank0.pt")
                dist.barrier()
    except (RuntimeError, ValueError) as e:
        res["error"] = str(e)
        dist.barrier()  # every rank of these jobs fails at the same point
        return res
    res["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if mode == "sharded":  # the whole tables, gathered on rank 0 (a collective)
        res["shard_rows"] = [t.weight.shape[0] for t in sync.tables]
        for lid, t in zip(model.engram.layers, sync.tables, strict=True):
            full = t.full_weight(0)
            if full is not None:
                res["state"][f"engram.layers.{lid}.table.weight"] = full
        if job.get("part"):
            res["part"] = save_engram(model, job["part"])
            res["fp8"] = export_fp8(model, job["part"] + "-fp8")
    return res


PATHS = ("save", "resume", "part")  # a job's folders, under the launch folder


def _job(ctx, **job) -> dict:
    """One job on every rank of a tests/dist_launch.py launch (its folders under `ctx.root`)."""
    LlamaRMSNorm.forward = _rms_norm_in_its_dtype  # this process only
    job = {k: (str(ctx.root / v) if k in PATHS else v) for k, v in job.items()}
    if job.get("save"):
        Path(job["save"]).mkdir(exist_ok=True)
    return _run_job(dist.get_rank(), dist.get_world_size(), job, str(ctx.root))


TABLE = "engram.layers.1.table.weight"
# name: (world, job); the 3-rank jobs resume from the 2-rank jobs' checkpoints
JOBS_2 = {
    "sharded-adam": {"prepare": "sharded", "table_optimizer": "adam", "save_after": 1, "save": "ddp-ckpt-adam"},
    "sharded-sinkhorn": {
        "prepare": "sharded", "table_optimizer": "sinkhorn", "save_after": 1, "save": "ddp-ckpt-sinkhorn",
        "part": "ddp-part",
    },
    "replicated-sinkhorn": {"prepare": "replicated", "table_optimizer": "sinkhorn"},
    "unsynchronised": {"prepare": None, "table_optimizer": "adam"},
    "disagree-table": {"prepare": "replicated", "table_optimizer": "adam", "rank1_table": True, "expect_refusal": True},
    "disagree-config": {
        "prepare": "sharded", "table_optimizer": "adam", "rank1_config": {"seed": 7}, "expect_refusal": True,
    },
    "no-shards": {"prepare": "sharded", "table_optimizer": "adam", "save_after": 1, "save": "ddp-ckpt-bare", "no_shards": True},
    "resume-sinkhorn-2": {"prepare": "sharded", "table_optimizer": "sinkhorn", "resume": "ddp-ckpt-sinkhorn"},
    "resume-no-shards": {"prepare": "sharded", "table_optimizer": "adam", "resume": "ddp-ckpt-bare"},
    "resume-unrestored": {"prepare": "sharded", "table_optimizer": "adam", "resume": "ddp-ckpt-adam", "skip_restore": True},
}  # fmt: skip
JOBS_3 = {
    "sharded-sinkhorn-owners": {"prepare": "sharded", "table_optimizer": "sinkhorn", "table_ranks": 2},
    "sharded-adagrad": {"prepare": "sharded", "table_optimizer": "adagrad"},
    "replicated-adam": {"prepare": "replicated", "table_optimizer": "adam"},
    "resume-adam-3": {"prepare": "sharded", "table_optimizer": "adam", "resume": "ddp-ckpt-adam"},
    "resume-sinkhorn-3": {"prepare": "sharded", "table_optimizer": "sinkhorn", "resume": "ddp-ckpt-sinkhorn"},
}


PREFIX = "ddp-"  # the launch's job names, and the checkpoint folders' (the job's "save")
for _name, _job_kw in {**JOBS_2, **JOBS_3}.items():
    L.register(__name__, 2 if _name in JOBS_2 else 3, PREFIX + _name, "test_distributed_hf:_job", **_job_kw)


@pytest.fixture(scope="module")
def runs(dist_launch) -> dict:
    """Every job's per-rank results (the suite's 2-rank launch, then its 3-rank one), and "folder":
    the launch folder."""
    root = dist_launch(3)
    out: dict = {name: L.results(root, PREFIX + name) for name in {**JOBS_2, **JOBS_3}}
    out["folder"] = root
    return out


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, torch.Tensor]]:
    return {opt: _single(opt) for opt in ("adam", "adagrad", "sinkhorn")}


def _assert_equal_to_one_process(ranks: list[dict], want: dict[str, torch.Tensor]) -> None:
    for res in ranks:
        assert res["error"] is None
        for k, v in res["state"].items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    assert TABLE in ranks[0]["state"]


@pytest.mark.parametrize(
    "name", ["sharded-adam", "sharded-sinkhorn", "replicated-sinkhorn", "sharded-sinkhorn-owners",
             "sharded-adagrad", "replicated-adam"],
)  # fmt: skip
def test_ddp_loop_equals_one_process(runs, single, name):
    """W ranks x B / W equal one process x B (every parameter, the tables included), with the tables
    out of DDP's buckets; sharded: each rank holds its contiguous rows (none on a rank that is not a
    table owner), and its state_dict no table."""
    job = {**JOBS_2, **JOBS_3}[name]
    ranks, want = runs[name], single[job["table_optimizer"]]
    world = len(ranks)
    _assert_equal_to_one_process(ranks, want)
    for rank, res in enumerate(ranks):
        assert res["mode"] == job["prepare"] and TABLE in res["ignored"]  # never in DDP's buckets
        if job["prepare"] == "sharded":
            rows, owners = want[TABLE].shape[0], job.get("table_ranks") or world
            assert res["ignored"] == ["engram.layers.1.table._starts", TABLE]
            lo, hi = rows * rank // owners, rows * (rank + 1) // owners
            assert res["shard_rows"] == [hi - lo if rank < owners else 0]
            assert res["state"].keys() == (want.keys() if rank == 0 else want.keys() - {TABLE})
        else:
            assert res["state"].keys() == want.keys()
    assert not torch.equal(want[TABLE], _model().state_dict()[TABLE])  # the table did train


@pytest.mark.parametrize("name", ["resume-sinkhorn-2", "resume-adam-3", "resume-sinkhorn-3"])
def test_sharded_checkpoint_resumes_at_any_world_size(runs, single, name):
    """A 2-rank run wrote a checkpoint after step 1 (each rank's rows and their optimizer state in
    engram-shards/, the dense part from rank 0, whose state dict holds no table) and ran on; resumed
    from it on 2 ranks (bit-exact to the uninterrupted run) or 3 (the rows redistributed), a run ends
    where one process ends."""
    job = {**JOBS_2, **JOBS_3}[name]
    ranks = runs[name]
    _assert_equal_to_one_process(ranks, single[job["table_optimizer"]])
    ckpt = runs["folder"] / job["resume"].split("/")[-1]
    assert sorted(p.name for p in (ckpt / "engram-shards").iterdir()) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    assert TABLE not in torch.load(ckpt / "rank0.pt", weights_only=False)["model"]
    if len(ranks) == 2:
        assert torch.equal(
            ranks[0]["state"][TABLE], runs[f"sharded-{job['table_optimizer']}"][0]["state"][TABLE]
        )


def test_sharded_save_engram_writes_one_part(runs):
    """engram.distributed.save_engram / export_fp8 of a sharded model: rank 0 writes the whole table
    into one part (float, or V4.1's FP8) that one process loads."""
    from engram.hf import load_engram

    ranks = runs["sharded-sinkhorn"]
    assert ranks[0]["part"] is not None and ranks[1]["part"] is None
    loaded = load_engram(S.llama(seed=3).double(), runs["folder"] / "ddp-part", mmap=False).state_dict()[
        TABLE
    ]
    assert torch.equal(loaded, ranks[0]["state"][TABLE].to(loaded.dtype))
    assert (
        ranks[0]["fp8"] is not None and ranks[1]["fp8"] is None
    )  # export_fp8: V4.1's FP8 of the whole table
    fp8 = (
        load_engram(S.llama(seed=3).double(), runs["folder"] / "ddp-part-fp8", mmap=False)
        .engram.module(1)
        .table
    )
    assert fp8.num_rows == loaded.shape[0]
    rows = torch.arange(loaded.shape[0])
    got = fp8.gather(rows, torch.float64)
    # e4m3 values with ue8m0 scales: about 2^-4 relative
    torch.testing.assert_close(got, loaded.double(), rtol=0.07, atol=1e-3)


def test_refusals(runs):
    """Each refused on every rank, no rank left waiting: tables not synchronised (each rank would
    train its own); a resume whose checkpoint has no table shards; a resume whose shards were not read
    back (the Trainer without EngramShardsCallback); rank 1 attached a table from another seed, or
    another Engram config (prepare_data_parallel names the value and each rank's)."""
    for res in runs["unsynchronised"]:
        assert (
            "prepare_data_parallel" in res["error"] and "each rank would train its own table" in res["error"]
        )
    for res in runs["resume-no-shards"]:
        assert "holds no table shards" in res["error"] and "EngramShardsCallback" in res["error"]
    for res in runs["resume-unrestored"]:
        assert "were not read back" in res["error"] and "EngramShardsCallback" in res["error"]
    for name, named in (("disagree-table", "initial table"), ("disagree-config", "Engram config")):
        for res in runs[name]:
            assert named in res["error"] and "rank 0:" in res["error"] and "rank 1:" in res["error"]
            assert "torch.manual_seed before add_engram" in res["error"]
