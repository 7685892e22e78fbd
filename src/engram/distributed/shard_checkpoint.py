"""What both sharded-checkpoint writers and readers across processes share (`engram train --distributed`
and the HF Trainer's `EngramShardsCallback`): the run's name (drawn on rank 0, the same on every
rank), the table optimizer's name as a shard file records it, and `agreed`, which turns a check that
failed on some ranks into the same error on every rank before any rank goes on to a collective.
The file format itself is `engram.checkpoint.shard_format`. Design: docs/distributed.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from engram.model.sinkhorn import SparseSinkhorn

__all__ = ["CHECK_ERRORS", "agreed", "agreed_error", "run_name", "table_optimizer_name"]

# What a failed check of checkpoint files raises (a damaged, missing or foreign file; an unreadable one;
# torch refusing a tensor that does not fit)
CHECK_ERRORS = (ValueError, TypeError, KeyError, OSError, RuntimeError)


def run_name(group: dist.ProcessGroup | None = None) -> str:
    """A new run's name, the same on every rank of `group` (rank 0's, broadcast: a collective); without a
    process group, this process's own."""
    name = [uuid.uuid4().hex]
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(name, src=src, group=group)
    return name[0]


def table_optimizer_name(opt: torch.optim.Optimizer | None) -> str | None:
    """The table optimizer as shard files record it: the Sinkhorn update under its one-process name
    (ShardedSinkhorn's per-row state is SparseSinkhorn's), so a checkpoint resumes on any world size."""
    if opt is None:
        return None
    return SparseSinkhorn.__name__ if isinstance(opt, SparseSinkhorn) else type(opt).__name__


def agreed_error(error: BaseException | None, group: dist.ProcessGroup | None = None) -> ValueError | None:
    """Every rank's outcome of a check (its error, or None), gathered (one all-gather of the messages; a
    collective): None when no rank failed, else the same ValueError on every rank, "rank R of W: message"
    of the first failing rank (its own error chained on that rank)."""
    world = dist.get_world_size(group)
    messages: list[str | None] = [None] * world
    mine = None if error is None else " ".join(str(error).split()) or type(error).__name__
    dist.all_gather_object(messages, mine, group=group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return None
    rank, message = failed[0]
    more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    out = ValueError(f"rank {rank} of {world}{more}: {message}")
    out.__cause__ = error
    return out


@contextmanager
def agreed(group: dist.ProcessGroup | None, what: Callable[[], str]) -> Iterator[None]:
    """Run the block's checks on every rank of `group`, then agree (`agreed_error`): if a check failed on
    any rank, every rank raises the same ValueError naming `what()`, the first failing rank and its
    message, so no rank goes on into a collective its peers have left (which ends in gloo's
    'Connection closed by peer'). Without a process group (one plain process) the block's own error
    passes unchanged."""
    alone = not (dist.is_available() and dist.is_initialized())
    error: BaseException | None = None
    try:
        yield
    except CHECK_ERRORS as e:
        if alone:
            raise
        error = e
    if alone:
        return
    out = agreed_error(error, group)
    if out is not None:
        raise ValueError(f"{what()} was refused, on every rank: {out}") from error
