"""Engram on HF models across processes: the tables kept out of DDP and synchronised by Engram itself.

`prepare_data_parallel(model)` readies a model with Engram (`engram.hf.add_engram`) for data
parallelism before DDP, accelerate or the HF `Trainer` wraps it: the tables are named to DDP as
parameters to ignore (no bucket copy, no dense zero gradient of a table), and the model's
`EngramOptimizer` (`engram.hf.build_optimizer`) sums the ranks' sparse row gradients before its
table step (`TableSync.REPLICATED`: every rank holds the whole table and applies the same update, for
any table optimizer). Without it an `EngramOptimizer` refuses to step on more than one process, since
each rank would silently train its own table. Knows the attachment and the process group, nothing of
the wrappers beyond DDP's ignore list.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engram.hf.attach import get_attachment

__all__ = ["ReplicatedTableSync", "TableSync", "prepare_data_parallel"]


class TableSync(enum.StrEnum):
    """How an HF model's Engram tables stay one table across data-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds the table; sparse row gradients summed across ranks


class ReplicatedTableSync:
    """The ranks' sparse row gradients of each table, averaged over the group (as DDP averages the
    dense ones): an all-gather of the row counts, then of the padded rows and values (n_rows x dim per
    rank, nothing dense of the table). Every rank gets the same gradient, rows in the same order."""

    mode = TableSync.REPLICATED

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)

    def __call__(self, params: list[torch.Tensor], pending: dict[torch.Tensor, torch.Tensor]) -> dict:
        out = {}
        for p in params:  # the optimizer's order: the same on every rank
            out[p] = self._average(p, pending.get(p))
        return out

    def _average(self, p: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        if grad is None:
            rows = torch.zeros(0, dtype=torch.int64, device=p.device)
            vals = torch.zeros(0, p.shape[1], dtype=p.dtype, device=p.device)
        else:
            grad = grad.coalesce()
            rows, vals = grad.indices()[0], grad.values()
        count = torch.tensor([rows.numel()], dtype=torch.int64, device=p.device)
        counts = [torch.empty_like(count) for _ in range(self.world)]
        dist.all_gather(counts, count, group=self.group)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        pad = most - rows.numel()
        rows_p = torch.cat([rows, rows.new_zeros(pad)])
        vals_p = torch.cat([vals, vals.new_zeros(pad, vals.shape[1])])
        all_rows = [torch.empty_like(rows_p) for _ in range(self.world)]
        all_vals = [torch.empty_like(vals_p) for _ in range(self.world)]
        dist.all_gather(all_rows, rows_p, group=self.group)
        dist.all_gather(all_vals, vals_p, group=self.group)
        idx = torch.cat([r[:n] for r, n in zip(all_rows, sizes, strict=True)])
        val = torch.cat([v[:n] for v, n in zip(all_vals, sizes, strict=True)])
        summed = torch.sparse_coo_tensor(idx[None], val, tuple(p.shape)).coalesce()
        return summed / self.world


def prepare_data_parallel(
    model: nn.Module, mode: TableSync | str | None = None, group: dist.ProcessGroup | None = None
) -> TableSync:
    """Ready `model` (with Engram attached) for DDP / accelerate / the HF Trainer on `group` (default:
    the default group); call it before the model is wrapped. `mode` None picks REPLICATED (the one
    mode built: row-sharded HF tables are not yet). Returns the mode."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "prepare_data_parallel needs torch.distributed: launch with torchrun (or accelerate launch) and "
            "call torch.distributed.init_process_group first"
        )
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "the model is already wrapped in DistributedDataParallel, which has bucketed its Engram tables: "
            "call prepare_data_parallel(model) on the bare model, then wrap it"
        )
    try:
        chosen = TableSync(mode if mode is not None else TableSync.REPLICATED)
    except ValueError:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(repr(m.value) for m in TableSync)}") from None
    att = get_attachment(model)
    table_ids = {id(p) for p in att.tables()}
    names = [n for n, p in model.named_parameters() if id(p) in table_ids]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    att.table_sync = ReplicatedTableSync(group)
    return chosen
