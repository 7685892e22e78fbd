"""The multi-process jobs of tests/test_distributed.py (gloo on CPU): `job` runs every distributed
check of one world size on each rank of the suite's launch of that size (tests/dist_launch.py) and
returns what the parent compares with single-process references; its `prev` is the job of the world
launched before (W=2, for W=3), whose sharded checkpoint this world resumes.
The table checks run once per owner set of OWNERS[world] (None: every rank owns rows), keyed by it
under "tables"; the training checks once, with the tables on rank 0 only as well at W=2.
The inputs (tables, rows, coefficients) are pure functions of fixed seeds, so the parent rebuilds
them with `table_inputs` / `step_inputs`.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

# Table checks: two tables (one exchange for both), a global batch of B sequences of T positions.
SIZES = (1000, 777)
DIM, B, T, HEADS = 8, 6, 5, 3
ADAM_STEPS, ADAM_LR = 3, 0.1
SINKHORN_STEPS, SINKHORN_LR = 10, 0.05
CHUNKED_ROWS = 150_000  # crosses two INIT_CHUNK_ROWS boundaries
# Table owner sets per world size: all ranks, and dedicated table ranks (a non-owner is rank 0 at W=2).
OWNERS: dict[int, tuple[tuple[int, ...] | None, ...]] = {2: (None, (1,)), 3: (None, (0,), (0, 1))}
# Table owners of the fp64 run with sharded checkpoints (W=3: a non-owner between the owners).
SHARDED_OWNERS: dict[int, tuple[int, ...] | None] = {2: None, 3: (0, 2)}


def table_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """The full tables [rows, DIM] every rank starts from."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, DIM, generator=g, dtype=torch.float64).to(dtype) for n in SIZES]


