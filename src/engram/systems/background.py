"""Background fetching with a bounded depth: the worker thread and the handle a prefetch returns.

Holds:
- `PrefetchHandle`: one prefetch of a table's rows: `done()`, `wait()` (the fetched block, or the
  fetch's error re-raised), and the host copy of the rows it was made for (`rows`, for matching).
- `FetchWorker(max_inflight)`: one daemon thread running fetch jobs in submission order. `submit`
  blocks while `max_inflight` jobs are queued or running (a bounded queue, as torchrec's prefetch
  depth): a job completes without its consumer, so the bound can never deadlock a single thread
  that prefetches ahead before it gathers.

The work itself (dedup, cache lookup, host gather, host -> device copy) runs in numba kernels and torch
ops that release the GIL, so the worker overlaps with the main thread's compute on a CPU as well.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FetchWorker", "PrefetchHandle"]


class PrefetchHandle:
    """A prefetch of `rows` (a host copy, shape and values as given) for one table.

    Pass it to `TieredTable.gather(rows, prefetched=handle)`, or let `gather` find it by the rows'
    values. `wait()` returns the fetched block (or raises the fetch's error, e.g. a bad row id).
    """

    def __init__(self, rows: torch.Tensor, owner: object) -> None:
        self.rows = rows  # host tensor, a private copy: the caller may reuse its own
        self.owner = owner  # the table it was made by (a handle only serves its own table)
        self.submitted_at = time.perf_counter()
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the fetch has finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the fetch finished; return its block or raise its error (TimeoutError on timeout)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"prefetch of rows {tuple(self.rows.shape)} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def matches(self, rows: torch.Tensor) -> bool:
        """Whether host `rows` have this handle's shape and values (dtype int32/int64 alike)."""
        if rows is self.rows:
            return True
        if rows.shape != self.rows.shape:
            return False
        mine = self.rows if rows.dtype == self.rows.dtype else self.rows.to(rows.dtype)
        return torch.equal(mine, rows)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "in flight"
        return f"PrefetchHandle(rows={tuple(self.rows.shape)}, {state})"


def _worker_loop(jobs: queue.SimpleQueue, release: Callable[[], None]) -> None:
    """Run (fn, handle) jobs until a None arrives. Holds no reference to a job between jobs."""
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, handle = job
        del job
        try:
            handle._finish(fn())
        except BaseException as e:  # re-raised by handle.wait() on the consumer's thread
            handle._finish(error=e)
        finally:
            del fn, handle
            release()


class FetchWorker:
    """One background thread running submitted fetches in order, at most `max_inflight` at a time."""

    def __init__(self, max_inflight: int = 2, name: str = "engram-prefetch") -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r} must be an int >= 1 (prefetches in flight)")
        self.max_inflight = max_inflight
        self.name = name
        self._slots = threading.Semaphore(max_inflight)
        self._count_lock = threading.Lock()
        self._inflight = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet finished."""
        return self._inflight

    def _release(self) -> None:
        with self._count_lock:
            self._inflight -= 1
        self._slots.release()

    def submit(self, fn: Callable[[], Any], handle: PrefetchHandle) -> PrefetchHandle:
        """Queue fn (its result goes to `handle`); blocks while `max_inflight` jobs are in flight."""
        self._slots.acquire()  # the depth bound: waits for a running job to finish
        with self._count_lock:
            self._inflight += 1
            if self._thread is None or not self._thread.is_alive():
                # the thread gets the queue and a bound method of this worker, never the table
                self._thread = threading.Thread(
                    target=_worker_loop, args=(self._jobs, self._release), name=self.name, daemon=True
                )
                self._thread.start()
        self._jobs.put((fn, handle))
        return handle

    def close(self) -> None:
        """Stop the thread after the jobs already queued (idempotent; a later submit restarts it)."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
        self._thread = None
