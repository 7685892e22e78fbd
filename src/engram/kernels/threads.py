"""The CPU kernels' threads: how many cores this process may use, the `threads` argument's check,
and one pool that splits a kernel's range into contiguous chunks.

Every numba kernel that runs on several threads (hashing, gathers) goes through `run_chunks`; the
kernels release the GIL, so the threads run in parallel. Knows nothing of what the kernels compute.
Design: docs/kernels.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

__all__ = ["available_cores", "check_threads", "resolve_threads", "run_chunks"]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_threads(threads: Any, name: str = "threads") -> int | None:
    """`threads` as an int >= 1, or None (the caller's default); raises naming the bad value."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not hasattr(threads, "__index__"):
        raise TypeError(f"{name} must be an int or None, got {threads!r}")
    threads = int(threads)
    if threads < 1:
        raise ValueError(f"{name}={threads} must be >= 1 (or None: every core for large inputs)")
    return threads


def resolve_threads(threads: int | None, n: int, parallel_min: int) -> int:
    """Threads for n items: `threads`, or with None every core from `parallel_min` items on (handing work
    to the pool costs tens of microseconds, about what a kernel needs for a thousand items)."""
    if threads is None:
        return 1 if n < parallel_min else available_cores()
    return threads


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """A lazily created pool per worker count (threads live for the process, idle when unused)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engram-kernel")


def run_chunks(kernel: Callable[..., Any], args: tuple[Any, ...], n: int, threads: int) -> list[Any]:
    """`kernel(*args, start, end)` over [0, n) in `threads` contiguous chunks, in position order; the
    calling thread takes the last chunk. Returns each chunk's result."""
    threads = max(1, min(int(threads), n))
    if threads == 1:
        return [kernel(*args, 0, n)]
    bounds = [n * i // threads for i in range(threads + 1)]
    futures = [_pool(threads - 1).submit(kernel, *args, bounds[i], bounds[i + 1]) for i in range(threads - 1)]
    last = kernel(*args, bounds[-2], bounds[-1])
    return [f.result() for f in futures] + [last]
