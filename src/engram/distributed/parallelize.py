"""Wrap a single-device EngramLM for distributed training, without editing the model code: tables
swapped for (or born as) `ShardedTable`s on their owner ranks, the step's row prefetch, and an
explicit all-reduce (not DDP) for the replicated dense parameters. Design: docs/distributed.md.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engram.addressing.layout import Layout
from engram.config import EngramConfig
from engram.distributed.sharded_table import ShardedTable, prefetch_tables
from engram.model.lm import EngramLM, LMConfig
from engram.model.module import Engram
from engram.model.table import TrainableTable
from engram.model.table_init import table_seed

__all__ = [
    "TableInit",
    "all_reduce_grads",
    "build_sharded_model",
    "global_num_params",
    "prefetch_model_rows",
    "shard_engram_tables",
    "sharded_tables",
    "split_sharded_params",
    "table_owners",
]


class TableInit(enum.StrEnum):
    """How a sharded table starts (`engram train --distributed --table-init`).

    Attributes:
        COPY: The owned rows of the model's existing full table.
        CHUNKED: Seeded per fixed-size chunk of rows (world-size independent).
    """

    COPY = "copy"  # owned rows of the model's existing full table
    CHUNKED = "chunked"  # seeded per fixed-size chunk of rows (world-size independent)


def table_owners(table_ranks: int | None, world: int) -> tuple[int, ...]:
    """The owners of `--table-ranks N`: ranks 0..N-1.

    Each holds about num_rows / N rows of every table; ranks N..W-1 hold none (no table memory, no
    table optimizer state) and only run the backbone and the lookups.

    Args:
        table_ranks: N, or None for every rank.
        world: The world size.

    Returns:
        The owner ranks.

    Raises:
        ValueError: N is not an int in [1, world].

    Examples:
        >>> from engram.distributed import table_owners
        >>> table_owners(2, 4), table_owners(None, 3)
        ((0, 1), (0, 1, 2))
    """
    if table_ranks is None:
        return tuple(range(world))
    if isinstance(table_ranks, bool) or not isinstance(table_ranks, int) or not 1 <= table_ranks <= world:
        raise ValueError(
            f"--table-ranks {table_ranks!r}: the first N ranks own the tables, so N must be between 1 and "
            f"the world size {world}; give --table-ranks N with 1 <= N <= {world}, or leave it out (every "
            "rank owns rows)"
        )
    return tuple(range(table_ranks))


def shard_engram_tables(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    init: TableInit = TableInit.COPY,
    seed: int = 0,
    owners: Iterable[int] | None = None,
) -> list[ShardedTable]:
    """Replace each Engram module's TrainableTable by a ShardedTable, in place.

    Tables already sharded keep theirs.

    Args:
        model: A model holding Engram modules.
        group: The process group (default: the default process group).
        init: COPY keeps the model's values (every rank must hold the same full table, e.g. built
            with the same seed); CHUNKED draws new ones from `seed` (the full table is freed
            afterwards).
        seed: The model seed CHUNKED draws from (each layer's table from `table_seed(seed, layer)`).
        owners: The ranks that hold rows (default: every rank).

    Returns:
        The sharded tables, in model order.

    Raises:
        TypeError: `init` is not a TableInit, or a table is not a TrainableTable.
    """
    if not isinstance(init, TableInit):
        raise TypeError(f"init must be a TableInit (COPY or CHUNKED), got {init!r}")
    tables = []
    for module in model.modules():
        if not isinstance(module, Engram):
            continue
        old = module.table
        if isinstance(old, ShardedTable):
            tables.append(old)
            continue
        if not isinstance(old, TrainableTable):
            raise TypeError(
                f"layer {module.layer_id}'s table is a {type(old).__name__}; only TrainableTables are "
                "trained, so only they can be sharded"
            )
        w = old.weight
        if init is TableInit.COPY:
            new = ShardedTable.from_full(w, group=group, owners=owners)
        else:
            new = ShardedTable(
                old.num_rows,
                old.dim,
                group=group,
                dtype=w.dtype,
                device=w.device,
                init_std=old.init_std,
                seed=table_seed(seed, module.layer_id),
                owners=owners,
            )
        module.table = new
        tables.append(new)
    return tables


def build_sharded_model(
    config: LMConfig,
    *,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    owners: Iterable[int] | None = None,
) -> EngramLM:
    """An EngramLM whose Engram tables are CHUNKED ShardedTables from the start (no rank holds a whole table).

    Built under torch.manual_seed(seed) with EngramLM's `table_factory`: the backbone draws first,
    then the Engram modules' dense weights, zero-initialised as EngramLM does; the tables draw nothing
    from torch's generator (row r of layer l's table is `chunked_normal`'s, from `table_seed(seed, l)`).
    So it is the initial model of `engram.apps.lm.train.build_model` (whose tables are those rows too),
    bit for bit, on every rank and for every world size: one process reproduces what N ranks train.

    Args:
        config: The LM's config, with an Engram config.
        seed: The model seed.
        group: The process group (default: the default process group).
        device: Where the model goes (default: where it was built, the CPU).
        owners: The ranks that hold table rows (default: every rank; a non-owner never draws or
            holds a table row).

    Returns:
        The model.

    Raises:
        ValueError: `config` has no Engram config.
    """
    if config.engram is None:
        raise ValueError("build_sharded_model needs an LMConfig with an engram config; use EngramLM(config)")

    def sharded(e: EngramConfig, layer_id: int) -> ShardedTable:
        rows = Layout(e).layer(layer_id).table_rows  # padded as Engram's own table (Qwen4-Exp: to 128)
        return ShardedTable(
            rows, e.head_dim, group=group, seed=table_seed(seed, layer_id), device=device, owners=owners
        )

    torch.manual_seed(seed)
    model = EngramLM(config, table_factory=sharded)
    return model if device is None else model.to(device)


def sharded_tables(model: nn.Module) -> list[ShardedTable]:
    """The model's ShardedTables, in model order (one per Engram layer).

    Args:
        model: A model holding Engram modules.

    Returns:
        The tables of the modules whose table is sharded.
    """
    return [m.table for m in model.modules() if isinstance(m, Engram) and isinstance(m.table, ShardedTable)]


def split_sharded_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split a model's parameters into the dense ones and the tables (TrainableTable, ShardedTable weights).

    Args:
        model: The model.

    Returns:
        The pair (dense params, table params), each in model.parameters() order (so optimizer state
            indices match a single-process run's), shared parameters once.
    """
    table_ids = {id(m.weight) for m in model.modules() if isinstance(m, TrainableTable | ShardedTable)}
    seen: set[int] = set()
    dense, tables = [], []
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        (tables if id(p) in table_ids else dense).append(p)
    return dense, tables


def prefetch_model_rows(model: EngramLM, rows: torch.Tensor | None) -> list[ShardedTable]:
    """Prefetch every sharded Engram layer's rows of a batch in one exchange (a collective).

    Args:
        model: The EngramLM.
        rows: The batch's rows (B, T, n_engram_layers, heads); None (a rank with no windows this
            round) takes part with no rows.

    Returns:
        The tables prefetched, in model order (what `sync_table_grads` takes after backward).
    """
    pairs = []
    e = model.config.engram
    for key, module in model.engrams.items():
        if not isinstance(module.table, ShardedTable):
            continue
        if rows is None:
            r = torch.empty(0, dtype=torch.int64, device=module.table.weight.device)
        else:
            r = rows[:, :, e.layer_index(int(key))]  # (B, T, heads)
        pairs.append((module.table, r))
    prefetch_tables(pairs)
    return [t for t, _ in pairs]


def all_reduce_grads(
    params: list[nn.Parameter],
    group: dist.ProcessGroup | None = None,
    *,
    extra: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Sum the dense gradients of parameters over a group in one flat all-reduce (a collective).

    The caller scales the loss so the sum is the global mean's gradient. Parameters without a
    gradient are skipped; which ones have one is the same on every rank (same model, same code path).

    Args:
        params: The dense parameters.
        group: The process group (default: the default process group).
        extra: A small 1-d tensor (e.g. the loss) that rides in the same buffer.

    Returns:
        The sum of `extra` over the ranks, or None without it.

    Raises:
        TypeError: A gradient is not dense.
    """
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if g.layout != torch.strided:
            raise TypeError(f"all_reduce_grads takes dense gradients, got a {g.layout} one")
    parts = [g.reshape(-1) for g in grads]
    if extra is not None:
        parts.append(extra.detach().reshape(-1).to(grads[0].dtype if grads else extra.dtype))
    if not parts:
        return None
    flat = torch.cat(parts)  # (sum of numel,) one buffer, one collective
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat[offset:] if extra is not None else None


def global_num_params(model: EngramLM) -> dict[str, int]:
    """`model.num_params()` counting every ShardedTable at its full size (not this rank's shard).

    Args:
        model: The EngramLM.

    Returns:
        The counts by part, as `num_params` gives them.
    """
    counts = model.num_params()
    extra = sum(t.num_rows * t.dim - t.weight.numel() for t in sharded_tables(model))
    counts["total"] += extra
    counts["engram_tables"] += extra
    return counts
