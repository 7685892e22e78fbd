"""What keeps a distributed run from hanging: ranks check that they agree before they act (on
values, or on a tensor's digest), and a collective that fails or waits too long becomes an error
naming the rank and the step (`bounded_group`: a group whose collectives give up after a set time).
Knows nothing of what the trainer computes. Design: docs/distributed.md.
"""

from __future__ import annotations

import datetime
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DIGEST_CHUNK_BYTES",
    "RankError",
    "all_values",
    "bounded_group",
    "check_timeout",
    "chunks_digest",
    "describe",
    "differing",
    "disagreements",
    "named_failures",
    "tensor_digest",
]

# Long enough for rank 0 to write a checkpoint at this project's scale while the others wait in a
# barrier, short enough that a stuck job ends within minutes instead of torch's 30 (gloo) or 10 (NCCL).
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
# What tensor_digest reads at a time: the most it copies (to the host, or to make a chunk contiguous).
DIGEST_CHUNK_BYTES = 64 << 20


class RankError(RuntimeError):
    """A rank of a distributed run failed in a collective (timed out, lost a peer) or beside one;
    the message names the rank and the step."""


def all_values(values: dict[str, Any], group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every rank's `values` (picklable), in rank order: one all_gather_object. A collective: every
    rank of `group` calls it, and every rank gets the same list."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return gathered


def differing(gathered: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The names whose values (compared with ==) differ between the ranks' dicts of `all_values`,
    each with the list of every rank's value (None where a rank lacks the name)."""
    names = sorted({k for v in gathered for k in v})
    per_name = {k: [v.get(k) for v in gathered] for k in names}
    return {k: vals for k, vals in per_name.items() if any(x != vals[0] for x in vals[1:])}


def disagreements(values: dict[str, Any], group: dist.ProcessGroup | None = None) -> dict[str, list[Any]]:
    """Gather every rank's `values` (picklable, compared with ==) and return the names whose values
    differ between ranks, each with the list of every rank's value (None where a rank lacks the
    name). A collective: every rank of `group` calls it, and every rank gets the same answer."""
    return differing(all_values(values, group))


def chunks_digest(dtype: torch.dtype, shape: tuple[int, ...], chunks: Iterable[torch.Tensor]) -> str:
    """tensor_digest of the tensor of `dtype` and `shape` whose bytes are those of `chunks` in order
    (each read in place when contiguous on the CPU, else copied): a table digested as it is drawn,
    one chunk at a time, without ever being whole."""
    crc = 0
    for chunk in chunks:
        c = chunk.detach().to("cpu").contiguous()  # a copy of at most one chunk
        crc = zlib.crc32(c.reshape(-1).view(torch.uint8).numpy(), crc)  # bytes as they are: bf16 too
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)} crc32 {crc:08x}"


def tensor_digest(t: torch.Tensor, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> str:
    """'float32 (530, 32) crc32 1a2b3c4d': dtype, shape and the CRC-32 of `t`'s bytes, read in chunks
    of rows of at most `chunk_bytes` (a contiguous CPU tensor is read in place; another has one chunk
    at a time copied). Equal values give the same digest on every rank, whatever its thread count: a
    float sum would not (torch splits a sum over its threads, and the rounding follows the split)."""
    t = t.detach()
    flat = t.reshape(1, -1) if t.dim() < 2 else t.flatten(1)  # (rows, row elements)
    row_bytes = max(1, flat.shape[1] * t.element_size())
    step = max(1, chunk_bytes // row_bytes)
    chunks = (flat[a : a + step] for a in range(0, flat.shape[0], step))  # (<= step, row elements)
    return chunks_digest(t.dtype, tuple(t.shape), chunks)


def check_timeout(timeout: Any, where: str) -> float | None:
    """`timeout` as seconds (None: no bound of our own); ValueError naming `where` unless it is None
    or a finite number > 0."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"{where}: timeout={timeout!r} must be a number of seconds > 0 (or None: the process group's own "
            f"timeout, torch's default 30 minutes); the default is {DEFAULT_COLLECTIVE_TIMEOUT:g}"
        )
    return float(timeout)


def bounded_group(group: dist.ProcessGroup | None, timeout: float | None) -> dist.ProcessGroup | None:
    """A process group over `group`'s ranks (default: every rank), same backend and rank numbers, whose
    collectives fail after `timeout` seconds instead of the process group's own timeout (None: `group`
    itself). Created by every rank of `group` (a collective of those ranks only)."""
    if timeout is None:
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    bounded = dist.new_group(
        ranks=sorted(ranks),
        timeout=datetime.timedelta(seconds=timeout),
        backend=dist.get_backend(group),
        use_local_synchronization=True,
    )
    if dist.get_rank(bounded) != dist.get_rank(group):  # a group whose ranks are not in global order
        raise ValueError(
            f"the process group's ranks {ranks} are not in increasing order, so a group bounded in time "
            "cannot keep its rank numbers: pass timeout=None (the group's own timeout)"
        )
    return bounded


def describe(diff: dict[str, list[Any]], limit: int = 60) -> str:
    """'--until (rank 0: 2, rank 1: 4); seed (rank 0: 0, rank 1: 1)': each value cut to `limit` characters."""

    def short(x: Any) -> str:
        s = repr(x)
        return s if len(s) <= limit else s[: limit - 3] + "..."

    return "; ".join(
        f"{name} ({', '.join(f'rank {r}: {short(v)}' for r, v in enumerate(vals))})"
        for name, vals in diff.items()
    )


@contextmanager
def named_failures(rank: int, where: Callable[[], str]) -> Iterator[None]:
    """Re-raise a RuntimeError from the block (a gloo timeout or lost peer, a DistBackendError, or
    any other runtime failure of this rank) as RankError naming `rank` and `where()` (e.g. 'in step
    4 of 6'); a RankError from an inner block passes unchanged. ValueErrors (settings, rows) pass too."""
    try:
        yield
    except RankError:
        raise
    except RuntimeError as e:
        raise RankError(
            f"rank {rank} failed {where()}: {e} (a collective that times out after --collective-timeout "
            "seconds or loses its peer means another rank failed, stopped early or is stuck: see the "
            "other ranks' errors)"
        ) from e