def step_inputs(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per table: global rows (B, T, HEADS), many repeated, and loss coefficients (B, T, HEADS, DIM)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for n in SIZES:
        rows = torch.randint(0, min(n, 60), (B, T, HEADS), generator=g)  # few distinct rows: repeats
        rows[0, 0, 0] = n - 1  # the last row (owned by the last rank)
        out.append((rows, torch.randn(B, T, HEADS, DIM, generator=g, dtype=torch.float64)))
    return out


def sinkhorn_step_inputs(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """step_inputs, but rows 30-59 are looked up only in the first 3 steps and the last 2 (abandoned:
    their momentum decays, then they come back)."""
    out = []
    for rows, coef in step_inputs(step):
        if 3 <= step < SINKHORN_STEPS - 2:
            rows = torch.where((rows >= 30) & (rows < 60), rows - 30, rows)
        out.append((rows, coef))
    return out


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = B // world
    return t[rank * b : (rank + 1) * b]


def _train_tables(
    tables: list[Any],
    opt: Any,
    inputs_of: Any,
    steps: int,
    rank: int,
    world: int,
    before_step: Any = None,
    after_step: Any = None,
) -> None:
    """`steps` steps of loss = sum(gathered * coefficients) over the global batch (inputs_of(step)),
    this rank's share of it: prefetch, backward, table-gradient sync, optimizer step."""
    from engram.distributed import prefetch_tables, sync_table_grads

    for step in range(steps):
        inputs = inputs_of(step)
        rows = [_local(r, rank, world) for r, _ in inputs]
        prefetch_tables(list(zip(tables, rows, strict=True)))
        loss = sum(
            (t.gather(r) * _local(c, rank, world)).sum()
            for t, r, (_, c) in zip(tables, rows, inputs, strict=True)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_table_grads(tables)
        if before_step is not None:
            before_step(step)
        opt.step()
        if after_step is not None:
            after_step(step)


def _tables_part(rank: int, world: int, owners: tuple[int, ...] | None) -> dict[str, Any]:
    from engram.distributed import (
        ShardedSinkhorn,
        ShardedTable,
        chunked_normal,
        prefetch_tables,
        sync_table_grads,
    )
    from engram.model.optim import SparseRowAdam

    res: dict[str, Any] = {}
    # gather: values served from the prefetched block, one exchange for both tables
    tables = [ShardedTable.from_full(w, owners=owners) for w in table_inputs(torch.float32)]
    inputs = step_inputs(0)
    local_rows = [_local(r, rank, world) for r, _ in inputs]
    prefetch_tables(list(zip(tables, local_rows, strict=True)))
    res["gathered"] = [t.gather(r) for t, r in zip(tables, local_rows, strict=True)]
    with torch.no_grad():  # no pending prefetch needed: gather prefetches itself (a collective)
        res["gathered_self"] = tables[1].gather(local_rows[1][:, :2])
    res["bounds"] = [t.bounds for t in tables]
    res["shard_rows"] = [t.weight.shape[0] for t in tables]
    res["full"] = [t.full_weight(0) for t in tables]

    # gradients: fp64 tables, loss = sum(gathered * coefficients) over the global batch
    tables = [ShardedTable.from_full(w, owners=owners) for w in table_inputs(torch.float64)]
    opt = SparseRowAdam([t.weight for t in tables], lr=ADAM_LR)

    def first_grads(step: int) -> None:
        if step == 0:
            res["grads"] = [t.weight.grad.to_dense() for t in tables]
            res["grad_layout"] = [(t.weight.grad.layout, t.weight.grad._indices().clone()) for t in tables]

    _train_tables(tables, opt, step_inputs, ADAM_STEPS, rank, world, first_grads)
    res["adam"] = [t.full_weight(0) for t in tables]
    res["adam_state_rows"] = [tuple(v.shape[0] for v in opt.state[t.weight].values()) for t in tables]

    # the Sinkhorn-balanced update: each owner balances its rows, column and row-norm sums all-reduced
    tables = [ShardedTable.from_full(w, owners=owners) for w in table_inputs(torch.float64)]
    opt = ShardedSinkhorn(tables, lr=SINKHORN_LR)
    active: list[list[int]] = []
    _train_tables(
        tables,
        opt,
        sinkhorn_step_inputs,
        SINKHORN_STEPS,
        rank,
        world,
        after_step=lambda step: active.append([opt.active_rows(t.weight) for t in tables]),
    )
    res["sinkhorn"] = [t.full_weight(0) for t in tables]
    res["sinkhorn_active"] = active
    res["sinkhorn_reduces"] = opt.reduce_calls

    # bf16 tables: rows served exactly; row gradients summed in fp32 at the owners
    tables = [ShardedTable.from_full(w, owners=owners) for w in table_inputs(torch.bfloat16)]
    inputs = step_inputs(0)
    prefetch_tables([(t, _local(r, rank, world)) for t, (r, _) in zip(tables, inputs, strict=True)])
    outs = [t.gather(_local(r, rank, world), torch.float32) for t, (r, _) in zip(tables, inputs, strict=True)]
    sum((o * _local(c, rank, world).float()).sum() for o, (_, c) in zip(outs, inputs, strict=True)).backward()
    sync_table_grads(tables)
    res["bf16_gathered"] = [o.detach() for o in outs]
    res["bf16_grads"] = [t.weight.grad.to_dense() for t in tables]

    # errors: a bad row on rank `world - 1` raises on every rank (no rank hangs in the exchange)
    bad = local_rows[1].clone()
    if rank == world - 1:
        bad[0, 0, 0] = SIZES[1]
    tables = [ShardedTable.from_full(w, owners=owners) for w in table_inputs(torch.float32)]
    try:
        prefetch_tables([(tables[0], local_rows[0]), (tables[1], bad)])
        res["bad_row_error"] = None
    except ValueError as e:
        res["bad_row_error"] = str(e)
    tables[0].prefetch(local_rows[0][:1])  # the group still works; now gather rows not prefetched
    try:
        tables[0].gather(local_rows[0])
        res["stale_error"] = None
    except ValueError as e:
        res["stale_error"] = str(e)

    # chunked init: the same table whatever the world size
    t = ShardedTable(CHUNKED_ROWS, 4, seed=3, owners=owners)
    res["chunked"] = t.full_weight(0)
    res["chunked_local_ok"] = torch.equal(t.weight.detach(), chunked_normal(t.lo, t.hi, 4, seed=3))
    return res


def _train_part(
    rank: int, world: int, out_dir: Path, cfg_dict: dict[str, Any], prev_dir: Path | None
) -> dict[str, Any]:
    from engram.apps.lm.train import TrainConfig, latest_checkpoint, prepare_data
    from engram.apps.lm.train_distributed import DistributedTrainer, build_distributed_model
    from engram.distributed import TableInit, global_num_params, sharded_tables

    res: dict[str, Any] = {}
    cfg = TrainConfig.from_dict(cfg_dict)
    data = prepare_data(cfg)
    try:
        DistributedTrainer(cfg.replace(batch_size=B + 1), data, build_distributed_model(cfg, data))
        res["batch_error"] = None
    except ValueError as e:
        res["batch_error"] = str(e)

    trainer = DistributedTrainer(cfg, data, build_distributed_model(cfg, data), out_dir=out_dir / "run")
    res["initial_eval"] = trainer.evaluate(max_tokens=1024)
    res["few_windows_eval"] = trainer.evaluate(max_tokens=2 * cfg.seq_len + 1)  # 2 windows, W ranks
    trainer.run(until=cfg.steps // 2)  # writes a checkpoint there
    trainer.run()
    res["history"] = trainer.history
    res["final_eval"] = trainer.evaluate(max_tokens=1024)
    res["num_params"] = global_num_params(trainer.model)

    # resume the mid-run checkpoint into a differently initialised model; finish in another folder
    half = out_dir / "run" / "checkpoints" / f"step-{cfg.steps // 2:07d}"
    other = build_distributed_model(cfg.replace(seed=99), data)
    resumed = DistributedTrainer(cfg, data, other, out_dir=out_dir / "resumed")
    resumed.resume_from(half)
    res["resumed_step"] = resumed.step
    resumed.run()
    res["resumed_history"] = resumed.history
    res["latest"] = str(latest_checkpoint(out_dir / "run"))

    # the same run in float64: equivalence up to summation order, without fp32 rounding noise
    # (which Adam amplifies for rows whose gradient is near zero); sharded checkpoints at 3 and 6
    res.update(_sharded_part(cfg, data, out_dir, prev_dir))
    res.update(_sinkhorn_train_part(cfg, data, out_dir))

    if world == 2:  # --table-ranks 1: the tables on rank 0 only; resumed with them on rank 1 only
        res.update(_table_ranks_part(cfg, data, out_dir))
        res.update(_guard_part(cfg, data))

    # a model born sharded (CHUNKED): its tables gathered whole, for the world-size comparison
    chunked = build_distributed_model(cfg, data, init=TableInit.CHUNKED)
    full = [t.full_weight(0) for t in sharded_tables(chunked)]
    dense = {k: v for k, v in chunked.state_dict().items() if not k.endswith("table.weight")}
    res["chunked_model"] = (full, dense)
    return res


def _sharded_part(cfg: Any, data: Any, out_dir: Path, prev_dir: Path | None) -> dict[str, Any]:
    """The fp64 run with sharded checkpoints (steps 3 and 6), its step-3 checkpoint resumed in this
    world (exact) and, with `prev_dir`, the other world's step-3 checkpoint resumed here."""
    from engram.apps.lm.train import build_model
    from engram.apps.lm.train_distributed import DistributedTrainer
    from engram.checkpoint.shards import RowShards

    res: dict[str, Any] = {}
    owners = SHARDED_OWNERS[dist.get_world_size()]
    t64 = DistributedTrainer(
        cfg,
        data,
        build_model(cfg, data).double(),
        out_dir=out_dir / "sharded64",
        owners=owners,
        sharded_checkpoints=True,
    )
    t64.run(until=cfg.steps // 2)
    t64.run()
    res["history64"] = t64.history
    res["state64"] = t64._checkpoint_tensors()[0]  # the full model on rank 0
    res["sharded_rows"] = {name: (t.lo, t.hi) for name, t in t64._named_tables().items()}
    half = f"checkpoints/step-{cfg.steps // 2:07d}"
    # resumed in this world, into another model (not asked for sharded checkpoints: it keeps them)
    other = build_model(cfg.replace(seed=99), data).double()
    resumed = DistributedTrainer(cfg, data, other, out_dir=out_dir / "sharded64_resumed", owners=owners)
    resumed.resume_from(out_dir / "sharded64" / half)
    resumed.run()
    res["sharded_resumed_history64"] = resumed.history
    res["damaged_resume_error"] = _damaged_resume(cfg, data, out_dir, out_dir / "sharded64" / half, owners)
    if prev_dir is not None:  # the other world's checkpoint, every rank of this one owning rows
        other = build_model(cfg.replace(seed=99), data).double()
        cross = DistributedTrainer(cfg, data, other, out_dir=out_dir / "cross64")
        reads: list[tuple[str, int, int]] = []  # (table, lo, hi) of every read of shard files
        read_rows = RowShards.read_rows

        def spy(self: RowShards, name: str, key: str, lo: int, hi: int, scan: bool = False) -> torch.Tensor:
            reads.append((name, lo, hi))
            return read_rows(self, name, key, lo, hi, scan)

        with mock.patch.object(RowShards, "read_rows", spy):
            cross.resume_from(prev_dir / "sharded64" / half)
        res["cross_reads"] = reads
        res["cross_rows"] = [t.weight.shape[0] for t in cross.tables]
        cross.run()
        res["cross_history64"] = cross.history
    return res


def _damaged_resume(cfg: Any, data: Any, out_dir: Path, ckpt: Path, owners: Any) -> str | None:
    """`ckpt` copied with a data byte of the last shard file flipped (read by its own rank only, at this
    world size), resumed on every rank: the error this rank raised (None: it resumed)."""
    import shutil

    from engram.apps.lm.train import build_model
    from engram.apps.lm.train_distributed import DistributedTrainer

    copy = out_dir / "damaged64" / "checkpoints" / ckpt.name
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, copy)
        last = sorted((copy / "engram-shards").iterdir())[-1]
        raw = bytearray(last.read_bytes())
        raw[-3] ^= 0x20  # in the last tensor's data
        last.write_bytes(bytes(raw))
    dist.barrier()
    t = DistributedTrainer(
        cfg, data, build_model(cfg, data).double(), out_dir=out_dir / "damaged64", owners=owners
    )
    try:
        t.resume_from(copy)
    except ValueError as e:
        return str(e)
    return None


def _sinkhorn_train_part(cfg: Any, data: Any, out_dir: Path) -> dict[str, Any]:
    """V4.1's recipe (Sinkhorn for the tables, ShardedSinkhorn here, and for the embedding) in fp64
    with sharded checkpoints (a non-owner at W=3), and its step-3 checkpoint resumed in this world."""
    from engram.apps.lm.train import build_model
    from engram.apps.lm.train_distributed import DistributedTrainer

    cfg = cfg.replace(table_optimizer="sinkhorn", embedding_optimizer="sinkhorn")
    owners = SHARDED_OWNERS[dist.get_world_size()]
    t = DistributedTrainer(
        cfg, data, build_model(cfg, data).double(), out_dir=out_dir / "sinkhorn64", owners=owners,
        sharded_checkpoints=True,
    )  # fmt: skip
    t.run(until=cfg.steps // 2)
    t.run()
    res: dict[str, Any] = {"sinkhorn_history64": t.history, "sinkhorn_state64": t._checkpoint_tensors()[0]}
    other = build_model(cfg.replace(seed=99), data).double()
    resumed = DistributedTrainer(cfg, data, other, out_dir=out_dir / "sinkhorn64_resumed", owners=owners)
    resumed.resume_from(out_dir / "sinkhorn64" / f"checkpoints/step-{cfg.steps // 2:07d}")
    resumed.run()
    res["sinkhorn_resumed_history64"] = resumed.history
    return res


def _table_ranks_part(cfg: Any, data: Any, out_dir: Path) -> dict[str, Any]:
    """The fp64 run with every table on rank 0 (checkpoints at steps 3 and 6), then its step-3
    checkpoint resumed with every table on rank 1, to step 6."""
    from engram.apps.lm.train import build_model
    from engram.apps.lm.train_distributed import DistributedTrainer
    from engram.distributed import table_owners

    res: dict[str, Any] = {}
    try:  # ranks disagreeing on the owners: refused on every rank (no rank left in an exchange)
        DistributedTrainer(cfg, data, build_model(cfg, data), owners=(dist.get_rank(),))
        res["owners_error"] = None
    except ValueError as e:
        res["owners_error"] = str(e)
    try:  # ranks launched with different configs: refused on every rank
        DistributedTrainer(cfg.replace(seed=cfg.seed + dist.get_rank()), data, build_model(cfg, data))
        res["config_error"] = None
    except ValueError as e:
        res["config_error"] = str(e)
    try:  # ranks resuming from different steps: refused on every rank before the first batch
        other = DistributedTrainer(cfg, data, build_model(cfg, data))
        other.step = dist.get_rank()
        other.run(until=2)
        res["step_error"] = None
    except ValueError as e:
        res["step_error"] = str(e)
    # a frozen table gets no gradient (so no optimizer update), as a frozen TrainableTable gets none
    from engram.distributed import ShardedTable, prefetch_tables, sync_table_grads

    frozen = ShardedTable(50, 4, seed=1)
    frozen.weight.requires_grad_(False)
    rows = torch.tensor([[1, 2], [40, 2 + dist.get_rank()]])
    prefetch_tables([(frozen, rows)])
    x = torch.ones(4, requires_grad=True)
    (frozen.gather(rows) * x).sum().backward()
    sync_table_grads([frozen])
    res["frozen_grad_is_none"] = frozen.weight.grad is None
    run = DistributedTrainer(
        cfg, data, build_model(cfg, data).double(), out_dir=out_dir / "owned64", owners=table_owners(1, 2)
    )
    run.run(until=cfg.steps // 2)
    run.run()
    opt = run.table_opt
    assert opt is not None
    res["owned_history64"] = run.history
    res["owned_state64"] = run._checkpoint_tensors()[0]
    res["owned_rows"] = [(t.owners, t.weight.shape[0]) for t in run.tables]
    res["owned_opt_rows"] = [tuple(v.shape[0] for v in opt.state[t.weight].values()) for t in run.tables]

    other = build_model(cfg.replace(seed=99), data).double()
    resumed = DistributedTrainer(cfg, data, other, out_dir=out_dir / "owned64_resumed", owners=(1,))
    resumed.resume_from(out_dir / "owned64" / "checkpoints" / f"step-{cfg.steps // 2:07d}")
    res["owned_resumed_rows"] = [t.weight.shape[0] for t in resumed.tables]
    resumed.run()
    res["owned_resumed_history64"] = resumed.history
    return res


class _Stalled(Exception):
    """Rank 1 leaving a step's collectives to its peer (as a rank that hangs or diverged would)."""


def _guard_part(cfg: Any, data: Any) -> dict[str, Any]:
    """Ranks disagreeing on `until` or on the initial model, refused on every rank before the first step
    (ranks with different table inits agree: their tables are born alike);
    a collective that times out (rank 1 leaves step 2 before its gradient exchange) ends rank 0 with
    an error naming the rank and the step."""
    import time

    from engram.apps.lm.train import build_model
    from engram.apps.lm.train_distributed import DistributedTrainer, build_distributed_model
    from engram.distributed import RankError, TableInit

    rank = dist.get_rank()
    res: dict[str, Any] = {}
    trainer = DistributedTrainer(cfg, data, build_model(cfg, data))
    try:
        trainer.run(until=2 + rank)
        res["until_error"] = None
    except ValueError as e:
        res["until_error"] = str(e)
    res["until_steps"] = trainer.step  # no rank trained a step
    init = TableInit.COPY if rank == 0 else TableInit.CHUNKED
    try:  # tables born from (seed, layer, row) either way: the same initial model, accepted
        DistributedTrainer(cfg, data, build_distributed_model(cfg, data, init=init))
        res["mixed_init_error"] = None
    except ValueError as e:
        res["mixed_init_error"] = str(e)
    model = build_distributed_model(cfg, data)
    if rank == 1:  # an initial model that differs on one rank (a replicated weight moved)
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    try:
        DistributedTrainer(cfg, data, model)
        res["init_error"] = None
    except ValueError as e:
        res["init_error"] = str(e)

    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    trainer = DistributedTrainer(cfg, data, build_model(cfg, data), group=short)
    backward = trainer._backward

    def stall_at_step_2(loss: torch.Tensor) -> float:
        if rank == 1 and trainer.step == 1:
            raise _Stalled
        return backward(loss)

    trainer._backward = stall_at_step_2  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        trainer.run(until=3)
        res["timeout_error"] = None
    except (_Stalled, RankError) as e:
        res["timeout_error"] = (type(e).__name__, str(e))
    res["timeout_seconds"] = time.perf_counter() - t0
    dist.barrier()  # the default group still works
    return res


def job(ctx: Any, prev: str | None = None) -> dict[str, Any]:
    """Every check of this world size on this rank of a tests/dist_launch.py launch, its files in
    `ctx.root/dist-W`; `prev`: the job whose world's sharded checkpoint this one resumes."""
    from training_setup import dist_cfg

    world, rank = dist.get_world_size(), dist.get_rank()
    out = Path(ctx.root) / folder(world)
    out.mkdir(exist_ok=True)
    res: dict[str, Any] = {"tables": {owners: _tables_part(rank, world, owners) for owners in OWNERS[world]}}
    prev_dir = None if prev is None else Path(ctx.root) / prev
    res.update(_train_part(rank, world, out, dist_cfg(ctx.corpus).to_dict(), prev_dir))
    return res


def folder(world: int) -> str:
    """The job of `world` ranks: its name in the launch, and its folder there."""
    return f"dist-{world}"
