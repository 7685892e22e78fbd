"""The host-indexed fetch path of `engram.systems.tiered.TieredTable`: a call's rows to a `FetchedBlock`.

`HostFetch` is the half of the tiered table that moves bytes (docs/systems.md, steps 1-4): the call's
distinct rows, sorted; hits from the host-indexed `RowCache`, misses read from the backing tier (DRAM or
a memory-mapped file) through staging onto the compute device; on a CPU, a gather whose rows all sit in
the cache after the call dequantised straight from the cache's slots; `verify`'s re-read of every
fetched row. It is a mixin: `TieredTable` holds the state it reads (listed below) and takes its lock
around it. The device-indexed cache's path is `engram.systems.device_tier`'s.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from engram.checkpoint.mmap_table import MmapQuantTable
from engram.kernels import cpu_cache
from engram.model.table import QuantTable
from engram.rowformat.formats import RowFormat
from engram.rowformat.fp8 import check_rows
from engram.storage import lookup
from engram.storage.outpool import OutputPool
from engram.systems.cache import CachePlan, RowCache
from engram.systems.placement import Placement
from engram.systems.staging import (
    FetchedBlock,
    FetchPlan,
    Staging,
    align,
    assemble_cpu,
    assemble_cuda,
    block_views,
    cpu_block_bytes,
)

__all__ = ["HostFetch"]


def _ascending(idx: np.ndarray) -> bool:
    """Whether `idx` is in ascending order (a permutation of arange(n) that is: the identity)."""
    return bool(idx.shape[0] < 2 or (idx[1:] > idx[:-1]).all())


class HostFetch:
    """Fetching and dequantising a tiered table's rows through the host-indexed cache (see the module)."""

    # what the table holds (engram.systems.tiered.TieredTable sets each)
    backing: QuantTable | MmapQuantTable
    placement: Placement
    num_rows: int
    dim: int
    row_format: RowFormat
    row_bytes: int
    device: torch.device
    fetch_threads: int | None
    verify: bool
    cache: RowCache | None
    out_pool: OutputPool
    _host_values: torch.Tensor
    _host_scales: torch.Tensor
    _lock: threading.Lock
    _stream: torch.cuda.Stream | None
    _staging: list[Staging]
    _next_staging: int
    _cpu_block: torch.Tensor
    # counters (TieredTable.stats)
    rows_distinct: int
    bytes_fetched: int
    verify_rows: int
    verify_mismatches: int

    def _cpu_buffer(self, nbytes: int) -> torch.Tensor:
        """The synchronous CPU gathers' one reused byte buffer, grown (by half at least) to `nbytes`."""
        if self._cpu_block.numel() < nbytes:
            self._cpu_block = torch.empty(
                align(max(nbytes, self._cpu_block.numel() * 3 // 2)), dtype=torch.uint8
            )
        return self._cpu_block

    def _dequantize(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        index: torch.Tensor,
        dtype: torch.dtype | None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """FP8Table.gather's dequantisation: index (...) into values / scales -> (..., dim) in dtype."""
        dtype = torch.float32 if dtype is None else dtype
        if dtype == torch.float64:  # as engram.model.table: exact in float32, then widened
            return lookup.dequantize_gather(values, scales, index, torch.float32, threads=threads).double()
        out = None
        if self.device.type == "cpu" and index.device.type == "cpu":  # no fresh pages to fault in
            out = self.out_pool.empty((*index.shape, self.dim), dtype)
        return lookup.dequantize_gather(values, scales, index, dtype, out, threads=threads)

    def _fetch(self, host: torch.Tensor, *, reuse: bool, dtype: torch.dtype | None = None) -> FetchedBlock:
        """Distinct rows of `host` (..., int) as a FetchedBlock on the device (docs/systems.md, steps 1-4);
        with `dtype`, also dequantised (on the fetch stream for CUDA)."""
        if dtype is not None and self.device.type == "cpu":
            # dequantised here, under the lock: the rows may be read straight from the cache's slots
            block = self._fetch_block(host, reuse=reuse, direct_dtype=dtype, direct_ok=True)
            if block.inverse is None:  # the direct path: `out` is all the block keeps
                return block
        else:
            block = self._fetch_block(host, reuse=reuse)
        if dtype is None:
            return block
        if block.ready is None:
            out = self._dequantize(block.values, block.scales, block.inverse, dtype, self.fetch_threads)
            return block._replace(out=out)
        with torch.cuda.stream(self._stream):
            out = self._dequantize(block.values, block.scales, block.inverse, dtype)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return block._replace(out=out, ready=ready)

    def _fetch_block(
        self,
        host: torch.Tensor,
        *,
        reuse: bool,
        direct_dtype: torch.dtype | None = None,
        direct_ok: bool = False,
    ) -> FetchedBlock:
        """The call's distinct rows as a block; on a CPU, when every distinct row is in the cache after
        this call and the result is made at once (`reuse`, or `direct_ok` from a dequantising
        prefetch), dequantised straight from the cache's slots instead (`out` set; a prefetch's block
        then keeps `out` alone, the slots being free to be evicted once the lock is released)."""
        # sorted distinct rows (ascending: file / DRAM locality) and the inverse, on this thread, GIL released
        uniq, inverse, bad = cpu_cache.unique_rows(host.reshape(-1).numpy(), self.num_rows)  # (U,), (n,)
        if bad >= 0:
            check_rows(host, self.num_rows)  # raises, naming the first bad id and its position
        u = uniq.shape[0]
        with self._lock:
            if self.cache is not None:
                plan = self.cache.plan(uniq)
                miss_idx, hit_idx, hit_slots, ins_slots = (
                    plan.miss_idx,
                    plan.hit_idx,
                    plan.hit_slots,
                    plan.ins_slots,
                )
                direct = (
                    self.device.type == "cpu"
                    and (reuse or direct_ok)
                    and ins_slots.shape[0] == miss_idx.shape[0]
                )
                if direct:  # every distinct row is in the cache after this call: read them from their slots
                    block = self._direct(host, uniq, inverse, plan, direct_dtype)
                    return block if reuse else block._replace(values=None, scales=None, inverse=None)
                # the block is [misses in the plan's order; hits]: re-point the inverse at it (a pinned
                # policy lists its admitted misses first, so even a call without hits may need it)
                if hit_idx.shape[0] or not _ascending(miss_idx):
                    pos = np.empty(u, dtype=np.int64)
                    pos[miss_idx] = np.arange(miss_idx.shape[0])
                    pos[hit_idx] = np.arange(miss_idx.shape[0], u)
                    inverse = pos[inverse]
            else:
                miss_idx = np.arange(u)
                hit_idx = hit_slots = ins_slots = np.empty(0, dtype=np.int64)
            m = miss_idx.shape[0]
            miss_rows = torch.from_numpy(uniq[miss_idx])  # (M,) in the plan's order
            self.rows_distinct += u
            self.bytes_fetched += m * self.row_bytes
            fetch = FetchPlan(miss_rows, inverse, hit_slots, ins_slots, u, host.shape)
            if self.device.type == "cpu":
                nbytes = cpu_block_bytes(u, self.dim, self.row_format)
                if reuse:  # a synchronous gather consumes the block at once: one buffer serves every call
                    buf = self._cpu_buffer(nbytes)
                else:  # a prefetched block lives until its gather: its own buffer
                    buf = self.out_pool.empty((nbytes,), torch.uint8)  # reused once its gather let go of it
                block = assemble_cpu(buf, self.cache, self._gather_misses, fetch, self.dim, self.row_format)
                if self.verify:
                    self._verify(uniq, miss_idx, hit_idx, block.values, block.scales)
                return block
            assert self._stream is not None
            staging = self._staging[self._next_staging]  # alternate: the other one may still be copying
            self._next_staging ^= 1
            block = assemble_cuda(
                staging,
                self._stream,
                self.device,
                self.cache,
                self._gather_misses,
                fetch,
                self.dim,
                self.row_format,
            )
            if self.verify:
                assert block.ready is not None
                block.ready.synchronize()  # sync point: verify is a debugging mode
                self._verify(uniq, miss_idx, hit_idx, block.values.cpu(), block.scales.cpu())
            return block

    def _verify(
        self,
        uniq: np.ndarray,
        miss_idx: np.ndarray,
        hit_idx: np.ndarray,
        values: torch.Tensor,
        scales: torch.Tensor,
    ) -> None:
        """Compare a block's rows [misses; hits] (values (U, dim), scales (U, nb) on the host) with a fresh
        read of the same rows from the backing tier; count the rows that differ."""
        rows = torch.from_numpy(np.concatenate([uniq[miss_idx], uniq[hit_idx]]))  # (U,) the block's order
        if self.placement is Placement.SSD:
            self.backing.check_files()
        ref_v = lookup.gather_rows(self._host_values, rows).view(torch.uint8)
        ref_s = lookup.gather_rows(self._host_scales, rows).view(torch.uint8)
        bad = (values.view(torch.uint8) != ref_v).any(1) | (scales.view(torch.uint8) != ref_s).any(1)
        self.verify_rows += int(rows.numel())
        self.verify_mismatches += int(bad.sum())

    def _direct(
        self,
        host: torch.Tensor,
        uniq: np.ndarray,
        inverse: np.ndarray,
        plan: CachePlan,
        dtype: torch.dtype | None,
    ) -> FetchedBlock:
        """A synchronous CPU gather whose distinct rows all sit in the cache after this call (under the lock):
        the misses are read into their slots, then the rows are dequantised straight from the cache's
        slots (no copy of the hits). Only for a result made at once, under the lock: a later fetch may
        evict the slots. Returns the block with `out` set."""
        assert self.cache is not None
        m = plan.miss_idx.shape[0]
        self.rows_distinct += uniq.shape[0]
        self.bytes_fetched += m * self.row_bytes
        if m:
            buf = self._cpu_buffer(cpu_block_bytes(m, self.dim, self.row_format))
            vb, sb = self.row_format.value_bytes(self.dim), self.row_format.scale_bytes(self.dim)
            mv, ms = block_views(buf, m, vb, sb)  # (M, value bytes), (M, scale bytes)
            self._gather_misses(torch.from_numpy(uniq[plan.miss_idx]), mv, ms)
            self.cache.write(torch.from_numpy(plan.ins_slots), mv, ms)
        slot = np.empty(uniq.shape[0], dtype=np.int64)  # (U,) each distinct row's slot
        slot[plan.miss_idx] = plan.ins_slots
        slot[plan.hit_idx] = plan.hit_slots
        if self.verify:
            order = np.concatenate([plan.miss_idx, plan.hit_idx])
            s = torch.from_numpy(slot[order])
            self._verify(uniq, plan.miss_idx, plan.hit_idx, self.cache.values[s], self.cache.scales[s])
        index = torch.from_numpy(slot[inverse]).view(host.shape)
        out = self._dequantize(self.cache.values, self.cache.scales, index, dtype)
        return FetchedBlock(self.cache.values, self.cache.scales, index, None, out)

    def _gather_misses(self, miss_rows: torch.Tensor, out_v: torch.Tensor, out_s: torch.Tensor) -> None:
        """Raw bytes of rows miss_rows (M,) from the backing tier into out_v (M, value bytes) / out_s (M, scale
        bytes) uint8 (FP8: (M, dim) / (M, nb))."""
        if miss_rows.numel() == 0:
            return
        if self.placement is Placement.SSD:
            self.backing.check_files()  # one fstat: a file truncated since it was opened raises, no SIGBUS
        # numba byte copies (GIL released; file pages fault in for SSD), rows ascending for locality
        threads = self.fetch_threads
        fmt = self.row_format
        lookup.gather_rows(self._host_values, miss_rows, out_v.view(fmt.value_dtype), threads=threads)
        lookup.gather_rows(self._host_scales, miss_rows, out_s.view(fmt.scale_dtype), threads=threads)
