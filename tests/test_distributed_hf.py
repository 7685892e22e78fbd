"""engram.hf across processes (2 and 3 gloo ranks) against one process: a tiny Llama with Engram, a
plain DistributedDataParallel loop with `build_optimizer`, a global batch of 6 as W x 6/W against 1 x 6,
in float64 throughout (the loss computed here, Llama's RMSNorm kept in float64: HF casts both to
float32, whose rounding moves with the batch split).
With `engram.distributed.prepare_data_parallel` (tables out of DDP's buckets, their sparse row
gradients averaged across ranks) every parameter, tables included, equals the one-process run (fp64:
1e-9), for every table optimizer; without it `EngramOptimizer.step` refuses on every rank (each rank
would train its own table), where it used to run with the tables diverging."""

from __future__ import annotations

import datetime
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

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


def _model() -> torch.nn.Module:
    model = add_engram(S.llama(seed=3), S.engram_config(), compression=S.compression()).double()
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


def _single(table_optimizer: str) -> dict[str, torch.Tensor]:
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


def _worker(rank: int, world: int, init_file: str, out: str, job: dict) -> None:
    """One rank of a DDP job: `job` = prepare (a mode or None), table_optimizer, table_ranks, and
    optionally save (a folder: after step `save_after`, write a resumable checkpoint there: dense model
    and optimizer state from rank 0, table shards from every rank), resume (such a folder: start after
    its step) and part (a folder for engram.distributed.save_engram after the last step)."""
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import load_table_shards, prepare_data_parallel, save_engram, save_table_shards

    torch.set_num_threads(1)
    LlamaRMSNorm.forward = _rms_norm_in_its_dtype  # this process only
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        model = _model()
        prepare = job["prepare"]
        mode = (
            None
            if prepare is None
            else prepare_data_parallel(model, prepare, table_ranks=job.get("table_ranks"))
        )
        ddp = DistributedDataParallel(model)
        opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer=job["table_optimizer"])
        sync = model.engram.table_sync
        first = 0
        if job.get("resume"):
            saved = torch.load(f"{job['resume']}/rank0.pt", weights_only=False)
            model.load_state_dict(saved["model"], strict=False)  # the dense part: no table in it
            opt.load_state_dict(saved["optimizer"])
            restore = sync.restore
            load_table_shards(
                sync.tables, sync.optimizer, job["resume"], restore["param_groups"], saved["step"]
            )
            sync.restore = None
            first = saved["step"]
        local = BATCH // world
        res: dict = {"error": None}
        try:
            for step, batch in enumerate(_batches(model)):
                if step < first:
                    continue
                part = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
                _step_loss(ddp, part).backward()
                opt.step()
                opt.zero_grad()
                if job.get("save") and step + 1 == job["save_after"]:
                    save_table_shards(sync.tables, sync.optimizer, job["save"], step + 1)
                    if rank == 0:
                        torch.save(
                            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                            f"{job['save']}/rank0.pt",
                        )
                    dist.barrier()
        except RuntimeError as e:
            res["error"] = str(e)
        res["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        res["ignored"] = sorted(ddp.parameters_to_ignore)
        res["mode"] = mode
        if mode == "sharded":  # the whole tables, gathered on rank 0 (a collective)
            res["shard_rows"] = [t.weight.shape[0] for t in sync.tables]
            for lid, t in zip(model.engram.layers, sync.tables, strict=True):
                full = t.full_weight(0)
                if full is not None:
                    res["state"][f"engram.layers.{lid}.table.weight"] = full
            if job.get("part"):
                res["part"] = save_engram(model, job["part"])
        torch.save(res, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world: int, prepare: str | None, table_optimizer: str, **job) -> list[dict]:
    d = tmp_path / f"w{world}-{prepare}-{table_optimizer}-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    job.update(prepare=prepare, table_optimizer=table_optimizer)
    mp.spawn(_worker, args=(world, str(d / "init"), str(d), job), nprocs=world)
    return [torch.load(d / f"rank-{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize(
    ("mode", "world", "table_optimizer", "table_ranks"),
    [
        ("sharded", 2, "adam", None),
        ("sharded", 2, "sinkhorn", None),
        ("sharded", 3, "sinkhorn", 2),  # rank 2 owns no rows (dedicated owners 0 and 1)
        ("sharded", 3, "adagrad", None),
        ("replicated", 2, "sinkhorn", None),
        ("replicated", 3, "adam", None),
    ],
)
def test_ddp_loop_equals_one_process(tmp_path, mode, world, table_optimizer, table_ranks):
    want = _single(table_optimizer)
    ranks = _spawn(tmp_path, world, mode, table_optimizer, table_ranks=table_ranks)
    table = "engram.layers.1.table.weight"
    for rank, res in enumerate(ranks):
        assert res["error"] is None and res["mode"] == mode
        assert table in res["ignored"]  # the table never enters DDP's buckets
        if mode == "sharded":
            rows = want[table].shape[0]
            owners = table_ranks or world
            assert res["ignored"] == ["engram.layers.1.table._starts", table]
            assert res["shard_rows"] == [
                rows * (rank + 1) // owners - rows * rank // owners if rank < owners else 0
            ]
        assert res["state"].keys() == (
            want.keys() if rank == 0 or mode == "replicated" else want.keys() - {table}
        )
        for k, v in res["state"].items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.equal(want[table], _model().state_dict()[table])  # the table did train


def test_unsynchronised_tables_are_refused_on_every_rank(tmp_path):
    ranks = _spawn(tmp_path, 2, None, "adam")
    for res in ranks:
        assert res["error"] is not None and "prepare_data_parallel" in res["error"]
        assert "each rank would train its own table" in res["error"]


@pytest.mark.parametrize(("table_optimizer", "resume_world"), [("adam", 3), ("sinkhorn", 2), ("sinkhorn", 3)])
def test_sharded_checkpoint_resumes_at_any_world_size(tmp_path, table_optimizer, resume_world):
    """A 2-rank run writes a checkpoint after step 1 (each rank's rows and their optimizer state in
    engram-shards/, the dense part from rank 0, whose state dict holds no table), and runs on; a run
    resumed from it, on 2 ranks or on 3 (the rows redistributed), ends where the uninterrupted run and
    one process end. save_engram of the sharded model writes one part that one process loads."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    part = tmp_path / "part"
    want = _single(table_optimizer)
    table = "engram.layers.1.table.weight"
    whole = _spawn(tmp_path, 2, "sharded", table_optimizer, save=str(ckpt), save_after=1, part=str(part))
    assert sorted(p.name for p in (ckpt / "engram-shards").iterdir()) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    assert table not in torch.load(ckpt / "rank0.pt", weights_only=False)["model"]
    resumed = _spawn(tmp_path, resume_world, "sharded", table_optimizer, resume=str(ckpt))
    for res in (*whole, *resumed):
        assert res["error"] is None
        for k, v in res["state"].items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    assert table in resumed[0]["state"] and table in whole[0]["state"]
    if resume_world == 2:  # the same world size: bit-exact
        assert torch.equal(resumed[0]["state"][table], whole[0]["state"][table])
    from engram.hf import load_engram

    assert whole[0]["part"] is not None and whole[1]["part"] is None
    loaded = load_engram(S.llama(seed=3).double(), part, mmap=False).state_dict()[table]
    assert torch.equal(loaded, whole[0]["state"][table].to(loaded.dtype))  # the whole table, as gathered


def test_sharded_resume_without_the_shards_is_refused(tmp_path):
    """An optimizer state of sharded tables loaded without their rows (the Trainer resumed without
    EngramShardsCallback): the first step refuses on every rank, naming the callback."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _spawn(tmp_path, 2, "sharded", "adam", save=str(ckpt), save_after=1)
    import shutil

    shutil.rmtree(ckpt / "engram-shards")
    with pytest.raises(Exception, match="no table shards"):
        _spawn(tmp_path, 2, "sharded", "adam", resume=str(ckpt))
