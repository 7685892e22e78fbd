"""The fetch path of a `TieredTable` whose hot-row cache is indexed on the device (`DeviceRowCache`).

`DeviceTier.fetch` plans a call's rows on the cache (no host sync), fills the misses from the backing
table and returns a `DeviceBlock`: where each position's bytes sit in the cache's storage, and the
event that marks them there. `consume` dequantises a block on the caller's stream. How misses arrive:

- UVA (placement HOST_UVA): the Triton row copy reads them from the pinned table in place.
- staged (HOST / SSD on CUDA): the miss list comes to the host, the host gathers the rows into one of
  two pinned staging buffers (alternating) and ONE non_blocking copy takes them, with their slots, to
  the device.
- a CPU compute device: copied from the host table directly (the same plan, run by torch on the CPU).

Sync points, all on the fetching thread (a prefetch's: the worker) and the fetch stream only: the miss
count of each plan, and for the staged path the miss list's copy back (16 bytes a missing position).
All cache work runs on the table's fetch stream, serialised by the table's fetch lock; consumers read on
their own stream after waiting for the block's event (a device-side wait, not a host sync) and record
a release event the next fetch waits for, so no fill overwrites bytes a consumer has yet to read.
A block fetched ahead (a prefetch) stays valid until consumed: the cache never evicts a slot used at or
after the oldest pending prefetch (`protect`), and its unplaced misses sit in a scratch region with a
generation counter: a prefetch whose region was reused before it was consumed (more prefetches ahead
than regions, a regrowth, a move) is detected by `consume` (it returns None) and fetched again by the
table, never served. Design: docs/systems.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from engram import kernels
from engram.storage import lookup
from engram.systems.background import PrefetchHandle
from engram.systems.device_cache import DevicePlan, DeviceRowCache
from engram.systems.staging import Staging, align

__all__ = ["DeviceBlock", "DeviceTier", "dequantize_slots"]


class DeviceBlock(NamedTuple):
    """A fetched call: its plan over the cache's storage (as it was when planned), or only `out`."""

    plan: DevicePlan | None  # None: a dequantising prefetch, whose `out` is all it keeps
    values: torch.Tensor  # the cache's storage (C + R*X, dim) float8_e4m3fn when planned
    scales: torch.Tensor  # (C + R*X, dim // 32) float8_e8m0fnu
    ready: torch.cuda.Event | None  # recorded on the fetch stream once the fills are done (CUDA)
    out: torch.Tensor | None  # (*shape, dim) dequantised on the fetch stream (prefetch(rows, dtype))
    shape: torch.Size  # the requested rows' shape


def dequantize_slots(
    values: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None
) -> torch.Tensor:
    """`FP8Table.gather`'s dequantisation of storage rows `index` (...): the Triton gather on CUDA for
    float32 / bfloat16 with no range check (the index is the cache's own, so no sync), else
    `lookup.dequantize_gather` (the function FP8Table itself runs, hence the same bits)."""
    dtype = torch.float32 if dtype is None else dtype
    if dtype == torch.float64:  # as engram.model.table: exact in float32, then widened
        return dequantize_slots(values, scales, index, torch.float32).double()
    if dtype in (torch.float32, torch.bfloat16) and kernels.use_triton(values, scales, index):
        out = kernels.fp8_gather(values, scales, index.reshape(-1), dtype)
        return out.view(*index.shape, values.shape[1])
    return lookup.dequantize_gather(values, scales, index, dtype)


