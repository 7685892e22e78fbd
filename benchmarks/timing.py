"""Timers the benchmarks share: `from engram.benchmarks.timing import best_time, best_times, cuda_time`,
`drop_pages` for cold reads, and `status_mib` for a process's memory."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best seconds of `fn` over `repeats` calls, after one warm-up call (page faults, allocator)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """Best seconds of `fn` on the current CUDA device (synchronised around each call), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best of `repeats` seconds of each function, the functions interleaved round by round, so that
    a change in the machine's load (a shared machine) hits every one of them alike; one warm-up call
    each first (compile / cache load, page faults)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def drop_pages(path: str | os.PathLike[str] | Path) -> None:
    """Evict the file's clean pages from the page cache, so the next reads go to the storage device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def status_mib(field: str) -> float:
    """A field of this process's /proc/self/status in MiB: VmRSS (resident now), VmHWM (its peak),
    VmData (the data segment); NaN off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return float("nan")
