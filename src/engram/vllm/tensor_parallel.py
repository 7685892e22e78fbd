"""Engram tables row-sharded across vLLM's tensor-parallel ranks.

Under tensor parallelism every rank runs the same forward on the same tokens, so every rank knows
every row a step needs. Rank r of w keeps rows [r * n // w, (r + 1) * n // w) of each table (its
share: a table the size of V4.1's does not fit one device); a lookup gathers the rows it holds,
zeros for the rest, and one all-reduce (sum) over the TP group completes every row on every rank:
exact, since each row is one rank's value plus zeros. The rest of the Engram layer (its small
projections and gate) is replicated, as vLLM replicates norms. Tables served from memory only (FP8 or
float); the tiered modes keep their caches per process and are refused with TP. No vLLM import: the
all-reduce is handed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engram.model.module import Engram
from engram.model.table import EngramTable, FP8Table, QuantTable, TrainableTable

__all__ = ["TensorParallelTable", "shard_rows", "shard_tables"]


def shard_rows(num_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank` of `world`'s rows [lo, hi) of a table of `num_rows`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    return rank * num_rows // world, (rank + 1) * num_rows // world


class TensorParallelTable(EngramTable):
    """This rank's rows of a table (`shard`, rows [lo, hi) of `num_rows`) and the TP group's all-reduce."""

    def __init__(
        self, shard: EngramTable, lo: int, num_rows: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.shard, self.lo, self.hi = shard, int(lo), int(lo) + shard.num_rows
        self.num_rows, self.dim = int(num_rows), shard.dim
        self.all_reduce = all_reduce

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        mine = (rows >= self.lo) & (rows < self.hi)
        local = torch.where(mine, rows - self.lo, 0)
        return self.all_reduce(self.shard.gather(local, dtype) * mine[..., None])

    def extra_repr(self) -> str:
        return f"rows [{self.lo}, {self.hi}) of {self.num_rows}, dim={self.dim}"


def _slice(table: EngramTable, lo: int, hi: int) -> EngramTable:
    if isinstance(table, FP8Table):
        return FP8Table(table.weight[lo:hi].clone(), table.scale[lo:hi].clone(), check=False)  # as loaded
    if isinstance(table, QuantTable):  # an INT8 / 4-bit table (export_quantised)
        return QuantTable(  # a slice of a loaded table: checked as its loader checked it
            table.weight[lo:hi].clone(), table.scale[lo:hi].clone(), table.row_format, check=False
        )
    if isinstance(table, TrainableTable):
        shard = TrainableTable.from_weight(table.weight.detach()[lo:hi].clone())
        shard.requires_grad_(False)
        return shard
    raise ValueError(
        f"tensor parallelism shards tables served from memory (FP8Table, QuantTable, TrainableTable), not "
        f"{type(table).__name__}: serve with tables='memory' or tensor_parallel_size=1"
    )


def shard_tables(
    modules: dict[int, Engram], rank: int, world: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replace each module's table by this rank's share of its rows (the full table is freed)."""
    for m in modules.values():
        full = m.table
        lo, hi = shard_rows(full.num_rows, rank, world)
        m.table = TensorParallelTable(_slice(full, lo, hi), lo, full.num_rows, all_reduce)
        del full
