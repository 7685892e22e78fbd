"""Background fetching with a bounded depth: the worker thread and the handle a prefetch returns.

`FetchWorker` runs fetch jobs in submission order on one daemon thread, blocking `submit` while
`max_inflight` jobs are in flight (a job completes without its consumer, so this never
deadlocks); `PrefetchHandle` is one prefetch's result, and `claim` finds the prefetch that serves
a gather. Knows jobs and rows, nothing of what a fetch does. Design: docs/systems.md.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FetchWorker", "PrefetchHandle", "claim"]


class PrefetchHandle:
    """A prefetch of rows for one table: what `TieredTable.prefetch` returns.

    Pass it to `TieredTable.gather(rows, prefetched=handle)`, or let `gather` find it by the rows'
    values. `wait()` returns the fetched block (or raises the fetch's error, e.g. a bad row id).

    Args:
        rows: The rows, a private host copy (shape and values as given; the caller may reuse its own).
        owner: The table it was made by (a handle only serves its own table).
        device: The compute device the rows were fetched to (a later `.to()` outdates it).
    """

    def __init__(self, rows: torch.Tensor, owner: object, device: torch.device | None = None) -> None:
        self.rows = rows  # host tensor, a private copy: the caller may reuse its own
        self.owner = owner  # the table it was made by (a handle only serves its own table)
        self.device = device  # the compute device the rows were fetched to (a later .to() outdates it)
        self.submitted_at = time.perf_counter()
        self.forgotten = False  # set by its table once it is no longer pending (dropped, moved, claimed)
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the fetch has finished (successfully or not); never blocks.

        Returns:
            True once `wait` would return or raise at once.
        """
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the fetch finished.

        Args:
            timeout: Seconds to wait at most; None waits for good.

        Returns:
            The fetched block.

        Raises:
            TimeoutError: The fetch is still running after `timeout` seconds.
            BaseException: The fetch's own error (e.g. a bad row id), raised again here.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"prefetch of rows {tuple(self.rows.shape)} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def matches(self, rows: torch.Tensor) -> bool:
        """Whether host rows have this handle's shape and values.

        Args:
            rows: Host row ids, int32 or int64 (compared as int64).

        Returns:
            True when shape and values are equal.
        """
        if rows is self.rows:
            return True
        if rows.shape != self.rows.shape:
            return False
        if rows.dtype == self.rows.dtype:
            return torch.equal(self.rows, rows)
        return torch.equal(self.rows.long(), rows.long())  # never narrow: int64 ids may not fit int32

    def first_difference(self, rows: torch.Tensor) -> tuple[int, ...] | None:
        """The first position where host rows differ from this handle's.

        Args:
            rows: Host row ids of this handle's shape.

        Returns:
            The position (an index tuple), or None where none differs.
        """
        diff = torch.nonzero(self.rows.long() != rows.long())
        return tuple(int(i) for i in diff[0]) if diff.shape[0] else None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "in flight"
        return f"PrefetchHandle(rows={tuple(self.rows.shape)}, {state})"


def claim(
    pending: collections.deque[PrefetchHandle],
    rows: torch.Tensor,
    prefetched: PrefetchHandle | None,
    owner: object,
) -> PrefetchHandle | None:
    """The prefetch serving host `rows` of `owner`'s gather, removed from `pending`; None if none.

    `prefetched` (explicit) must be a handle of `owner` made for equal rows (ValueError naming the
    first differing position otherwise); without it, the oldest pending handle of equal rows.
    """
    if prefetched is None:
        for h in pending:  # oldest first
            if h.matches(rows):
                pending.remove(h)
                return h
        return None
    if not isinstance(prefetched, PrefetchHandle) or prefetched.owner is not owner:
        raise ValueError(
            f"prefetched= must be a handle returned by this table's prefetch(), got {prefetched!r}; "
            "each Engram layer's table needs its own prefetch"
        )
    if not prefetched.matches(rows):
        mine = prefetched.rows
        if mine.shape != rows.shape:
            what = f"(shape {tuple(mine.shape)}) than these (shape {tuple(rows.shape)})"
        else:
            pos = prefetched.first_difference(rows)
            assert pos is not None
            what = f"than these: row {int(rows[pos])} at position {pos}, the handle's is {int(mine[pos])}"
        raise ValueError(
            f"the prefetched handle was made for other rows {what}; prefetch exactly the rows you gather"
        )
    if prefetched in pending:
        pending.remove(prefetched)
    return prefetched


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
    """One background thread running submitted fetches in order, at most `max_inflight` at a time.

    `submit` blocks while `max_inflight` jobs are in flight; a job completes without its consumer,
    so this never deadlocks. The daemon thread starts at the first submit.

    Args:
        max_inflight: Jobs in flight at most (>= 1).
        name: The thread's name.

    Raises:
        ValueError: `max_inflight` is not an int >= 1.
    """

    def __init__(self, max_inflight: int = 2, name: str = "engram-prefetch") -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r} must be an int >= 1 (prefetches in flight)")
        self.max_inflight = max_inflight
        self.name = name
        self._slots = threading.Semaphore(max_inflight)
        self._count_lock = threading.Lock()
        self._idle = threading.Condition(self._count_lock)  # notified when the last job in flight ends
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
            if self._inflight == 0:
                self._idle.notify_all()
        self._slots.release()

    def wait_idle(self) -> None:
        """Block until every submitted job has finished (their handles are then done)."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)

    def submit(self, fn: Callable[[], Any], handle: PrefetchHandle) -> PrefetchHandle:
        """Queue a fetch; blocks while `max_inflight` jobs are in flight.

        Exception-safe: an interrupt (Ctrl-C while blocked on the bound) leaves no slot taken and no
        job counted that will never run; the job is then not queued and `handle` never completes.

        Args:
            fn: The fetch, run on the worker thread.
            handle: Receives `fn`'s result, or its error.

        Returns:
            `handle`.
        """
        self._slots.acquire()  # the depth bound: waits for a running job to finish
        counted = queued = False
        try:
            with self._count_lock:
                if self._thread is None or not self._thread.is_alive():
                    # the thread gets the queue and a bound method of this worker, never the table
                    self._thread = threading.Thread(
                        target=_worker_loop, args=(self._jobs, self._release), name=self.name, daemon=True
                    )
                    self._thread.start()
                # counted and queued under the lock: the worker's release() of this job waits for it
                self._inflight += 1
                counted = True
                self._jobs.put((fn, handle))
                queued = True
        finally:
            if not queued:  # interrupted (or the thread failed to start): give the slot back
                if counted:
                    self._release()
                else:
                    self._slots.release()
        return handle

    def close(self) -> None:
        """Stop the thread after the jobs already queued, waiting for it.

        Idempotent; a later submit starts a new thread, so jobs never run on two threads at once.
        From the worker thread itself (a table collected there) it only asks the thread to stop.
        """
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            if thread is not threading.current_thread():
                thread.join()
        self._thread = None
