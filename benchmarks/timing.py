"""Timers the benchmarks share: `from engram.benchmarks.timing import best_time, cuda_time`."""

from __future__ import annotations

import time
from collections.abc import Callable

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
