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
"""Seconds a collective waits for the other ranks before it fails (`init_distributed`, `bounded_group`).

Long enough for rank 0 to write a checkpoint at this project's scale while the others wait in a
barrier, short enough that a stuck job ends within minutes instead of torch's 30 (gloo) or 10 (NCCL).
"""
# What tensor_digest reads at a time: the most it copies (to the host, or to make a chunk contiguous).
DIGEST_CHUNK_BYTES = 64 << 20


class RankError(RuntimeError):
    """A rank of a distributed run failed in a collective (timed out, lost a peer) or beside one.

    The message names the rank and the step (see `named_failures`).
    """


def all_values(values: dict[str, Any], group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every rank's values, in rank order: one all_gather_object.

    A collective: every rank of `group` calls it, and every rank gets the same list.

    Args:
        values: This rank's values (picklable).
        group: The process group (default: every rank).

    Returns:
        Each rank's `values`, in rank order.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return gathered


def differing(gathered: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The names whose values differ between the ranks' dicts (compared with ==).

    Args:
        gathered: The ranks' dicts, as `all_values` returns them.

    Returns:
        Each differing name with the list of every rank's value (None where a rank lacks the name),
            names sorted.

    Examples:
        >>> from engram.distributed import describe, differing
        >>> diff = differing([{"until": 2, "seed": 0, "lr": 0.1}, {"until": 4, "seed": 1, "lr": 0.1}])
        >>> diff
        {'seed': [0, 1], 'until': [2, 4]}
        >>> describe(diff)
        'seed (rank 0: 0, rank 1: 1); until (rank 0: 2, rank 1: 4)'
    """
    names = sorted({k for v in gathered for k in v})
    per_name = {k: [v.get(k) for v in gathered] for k in names}
    return {k: vals for k, vals in per_name.items() if any(x != vals[0] for x in vals[1:])}


def disagreements(values: dict[str, Any], group: dist.ProcessGroup | None = None) -> dict[str, list[Any]]:
    """The names whose values differ between the ranks: `differing(all_values(values, group))`.

    A collective: every rank of `group` calls it, and every rank gets the same answer.

    Args:
        values: This rank's values (picklable, compared with ==).
        group: The process group (default: every rank).

    Returns:
        Each differing name with the list of every rank's value (None where a rank lacks the name).
    """
    return differing(all_values(values, group))


def chunks_digest(dtype: torch.dtype, shape: tuple[int, ...], chunks: Iterable[torch.Tensor]) -> str:
    """The `tensor_digest` of a tensor given as chunks: a table digested as it is drawn, never whole.

    Args:
        dtype: The tensor's dtype.
        shape: The tensor's shape.
        chunks: Its bytes in order (each read in place when contiguous on the CPU, else copied).

    Returns:
        The digest, as `tensor_digest` gives it.
    """
    crc = 0
    for chunk in chunks:
        c = chunk.detach().to("cpu").contiguous()  # a copy of at most one chunk
        crc = zlib.crc32(c.reshape(-1).view(torch.uint8).numpy(), crc)  # bytes as they are: bf16 too
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)} crc32 {crc:08x}"


def tensor_digest(t: torch.Tensor, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> str:
    """A tensor's dtype, shape and the CRC-32 of its bytes, which ranks compare to agree on a tensor.

    Equal values give the same digest on every rank, whatever its thread count: a float sum would
    not (torch splits a sum over its threads, and the rounding follows the split).

    Args:
        t: The tensor.
        chunk_bytes: Its rows are read in chunks of at most this many bytes (a contiguous CPU
            tensor is read in place; another has one chunk at a time copied).

    Returns:
        E.g. 'float32 (530, 32) crc32 1a2b3c4d'.

    Examples:
        >>> import torch
        >>> from engram.distributed import tensor_digest
        >>> tensor_digest(torch.arange(12, dtype=torch.float32).reshape(3, 4))
        'float32 (3, 4) crc32 3e667d78'
    """
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
    """A process group over a group's ranks whose collectives fail after `timeout` seconds.

    The same ranks, backend and rank numbers; created by every rank of `group` (a collective of
    those ranks only).

    Args:
        group: The process group (None: every rank).
        timeout: Seconds (see `DEFAULT_COLLECTIVE_TIMEOUT`); None: `group` itself, with the process
            group's own timeout.

    Returns:
        The bounded group, or `group` for timeout None.

    Raises:
        ValueError: The group's ranks are not in increasing order, so the bounded group could not
            keep its rank numbers.
    """
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
    """The ranks' differing values as one line, for an error message.

    Args:
        diff: What `differing` or `disagreements` returned.
        limit: Each value's repr is cut to this many characters.

    Returns:
        E.g. '--until (rank 0: 2, rank 1: 4); seed (rank 0: 0, rank 1: 1)'.
    """

    def short(x: Any) -> str:
        s = repr(x)
        return s if len(s) <= limit else s[: limit - 3] + "..."

    return "; ".join(
        f"{name} ({', '.join(f'rank {r}: {short(v)}' for r, v in enumerate(vals))})"
        for name, vals in diff.items()
    )


@contextmanager
def named_failures(rank: int, where: Callable[[], str]) -> Iterator[None]:
    """A context manager that names the rank and the step of a runtime failure in its block.

    A RankError from an inner block passes unchanged; ValueErrors (settings, rows) pass too.

    Args:
        rank: This process's rank.
        where: Called on failure for the step, e.g. 'in step 4 of 6'.

    Yields:
        Nothing; the block runs inside.

    Raises:
        RankError: The block raised a RuntimeError (a gloo timeout or lost peer, a DistBackendError,
            or any other runtime failure of this rank), chained to it.
    """
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
