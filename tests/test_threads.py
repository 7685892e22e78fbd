"""Tests for engram.kernels.threads' thread choice: `threads_for` (one thread per idle core, at least
one), `idle_cores` (measured from /proc/stat) and `default_threads` (what `engram` commands use
without --threads). The speed it buys is measured by benchmarks/bench_threads.py, not here."""

from __future__ import annotations

import pytest

import engram.kernels.threads as threads_mod
from engram.kernels.threads import available_cores, default_threads, idle_cores, threads_for


@pytest.mark.parametrize(
    ("cores", "idle", "expected"),
    [
        (2, None, 2),  # not measurable: every core
        (2, 2.0, 2),
        (2, 1.75, 2),  # a little background work does not cost a thread
        (2, 1.0, 1),  # beside one busy process (the case): one thread, no waiting on each other
        (2, 0.1, 1),  # never fewer than one
        (2, 0.0, 1),
        (8, 5.9, 6),
        (8, 5.6, 5),
        (4, 9.0, 4),  # never more than the cores
        (1, 1.0, 1),
    ],
)
def test_threads_for(cores, idle, expected):
    assert threads_for(cores, idle) == expected


def test_threads_for_refuses_no_cores():
    with pytest.raises(ValueError, match="cores=0"):
        threads_for(0, 1.0)


class _Clock:
    """Stands in for the time module: sleep does nothing, the window lasts 0.1 s, this process uses
    `own` seconds of CPU during it."""

    def __init__(self, own: float = 0.0) -> None:
        self.own, self.calls = own, 0

    def sleep(self, _seconds: float) -> None:
        self.calls += 1

    def perf_counter(self) -> float:
        return 0.1 * self.calls

    def process_time(self) -> float:
        return self.own * self.calls


def test_idle_cores_from_proc_stat_ticks(monkeypatch):
    """Idle ticks over the window, as cores of the affinity mask; this process's own CPU time counts
    as idle (its threads are what the count is for)."""
    cores = len(threads_mod.os.sched_getaffinity(0))
    ticks = iter([(1000, 5000), (1000 + 50 * cores, 5000 + 100 * cores)])  # half of every core idle
    monkeypatch.setattr(threads_mod, "_cpu_ticks", lambda cpus: next(ticks))
    monkeypatch.setattr(threads_mod, "time", _Clock())
    assert idle_cores() == pytest.approx(cores / 2)
    ticks = iter([(1000, 5000), (1000 + 50 * cores, 5000 + 100 * cores)])
    monkeypatch.setattr(threads_mod, "time", _Clock(own=0.05))  # half a core of ours in the 0.1 s
    assert idle_cores() == pytest.approx(cores / 2 + 0.5)
    monkeypatch.setattr(threads_mod, "_cpu_ticks", lambda cpus: None)  # no /proc/stat
    assert idle_cores() is None
    monkeypatch.setattr(threads_mod, "idle_cores", lambda window=0.1: None)
    assert default_threads() == available_cores()


def test_idle_cores_measures_this_machine():
    """The real measurement: a number of cores between 0 and the affinity mask's (or None off Linux)."""
    idle = idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= available_cores()
    assert 1 <= default_threads(0.05) <= available_cores()
