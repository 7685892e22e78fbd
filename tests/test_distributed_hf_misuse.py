"""engram.hf across processes, used the wrong way round or on some ranks only (2 gloo ranks, every job
in the suite's 2-rank launch, tests/dist_launch.py, bounded in time): DDP or FSDP1 wrapped before
`prepare_data_parallel` (refused on every rank, naming the order to follow); FSDP1 with the tables as
`ignored_states` (equal to one process, fp64: 1e-9) and without them (refused by name at the first
forward); a sharded forward, a gradient flush or a table step run on rank 0 only (a RankError within
the `timeout` given to prepare_data_parallel, naming the cause and the fix, instead of the process
group's 30 minutes); the ranks' table agreement check in 64 MB chunks (no float64 copy of the table:
peak RSS of prepare_data_parallel measured) and the same on ranks with different thread counts.
The one-process references are those of tests/test_distributed_hf.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

import dist_launch as L
import test_distributed_hf as D
from engram.distributed.guard import check_timeout, tensor_digest
from engram.hf import build_optimizer

WORLD = 2
TIMEOUT_S = 3.0  # prepare_data_parallel's bound in the rank-0-only jobs
TABLE = "engram.layers.1.table.weight"
BIG_ROWS = 125_000  # per order: 4 x 125k rows x 32 x 4 bytes = 64 MB of float32 table


def _fsdp1(model, ignore: bool, orig: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel

    kw = {"ignored_states": model.engram.tables()} if ignore else {}
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig, **kw)


def _local(batch: dict, rank: int) -> dict:
    n = D.BATCH // WORLD
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _wrapped_first(rank: int, job: dict) -> dict:
    """The model wrapped (DDP or FSDP1) before prepare_data_parallel: the error on this rank."""
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import prepare_data_parallel

    model = D._model()
    wrapper = DistributedDataParallel(model) if job["wrap"] == "ddp" else _fsdp1(model, False, False)
    try:
        prepare_data_parallel(model, job["mode"])
    except ValueError as e:
        return {"error": str(e), "wrapper": type(wrapper).__name__}
    return {"error": None}


def _fsdp1_train(rank: int, job: dict) -> dict:
    """prepare_data_parallel, then FSDP1 (tables ignored or not), then build_optimizer; 3 steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from engram.distributed import prepare_data_parallel

    model = D._model()
    prepare_data_parallel(model, job["mode"])
    wrapped = _fsdp1(model, job["ignore"], job["orig"])
    res: dict = {"error": None}
    try:  # use_orig_params=False: the dense parameters are the wrapper's flat one
        opt = build_optimizer(
            model if job["orig"] else wrapped, lr=1e-2, table_lr=5e-2, table_optimizer=job["table_optimizer"]
        )
        for batch in D._batches(model):
            D._step_loss(wrapped, _local(batch, rank)).backward()
            opt.step()
            opt.zero_grad()
    except ValueError as e:
        res["error"] = str(e)
        return res
    with FullyShardedDataParallel.summon_full_params(wrapped):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sync = model.engram.table_sync
    if job["mode"] == "sharded":  # the whole table, on rank 0 (a collective)
        full = sync.tables[0].full_weight(0)
        if full is not None:
            state[TABLE] = full
    res["state"] = state
    return res


def _alone(rank: int, job: dict) -> dict:
    """Rank 0 runs a sharded forward, or a forward after a backward (the gradient flush), or a table
    step, without rank 1: its error and how long it took to come."""
    from engram.distributed import prepare_data_parallel

    model = D._model()
    prepare_data_parallel(model, job["mode"], timeout=TIMEOUT_S)
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2)
    batch = D._batches(model)[0]
    if job["case"] in ("flush", "step"):  # both ranks: a forward and backward (sharded: an exchange)
        D._step_loss(model, _local(batch, rank)).backward()
    if rank != 0:
        return {"error": None}
    t0 = time.perf_counter()
    try:
        if job["case"] == "step":
            opt.step()
        else:
            with torch.no_grad():
                model(input_ids=batch["input_ids"][:1], engram_rows=batch["engram_rows"][:1])
    except RuntimeError as e:
        return {"error": str(e), "type": type(e).__name__, "seconds": time.perf_counter() - t0}
    return {"error": None}


