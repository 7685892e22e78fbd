"""The CPU kernels' threads: how many cores this process may use (and how many of them other
processes leave idle: `idle_cores`, `default_threads`), the `threads` argument's check, and one
pool that splits a kernel's range into contiguous chunks.

Every numba kernel that runs on several threads (hashing, gathers) goes through `run_chunks`; the
kernels release the GIL, so the threads run in parallel. Knows nothing of what the kernels compute.
Design: docs/kernels.md.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

__all__ = [
    "available_cores",
    "check_threads",
    "default_threads",
    "idle_cores",
    "resolve_threads",
    "run_chunks",
    "threads_for",
]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(idle, total) clock ticks of `cpus` since boot, from /proc/stat (None where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        return None
    idle = total = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
    return (idle, total) if total else None


def idle_cores(window: float = 0.1) -> float | None:
    """Cores of this process's affinity mask that other processes leave idle, measured over `window`
    seconds (Linux /proc/stat; this process's own CPU time over the window counts as idle, since it
    is what the threads will use); None where /proc/stat cannot be read. Costs `window` seconds."""
    cpus = (
        set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    )
    before, own0, t0 = _cpu_ticks(cpus), time.process_time(), time.perf_counter()
    time.sleep(window)
    after, own1, t1 = _cpu_ticks(cpus), time.process_time(), time.perf_counter()
    if before is None or after is None or after[1] <= before[1]:
        return None
    idle_share = (after[0] - before[0]) / (after[1] - before[1])  # of every cpu in the mask, together
    own = (own1 - own0) / max(t1 - t0, 1e-9)  # cores this process used meanwhile
    return min(len(cpus), idle_share * len(cpus) + own)


def threads_for(cores: int, idle: float | None, slack: float = 0.3) -> int:
    """torch threads for `cores` cores of which `idle` are free (None: all): one per free core, a core
    counting as free from 1 - `slack` of it idle, at least 1. Every thread of a torch parallel region
    waits for the slowest at its end (spinning, with libgomp), so a thread whose core another process
    shares stalls them all: beside one busy process on 2 cores, 2 threads ran the demo's steps 2-4x
    slower than 1 (BENCHMARKS.md, benchmarks/bench_threads.py)."""
    if cores < 1:
        raise ValueError(f"cores={cores}: a process has at least 1 core")
    if idle is None:
        return cores
    return max(1, min(cores, math.floor(idle + slack)))


def default_threads(window: float = 0.1) -> int:
    """The default torch thread count of an `engram` command: `threads_for(available_cores(),
    idle_cores(window))`, so it degrades with the CPU other processes take (measured once, at the
    start, over `window` seconds). An explicit --threads wins over it."""
    return threads_for(available_cores(), idle_cores(window))


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