class DeviceTier:
    """Fetches for one table through `cache` on `device` (see the module doc).

    `stream`: the fetch stream (CUDA) or None; `uva`: (values, scales) CUDA views of a pinned table, or
    None; `host`: the table's (values, scales) on the host; `gather_misses(rows, out_v, out_s)`: the host
    gather of the staged path (raw bytes into pinned staging); `before_read`: called before the host
    table is read (the SSD tier's truncation check).
    """

    def __init__(
        self,
        cache: DeviceRowCache,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        *,
        uva: tuple[torch.Tensor, torch.Tensor] | None,
        host: tuple[torch.Tensor, torch.Tensor],
        gather_misses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        before_read: Callable[[], None] | None = None,
    ) -> None:
        self.cache, self.device, self.stream = cache, device, stream
        self.uva, self.host = uva, host
        self.gather_misses, self.before_read = gather_misses, before_read
        cuda = device.type == "cuda"
        self._row_staging = [Staging(pinned=cuda) for _ in range(2)]  # host row ids on their way over
        self._miss_staging = [Staging(pinned=cuda) for _ in range(2)]  # missing rows' bytes (staged path)
        self._next_rows = self._next_misses = 0
        # `lock` orders consumers against fetches: region claims and generations, protections, releases
        self.lock = threading.Lock()
        self._protected: dict[int, int] = {}  # id(prefetch handle) -> stamp of its plan, while pending
        self._releases: list[torch.cuda.Event] = []  # consumers' reads the next fetch must wait for
        self.stale = 0  # blocks that could not serve their gather (region reused, other dtype): fetched again
        self.host_syncs = 0  # on the fetching thread: one per plan (the miss count), one per staged copy-back

    # ------------------------------------------------------------------ protection of pending prefetches
    def forget(self, handle: PrefetchHandle) -> None:
        """`handle` is no longer pending (dropped, moved, claimed): its slots stop being protected."""
        with self.lock:
            handle.forgotten = True
            self._protected.pop(id(handle), None)

    # ------------------------------------------------------------------ fetch
    def fetch(
        self,
        rows: torch.Tensor,
        *,
        ahead: bool,
        dtype: torch.dtype | None = None,
        handle: PrefetchHandle | None = None,
    ) -> DeviceBlock:
        """Plan and fill `rows` (host int ids, checked; or device ids, range-checked, made on the current
        stream). `ahead`: consumed later (a prefetch: its own scratch region, protected while `handle` is
        pending); with `dtype`, dequantised here into a private `out` (no region or protection needed).
        The caller holds the table's fetch lock (one fetch at a time)."""
        shape = rows.shape
        n = rows.numel()
        cuda = self.stream is not None
        ctx = torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext()
        if cuda and rows.is_cuda:  # device ids come from the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with ctx:
            with self.lock:
                for ev in self._releases:  # consumers' reads end before any fill below
                    self.stream.wait_event(ev)
                self._releases = []
                protect_from = min(self._protected.values(), default=None)
                region = self.cache.take_region() if ahead and dtype is None else 0
                self.cache.reserve(region, n)  # bumps the region's generation: older plans of it are stale
            dev = self._rows_to_device(rows)
            plan = self.cache.plan(
                dev, region=region, protect_from=protect_from
            )  # sync point: the miss count
            self.host_syncs += 1
            self._fill(plan)
            values, scales = self.cache.values, self.cache.scales
            out = None
            if dtype is not None:
                out = dequantize_slots(values, scales, plan.final.view(shape), dtype)
            ready = None
            if cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        if ahead and out is None and handle is not None:
            with self.lock:
                if not handle.forgotten:  # a handle dropped meanwhile must not pin slots forever
                    self._protected[id(handle)] = plan.stamp
        return DeviceBlock(None if out is not None else plan, values, scales, ready, out, shape)

    def _rows_to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """Row ids (n,) int64 on the device: host ids cross in one non_blocking copy from pinned staging."""
        if rows.device == self.device:
            return rows.reshape(-1).long()
        flat = rows.reshape(-1).long()
        if self.stream is None:
            return flat.to(self.device)
        staging = self._row_staging[self._next_rows]
        self._next_rows ^= 1  # alternate: the other buffer's copy may still run
        buf = staging.take(8 * flat.numel()).view(torch.int64)
        buf.copy_(flat)
        dev = buf.to(self.device, non_blocking=True)
        staging.copied = torch.cuda.Event()
        staging.copied.record(self.stream)
        return dev

    def _fill(self, plan: DevicePlan) -> None:
        """The plan's missing rows into their storage rows (see the module doc for the three ways)."""
        if plan.fill_src.numel() == 0:  # every row was cached
            return
        if self.uva is not None:
            self.cache.fill(plan, *self.uva)  # the kernel reads the pinned table over the bus
            return
        if self.before_read is not None:
            self.before_read()
        if self.stream is None:
            self.cache.fill(plan, *self.host)  # a CPU compute device reads the host table directly
            return
        src, dst = self.cache.missing(plan)  # sync point: the miss list to the host (16 bytes a position)
        self.host_syncs += 1
        m = src.numel()
        if m == 0:
            return
        order = torch.argsort(src)  # ascending rows: DRAM / file locality
        src, dst = src[order], dst[order]
        dim, nb = self.cache.dim, self.cache.dim // 32
        off_s = align(m * dim)
        off_i = align(off_s + m * nb)
        staging = self._miss_staging[self._next_misses]
        self._next_misses ^= 1
        buf = staging.take(off_i + 8 * m)  # sync point only if the copy two fetches ago still runs
        self.gather_misses(src, buf[: m * dim].view(m, dim), buf[off_s : off_s + m * nb].view(m, nb))
        buf[off_i:].view(torch.int64).copy_(dst)
        dev = buf.to(self.device, non_blocking=True)  # the one host -> device copy of the call
        staging.copied = torch.cuda.Event()
        staging.copied.record(self.stream)
        self.cache.write(
            dev[off_i:].view(torch.int64),
            dev[: m * dim].view(m, dim),
            dev[off_s : off_s + m * nb].view(m, nb),
        )

    # ------------------------------------------------------------------ consume
    def consume(
        self, block: DeviceBlock, dtype: torch.dtype | None, handle: PrefetchHandle | None = None
    ) -> torch.Tensor | None:
        """The block's rows (*shape, dim) in `dtype` on the caller's stream, or None when the block can no
        longer serve them (its region was reused, or it kept only `out` in another dtype): fetch again.
        Ends `handle`'s protection."""
        want = torch.float32 if dtype is None else dtype
        current = torch.cuda.current_stream(self.device) if self.stream is not None else None
        try:
            if block.out is not None:
                if block.out.dtype != want:  # dequantised in another dtype; its slots are not protected
                    self.stale += 1
                    return None
                if current is not None and block.ready is not None:
                    current.wait_event(block.ready)
                    block.out.record_stream(current)
                return block.out
            assert block.plan is not None
            with self.lock:  # no fetch may claim the region between this check and the release below
                if not self.cache.valid(block.plan):
                    self.stale += 1
                    return None
                index = block.plan.final.view(block.shape)
                if current is not None and block.ready is not None:
                    current.wait_event(block.ready)  # device-side: no host sync
                    for t in (index, block.values, block.scales):
                        t.record_stream(current)
                out = dequantize_slots(block.values, block.scales, index, dtype)
                if current is not None:
                    released = torch.cuda.Event()
                    released.record(current)
                    self._releases.append(released)
                return out
        finally:
            if handle is not None:
                self.forget(handle)

    def stats(self) -> dict[str, float | str]:
        """The cache's counters plus the stale blocks and the staged path's syncs (a sync point: the
        counters are updated on the fetch stream)."""
        if self.stream is not None:
            self.stream.synchronize()
        return {**self.cache.stats(), "stale_prefetches": self.stale, "host_syncs": self.host_syncs}

    def reset_stats(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.cache.reset_stats()
        self.stale = self.host_syncs = 0