def _agreement_memory(rank: int, job: dict) -> dict:
    """prepare_data_parallel (replicated) of a model with a 64 MB float32 table, rank 1 with two
    threads: how far the resident set grew above where it was (peak, VmHWM reset before)."""
    import hf_setup as S
    from engram.config import EngramConfig
    from engram.distributed import prepare_data_parallel
    from engram.hf import add_engram

    cfg = dataclasses.replace(S.engram_config(), engram_vocab_size=(BIG_ROWS, BIG_ROWS))
    assert isinstance(cfg, EngramConfig)
    model = add_engram(S.llama(seed=3), cfg, compression=S.compression())
    table = model.engram.module(1).table.weight
    torch.set_num_threads(1 + rank)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        return {"error": None, "grew_kb": None}
    before = _memory_kb("VmRSS")
    try:
        prepare_data_parallel(model, "replicated")
    except ValueError as e:
        return {"error": str(e)}
    finally:
        torch.set_num_threads(1)
    return {
        "error": None,
        "grew_kb": _memory_kb("VmHWM") - before,
        "table_kb": table.numel() * table.element_size() // 1024,
    }


RUNNERS = {"wrapped": _wrapped_first, "fsdp1": _fsdp1_train, "alone": _alone, "memory": _agreement_memory}
JOBS = {
    "ddp-first": {"run": "wrapped", "wrap": "ddp", "mode": "sharded"},
    "fsdp1-first": {"run": "wrapped", "wrap": "fsdp1", "mode": "replicated"},
    "fsdp1-sharded": {"run": "fsdp1", "mode": "sharded", "ignore": True, "orig": False, "table_optimizer": "sinkhorn"},
    "fsdp1-replicated": {"run": "fsdp1", "mode": "replicated", "ignore": True, "orig": True, "table_optimizer": "adam"},
    "fsdp1-unignored-sharded": {"run": "fsdp1", "mode": "sharded", "ignore": False, "orig": False, "table_optimizer": "adam"},
    "fsdp1-unignored-replicated": {"run": "fsdp1", "mode": "replicated", "ignore": False, "orig": True, "table_optimizer": "adam"},
    "forward-alone": {"run": "alone", "mode": "sharded", "case": "forward"},
    "flush-alone": {"run": "alone", "mode": "sharded", "case": "flush"},
    "step-alone": {"run": "alone", "mode": "replicated", "case": "step"},
    "memory": {"run": "memory"},
}  # fmt: skip


def _job(ctx, **job) -> dict:
    """One job on both ranks of the suite's 2-rank launch (tests/dist_launch.py)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    LlamaRMSNorm.forward = D._rms_norm_in_its_dtype  # this process only
    return RUNNERS[job["run"]](dist.get_rank(), job)


PREFIX = "misuse-"
for _name, _job_kw in JOBS.items():  # stage 1: after the other files' jobs (collectives left timed out)
    L.register(__name__, WORLD, PREFIX + _name, "test_distributed_hf_misuse:_job", stage=1, **_job_kw)


@pytest.fixture(scope="module")
def runs(dist_launch) -> dict[str, list[dict]]:
    """Every job's per-rank results (the launch ends within its time limit, or the tests fail)."""
    root = dist_launch(WORLD)
    return {name: L.results(root, PREFIX + name) for name in JOBS}


@pytest.mark.parametrize("name, wrapper", [("ddp-first", "DistributedDataParallel"), ("fsdp1-first", "FullyShardedDataParallel")])  # fmt: skip
def test_wrapped_before_prepare_is_refused(runs, name, wrapper):
    """DDP (or FSDP1) built before prepare_data_parallel holds the whole tables in its own reduction
    (sharded, DDP then dies in 'Expected to have finished reduction'): refused on every rank, before
    anything changes, naming the wrapper and the order to follow."""
    for res in runs[name]:
        assert res["wrapper"] == wrapper
        assert f"the model is held by {wrapper} already" in res["error"]
        assert "prepare_data_parallel(model) on the bare model first, then wrap" in res["error"]


