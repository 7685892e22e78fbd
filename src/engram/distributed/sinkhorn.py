"""`ShardedSinkhorn`: the Sinkhorn-balanced update (SPEC §7b) on row-sharded tables, equal to the
single-process `SparseSinkhorn` on the whole table.

Each owner rank balances its own rows (its shard's active set); the two sums that run over every row
of the table are all-reduced over the table's process group: the row-norm sum (for the mean row norm,
one number) and the column sums of squares before each column normalisation (n numbers, (K - 1) / 2
times: 5 for V4.1's K = 11). Every rank of the group takes part in every step, with or without rows
or gradient (a non-owner, a rank whose rows were not looked up), so no rank waits on another.
Knows `ShardedTable` and the process group, nothing of the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from engram.distributed.sharded_table import ShardedTable
from engram.model.sinkhorn import SparseSinkhorn

__all__ = ["ShardedSinkhorn"]


class ShardedSinkhorn(SparseSinkhorn):
    """`SparseSinkhorn` over `ShardedTable`s, equal to it on the whole tables.

    Every rank of each table's group must build it with the same tables, in order, and take part in
    every step (the row-norm and column sums are all-reduced over the table's group).

    Args:
        tables: The sharded tables (not their weights).
        **kwargs: Hyperparameters, as `SparseSinkhorn`'s.

    Raises:
        TypeError: An element of `tables` is not a `ShardedTable`.
    """

    def __init__(self, tables: Iterable[ShardedTable], **kwargs: Any) -> None:
        tables = list(tables)
        for t in tables:
            if not isinstance(t, ShardedTable):
                raise TypeError(f"ShardedSinkhorn takes ShardedTable modules, got {type(t).__name__}")
        self._tables = {id(t.weight): t for t in tables}
        self.reduce_calls = 0  # all-reduces made (a count for benchmarks)
        super().__init__([t.weight for t in tables], **kwargs)

    def _table(self, p: torch.Tensor) -> ShardedTable:
        t = self._tables.get(id(p))
        if t is None:
            raise ValueError("ShardedSinkhorn updates the weights of the ShardedTables it was built with")
        return t

    def _table_rows(self, p: torch.Tensor) -> int:
        return self._table(p).num_rows

    def _all_reduce(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # on p's device: the backend's (CPU for gloo, the rank's GPU for NCCL)
        buf = x.to(device=p.device, dtype=torch.float64).contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._table(p).group)
        self.reduce_calls += 1
        return buf

    def _empty_grad_steps(self) -> bool:
        return True