@pytest.mark.parametrize("name", ["fsdp1-sharded", "fsdp1-replicated"])
def test_fsdp1_with_tables_ignored_equals_one_process(runs, name):
    """FSDP1 (FullyShardedDataParallel, flat parameters, or use_orig_params) built after
    prepare_data_parallel with ignored_states=model.engram.tables(): every parameter and the table equal
    one process's (fp64: 1e-9), row-sharded with Sinkhorn or replicated with Adam."""
    job = JOBS[name]
    want = D._single(job["table_optimizer"])
    for rank, res in enumerate(runs[name]):
        assert res["error"] is None
        keys = want.keys() if job["mode"] == "replicated" or rank == 0 else want.keys() - {TABLE}
        assert res["state"].keys() == keys
        for k in keys:
            torch.testing.assert_close(
                res["state"][k], want[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}"
            )


@pytest.mark.parametrize("name", ["fsdp1-unignored-sharded", "fsdp1-unignored-replicated"])
def test_fsdp1_without_tables_ignored_is_refused(runs, name):
    """FSDP1 built without the tables in ignored_states flattens them into its own parameter (sharded:
    the first step crashed in sync_table_grads, or worse): refused on every rank by name before the
    first step (build_optimizer or the first forward), naming the fix."""
    for res in runs[name]:
        assert "taken over by FullyShardedDataParallel" in res["error"]
        assert "ignored_states=model.engram.tables()" in res["error"]


@pytest.mark.parametrize("name", ["forward-alone", "flush-alone", "step-alone"])
def test_collective_on_rank_0_alone_fails_within_the_timeout(runs, name):
    """A sharded forward (generation on rank 0), a forward after a backward (its gradient flush) or a
    table step run on rank 0 only: a RankError within prepare_data_parallel's timeout (3 s here), not
    the process group's 60 s (torch's default: 30 minutes), naming the cause and the fix."""
    res, other = runs[name]
    assert other["error"] is None
    assert res["type"] == "RankError"
    assert TIMEOUT_S - 0.5 < res["seconds"] < TIMEOUT_S + 15
    msg = res["error"]
    assert msg.startswith("rank 0: ") and f"prepare_data_parallel's timeout ({TIMEOUT_S:g} s)" in msg
    if name == "step-alone":
        assert "every rank of the group must take it at the same point" in msg
    else:
        assert "is a collective: every rank of the group must run it" in msg
        assert "mode=TableSync.REPLICATED" in msg and "engram.hf.load_engram" in msg


def test_agreement_check_reads_the_table_in_chunks(runs):
    """The ranks' table agreement check adds no copy of the table to the peak resident set (it made two
    float64 ones: 811 -> 2374 MB for a 391 MB table), and ranks with different thread counts agree (a
    float sum's rounding follows the thread split)."""
    for res in runs["memory"]:
        assert res["error"] is None
        if res["grew_kb"] is None:
            pytest.skip("/proc/self/clear_refs cannot be written here: peak RSS not measured")
        assert res["grew_kb"] < res["table_kb"] // 4, res


def test_tensor_digest():
    """dtype, shape and CRC-32 of the bytes: the same read in chunks of any size, from a
    non-contiguous tensor or its copy, in bf16 too; one changed bit changes it."""
    t = torch.randn(300, 7, dtype=torch.float64)
    whole = tensor_digest(t)
    assert whole.startswith("float64 (300, 7) crc32 ")
    assert tensor_digest(t, chunk_bytes=1) == tensor_digest(t, chunk_bytes=7 * 8 * 13) == whole
    assert tensor_digest(t.t().contiguous().t()) == whole  # a non-contiguous layout, same values
    bad = t.clone()
    bad.view(torch.int64)[123, 4] ^= 1  # the last bit of one value
    assert tensor_digest(bad) != whole
    half = t.bfloat16()
    assert tensor_digest(half, chunk_bytes=100) == tensor_digest(half)
    assert tensor_digest(half).startswith("bfloat16 (300, 7) crc32 ")
    assert tensor_digest(torch.ones(3)).startswith("float32 (3,) crc32")


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_timeout_validated(bad):
    assert check_timeout(None, "f") is None and check_timeout(60, "f") == 60.0
    with pytest.raises(ValueError, match=rf"f: timeout={bad!r} must be a number of seconds > 0"):
        check_timeout(bad, "f")
