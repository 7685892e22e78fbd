"""A frozen quantised Engram table stored on a tier (device, host DRAM or SSD), with a hot-row cache and prefetch.

`TieredTable` is an `EngramTable` whose `gather` returns exactly (bitwise) what `FP8Table.gather`
(`QuantTable.gather`, for the INT8 and 4-bit row formats) returns for the same stored table and
rows, on the compute device, whatever tier the bytes come from: each distinct row is fetched once, hits come from the `RowCache`, misses from the backing
tier through staging, and `prefetch` does that ahead on a background thread. On CUDA the cache's index
can live on the device (`CacheIndex.DEVICE`, `engram.systems.device_tier`), and a HOST_UVA table is
read in place by the gather kernel (`engram.systems.uva`). Inference only (no parameters, no
autograd). Design, the gather's steps and the decisions (prefetch matching, `.to`, deepcopy,
locking, sync points): docs/systems.md.

The table's options, placement, prefetch, gather and their locking are here; moving the bytes through
the host-indexed cache and staging is its mixin `engram.systems.host_fetch.HostFetch`'s; the cache,
staging and policies are their own files.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from engram.checkpoint.mmap_table import MmapQuantTable
from engram.model.table import EngramTable, QuantTable
from engram.rowformat.formats import RowFormat
from engram.rowformat.fp8 import check_rows
from engram.storage.outpool import OutputPool
from engram.systems.background import FetchWorker, PrefetchHandle, claim
from engram.systems.cache import RowCache
from engram.systems.device_cache import DEFAULT_WAYS, DeviceRowCache
from engram.systems.device_tier import DeviceTier
from engram.systems.host_fetch import HostFetch
from engram.systems.placement import (
    CacheIndex,
    Placement,
    as_cache_index,
    as_device,
    as_placement,
    check_device_memory,
)
from engram.systems.policies import CachePolicy
from engram.systems.staging import Staging
from engram.systems.uva import check_uva_table, uva_view

__all__ = ["TieredTable"]

# never copied (rebuilt per instance), resp. shared by a deepcopy (the frozen stored bytes)
_RUNTIME = (
    "_worker", "_lock", "_pending", "_stream", "_staging", "_next_staging", "_cpu_block", "out_pool", "_uva", "_tier",
)  # fmt: skip
_SHARED = ("backing", "_host_values", "_host_scales", "_dev_values", "_dev_scales")


def _check_row_ids(rows: object) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor of row ids, got {type(rows).__name__}")
    if rows.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"rows must be int64 or int32 row ids, got {rows.dtype}; convert with rows.long()")


class TieredTable(HostFetch, EngramTable):
    """A frozen quantised table on a storage tier, computed on a device, with a hot-row cache and prefetch.

    `gather` returns exactly (bitwise) what `FP8Table.gather` (`QuantTable.gather`) returns for the
    same stored table and rows, whatever tier the bytes come from: each distinct row is fetched once,
    hits come from the cache, misses from the backing tier through staging, and `prefetch` does that
    ahead on a background thread. `.to(device)` moves the compute side; a dtype change is ignored
    (the stored bytes stay quantised). Inference only (no parameters, no autograd). Design, the
    gather's steps and the sync points: docs/systems.md.

    Args:
        table: An `FP8Table` / `QuantTable` of any row format (DEVICE or HOST: moved to the device,
            resp. kept on the host; HOST_UVA, FP8 only: kept in pinned host memory and read in place
            by the CUDA gather) or an `MmapFP8Table` / `MmapQuantTable` (SSD; DEVICE reads it whole
            onto the device).
        placement: A `Placement` or its value.
        device: Where gathers compute (default: the CPU).
        cache_rows: Slots of the device-side hot-row cache (not for DEVICE; 0 = none).
        cache_index: Where its index lives: HOST (`RowCache`, exact policies) or DEVICE
            (`DeviceRowCache`, FP8 tables, set-associative LRU, no host sync per lookup); None:
            DEVICE on a CUDA device for an FP8 table without a policy or pinned rows, else HOST.
        cache_ways: The device index's ways.
        policy: The host index's replacement policy, as `RowCache` takes it.
        pinned_rows: The rows a pinned policy pins, as `RowCache` takes them.
        max_inflight: Prefetches in flight at once.
        max_pending: Prefetches remembered for gathers to claim; the oldest drops out.
        fetch_threads: Threads of the host gather (None: 1 below 2048 rows, every core above).
        verify: Re-read every fetched row from the backing tier and compare (debug; counted in
            `stats()`).

    Raises:
        TypeError: The table's kind does not fit the placement.
        ValueError: An option out of range or one that does not fit the placement, format or cache
            (the message names the fix), or more memory than the device has free.
    """

    def __init__(
        self,
        table: QuantTable | MmapQuantTable,
        placement: Placement | str = Placement.HOST,
        *,
        device: torch.device | str | None = None,
        cache_rows: int = 0,
        cache_index: CacheIndex | str | None = None,
        cache_ways: int = DEFAULT_WAYS,
        policy: CachePolicy | str | None = None,
        pinned_rows: np.ndarray | None = None,
        max_inflight: int = 2,
        max_pending: int = 8,
        fetch_threads: int | None = None,
        verify: bool = False,
    ) -> None:
        super().__init__()
        self.placement = as_placement(placement)
        if not isinstance(table, QuantTable | MmapQuantTable):
            raise TypeError(
                f"a TieredTable wraps an FP8Table or an MmapFP8Table (or a QuantTable / MmapQuantTable of another "
                f"row format), got {type(table).__name__}; quantise a float table with FP8Table.from_float(weight) "
                "(or offload_engram(..., quantize=True))"
            )
        if self.placement is Placement.SSD and not isinstance(table, MmapQuantTable):
            raise TypeError(
                "placement SSD reads rows from a memory-mapped file: pass an MmapFP8Table (write the table "
                "with engram.checkpoint.files.save_tensors, then MmapFP8Table(path, weight_name, scale_name))"
            )
        host = self.placement in (Placement.HOST, Placement.HOST_UVA)
        if host and isinstance(table, MmapQuantTable):
            raise TypeError(
                f"placement {self.placement.name} keeps the table in DRAM but this is an MmapFP8Table: use "
                "placement SSD, or load it: FP8Table(table.weight.clone(), table.scale.clone())"
            )
        if host and table.weight.device.type != "cpu":
            raise ValueError(
                f"placement {self.placement.name} needs the table in host memory, but it is on "
                f"{table.weight.device}; move it with table.cpu()"
            )
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 0:
            raise ValueError(f"cache_rows={cache_rows!r} must be an int >= 0 (0: no cache)")
        if cache_rows and self.placement is Placement.DEVICE:
            raise ValueError(
                f"cache_rows={cache_rows} but placement DEVICE already holds every row on the device; "
                "use cache_rows=0, or placement HOST / SSD"
            )
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r} must be an int >= 1")
        if fetch_threads is not None and (
            isinstance(fetch_threads, bool) or not isinstance(fetch_threads, int) or fetch_threads < 1
        ):
            raise ValueError(f"fetch_threads={fetch_threads!r} must be None or an int >= 1")
        self.num_rows, self.dim = table.num_rows, table.dim
        self.row_format = table.row_format
        self.row_bytes = self.row_format.row_bytes(self.dim)
        self.device = as_device(device)
        if (policy is not None or pinned_rows is not None or cache_index is not None) and not cache_rows:
            raise ValueError(
                f"policy={policy!r} / pinned_rows / cache_index={cache_index!r} choose how the hot-row cache "
                "works, but cache_rows=0 makes no cache; give cache_rows > 0 or drop them"
            )
        fp8 = self.row_format is RowFormat.FP8
        if self.placement is Placement.HOST_UVA and not fp8:
            raise ValueError(
                f"placement HOST_UVA reads FP8 rows in place with the CUDA FP8 gather; this table is "
                f"{self.row_format.value}: use placement HOST (staged copies) or an FP8 table"
            )
        if cache_index is None:
            auto = self.device.type == "cuda" and policy is None and pinned_rows is None and fp8
            cache_index = CacheIndex.DEVICE if auto else CacheIndex.HOST
        self.cache_index = as_cache_index(cache_index)
        if self.cache_index is CacheIndex.DEVICE and not fp8:
            raise ValueError(
                f"cache_index='device' serves FP8 rows (its gather is the FP8 one); this table is "
                f"{self.row_format.value}: use cache_index='host'"
            )
        if self.cache_index is CacheIndex.DEVICE and (policy is not None or pinned_rows is not None):
            raise ValueError(
                f"cache_index='device' runs set-associative LRU on the device; policy={policy!r} / pinned_rows "
                "are the host index's: use cache_index='host' for them"
            )
        if isinstance(cache_ways, bool) or not isinstance(cache_ways, int) or cache_ways < 1:
            raise ValueError(f"cache_ways={cache_ways!r} must be an int >= 1 (slots a row may live in)")
        self.cache_ways = cache_ways
        self.cache_rows, self.max_pending, self.fetch_threads = cache_rows, max_pending, fetch_threads
        self.policy, self.pinned_rows = policy, pinned_rows
        self.verify = bool(verify)  # re-read every fetched row from the backing tier and compare (debug)
        # plain attributes, not a submodule: model.to(...) must not drag a host / SSD table along
        self.__dict__["backing"] = table
        self._host_values = table.weight  # (N, width) the format's values on the host (file-backed for SSD)
        self._host_scales = table.scale  # (N, scales a row) FP8: (N, dim // 32) float8_e8m0fnu
        self._start_runtime(max_inflight)
        self.cache: RowCache | None = None  # the host-indexed cache (CacheIndex.HOST)
        self.device_cache: DeviceRowCache | None = None  # the device-indexed one (CacheIndex.DEVICE)
        self._rehome(self.device)
        self.reset_stats()

    def _start_runtime(self, max_inflight: int) -> None:
        """The per-instance machinery that is never copied: worker thread, lock, pending prefetches."""
        self._worker = FetchWorker(max_inflight, name=f"engram-prefetch-{self.num_rows}x{self.dim}")
        weakref.finalize(self, self._worker.close)  # stop the thread with the table
        self._lock = threading.Lock()  # serialises fetches: cache index, cache bytes, staging
        self._pending: collections.deque[PrefetchHandle] = collections.deque(maxlen=self.max_pending)

    def _make_staging(self, device: torch.device) -> None:
        """The per-device runtime: fetch stream, staging, UVA views, the device-indexed fetch path."""
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None  # the fetch stream
        self._staging = [Staging(pinned=cuda) for _ in range(2)]  # alternating (CUDA: pinned)
        self._next_staging = 0
        self._cpu_block = torch.empty(0, dtype=torch.uint8)  # reused by synchronous CPU gathers
        self.out_pool = OutputPool()  # reused CPU outputs (engram.storage.outpool)
        self._uva: tuple[torch.Tensor, torch.Tensor] | None = None  # CUDA views of the pinned table
        if self.placement is Placement.HOST_UVA:
            self._uva = (uva_view(self._host_values, device), uva_view(self._host_scales, device))
        self._tier: DeviceTier | None = None
        if self.device_cache is not None:
            ssd = self.placement is Placement.SSD
            self._tier = DeviceTier(
                self.device_cache,
                device,
                self._stream,
                uva=self._uva,
                host=(self._host_values, self._host_scales),
                gather_misses=self._gather_misses,
                before_read=self.backing.check_files if ssd else None,
            )

    # ------------------------------------------------------------------ copying
    def __getstate__(self) -> dict[str, Any]:
        """The state without the runtime machinery (rebuilt by __setstate__); waits for fetches in flight."""
        self.synchronize()
        if self._stream is not None:  # the device cache is written on the fetch stream
            self._stream.synchronize()
        with self._lock:
            state = {k: v for k, v in super().__getstate__().items() if k not in _RUNTIME}
        state["_max_inflight"] = self.max_inflight
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        max_inflight = state.pop("_max_inflight")
        super().__setstate__(state)
        self._start_runtime(max_inflight)
        self._make_staging(self.device)

    def __deepcopy__(self, memo: dict[int, Any]) -> TieredTable:
        """A copy sharing the stored FP8 bytes (read-only), with its own cache, counters and worker."""
        state = self.__getstate__()
        shared = {k: state.pop(k) for k in _SHARED if k in state}
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__({**copy.deepcopy(state, memo), **shared})
        return new

    # ------------------------------------------------------------------ placement and devices
    @property
    def max_inflight(self) -> int:
        """Prefetches in flight at once (the worker's bound)."""
        return self._worker.max_inflight

    @property
    def weight(self) -> torch.Tensor:
        """The stored FP8 values (N, dim): on the device for DEVICE, else the host / file copy."""
        return self._dev_values if self.placement is Placement.DEVICE else self._host_values

    @property
    def scale(self) -> torch.Tensor:
        """The stored ue8m0 scales (N, dim // 32), where `weight` is."""
        return self._dev_scales if self.placement is Placement.DEVICE else self._host_scales

    def _rehome(self, device: torch.device) -> None:
        """Put the compute side (device table, cache bytes, staging, stream) on `device`."""
        if self.placement is Placement.HOST_UVA:  # refuse before changing anything
            check_uva_table(self._host_values, self._host_scales, device)
        self.synchronize()
        if getattr(self, "_stream", None) is not None:
            self._stream.synchronize()  # the device cache is written on the fetch stream
        self._forget_pending()
        self.device = device
        if self.placement is Placement.DEVICE:
            if isinstance(self.backing, MmapQuantTable):
                self.backing.check_files()  # a truncated file: an error, not a SIGBUS
            self._dev_values = self._host_values.to(device)
            self._dev_scales = self._host_scales.to(device)
        elif self.cache_rows and self.cache_index is CacheIndex.DEVICE:
            if self.device_cache is None:
                self.device_cache = DeviceRowCache(
                    self.cache_rows, self.dim, self.num_rows, device, ways=self.cache_ways
                )
            else:
                self.device_cache.to(device)
        elif self.cache_rows:
            if self.cache is None or self.cache.device != device:
                check_device_memory(
                    self.cache_rows * self.row_bytes,
                    device,
                    f"a hot-row cache of {self.cache_rows:,} rows x {self.row_bytes} bytes",
                    "use fewer cache_rows (or free device memory first)",
                )
            if self.cache is None:
                self.cache = RowCache(
                    self.cache_rows,
                    self.dim,
                    device,
                    policy=self.policy,
                    pinned_rows=self.pinned_rows,
                    fmt=self.row_format,
                )
            else:
                self.cache.to(device)
        self._make_staging(device)
        if self._stream is not None:  # the bytes above were copied on the current stream: order the fetch
            self._stream.wait_stream(torch.cuda.current_stream(device))  # stream after it (no host sync)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # Probe where `fn` sends a byte tensor: a device move re-homes the compute side, a dtype change
        # (a parent's .half()) is ignored: the stored bytes are FP8 whatever the model's dtype.
        probe = fn(torch.empty(0, dtype=torch.uint8, device=self.device))
        if probe.device != self.device:
            self._rehome(as_device(probe.device))
        return self

    def synchronize(self) -> None:
        """Wait until every prefetch in flight has finished (their handles stay usable)."""
        self._worker.wait_idle()  # every job submitted has finished, so every handle is done

    def _forget(self, handle: PrefetchHandle) -> None:
        """`handle` is no longer pending: a device-indexed cache stops protecting its rows."""
        if getattr(self, "_tier", None) is not None:
            self._tier.forget(handle)
        else:
            handle.forgotten = True

    def _forget_pending(self) -> None:
        for h in self._pending:
            self._forget(h)
        self._pending.clear()

    def _remember(self, handle: PrefetchHandle) -> None:
        """Add a prefetch to the pending ones; the oldest drops out (forgotten) when max_pending are."""
        if len(self._pending) == self._pending.maxlen:
            self._forget(self._pending[0])
        self._pending.append(handle)

    def _resident(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (values, scales) a gather reads in place, with nothing to fetch: the device copy (DEVICE),
        the UVA views of a pinned table without a cache (HOST_UVA); else None."""
        if self.placement is Placement.DEVICE:
            return self._dev_values, self._dev_scales
        if self.placement is Placement.HOST_UVA and self._tier is None and self.cache is None:
            return self._uva
        return None

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        """Zero every counter (the cache's too); cached rows stay."""
        with self._lock:  # the worker updates rows_distinct / bytes_fetched and the cache's counters
            self._zero_stats()

    def _zero_stats(self) -> None:
        self.gathers = 0
        self.rows_requested = 0  # row ids asked for by gathers (with repeats)
        self.rows_distinct = 0  # distinct rows per fetch, summed
        self.bytes_fetched = 0  # bytes read from the backing tier
        self.prefetch_hits = 0  # gathers served by a prefetch
        self.prefetch_misses = 0  # gathers that found no prefetch and fetched synchronously
        self.wait_seconds = 0.0  # time gathers spent waiting for prefetches still in flight
        self.verify_rows = 0  # rows compared with the backing tier (verify=True)
        self.verify_mismatches = 0  # of those, rows whose served bytes differ
        if self.cache is not None:
            self.cache.reset_stats()
        if self._tier is not None:
            self._tier.reset_stats()

    def stats(self) -> dict[str, float | str]:
        """The table's counters, a consistent snapshot (a sync point with a device-indexed cache).

        Returns:
            placement, gathers, rows requested and distinct, bytes fetched, prefetch hits and misses,
                seconds waited on prefetches, verify counts; plus the cache's (cache_hits,
                cache_misses, ...) when it has one.
        """
        with self._lock:  # a consistent snapshot: the worker updates some counters
            return self._stats()

    def _stats(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {
            "placement": self.placement.value,
            "gathers": self.gathers,
            "rows_requested": self.rows_requested,
            "rows_distinct": self.rows_distinct,
            "bytes_fetched": self.bytes_fetched,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "wait_seconds": self.wait_seconds,
            "verify_rows": self.verify_rows,
            "verify_mismatches": self.verify_mismatches,
        }
        if self.cache is not None:
            out.update({f"cache_{k}": v for k, v in self.cache.stats().items()})
        if self._tier is not None:  # a sync point: these counters live on the device
            cs = self._tier.stats()
            out["rows_distinct"] = int(cs["hits"]) + int(cs["misses"])
            out["bytes_fetched"] = cs["bytes_fetched"]
            out.update({f"cache_{k}": v for k, v in cs.items()})
        return out

    # ------------------------------------------------------------------ public API
    def prefetch(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> PrefetchHandle:
        """Start fetching rows in the background.

        Blocks while `max_inflight` prefetches are in flight. A bad row id raises when the handle is
        waited for (at the gather).

        Args:
            rows: Row ids, int64/int32, any shape, any device (copied to the host).
            dtype: The worker also dequantises the rows into this dtype, and a gather asking for the
                same dtype returns that tensor: on a CPU compute device dequantisation (and the page
                faults of a fresh output) is most of a gather, so this moves it off the critical path
                too. Without it, the gather dequantises the fetched bytes (cheap on CUDA).

        Returns:
            The handle; pass it to `gather`, or let `gather` find it by the rows' values.

        Raises:
            TypeError: `rows` is not an int64 or int32 tensor.
        """
        _check_row_ids(rows)
        host = rows.detach().to("cpu", copy=True)  # private copy: the caller may reuse its tensor
        handle = PrefetchHandle(host, self, self.device)
        if self._resident() is not None:  # nothing to fetch: every row is readable in place
            try:
                check_rows(host, self.num_rows)  # a bad id raises at the gather, as for the other tiers
                handle._finish(None)
            except ValueError as e:
                handle._finish(error=e)
        elif self._tier is not None:
            tier = self._tier

            def job() -> Any:
                check_rows(host, self.num_rows)  # a bad id raises at the gather (handle.wait())
                with self._lock:
                    return tier.fetch(host, ahead=True, dtype=dtype, handle=handle)

            self._worker.submit(job, handle)
        else:
            # submit may block on the depth bound (and be interrupted): only a queued job is pending
            self._worker.submit(lambda: self._fetch(host, reuse=False, dtype=dtype), handle)
        self._remember(handle)
        return handle

    def gather(
        self,
        rows: torch.Tensor,
        dtype: torch.dtype | None = None,
        *,
        prefetched: PrefetchHandle | None = None,
    ) -> torch.Tensor:
        """The dequantised embeddings of rows: bitwise what `FP8Table.gather` gives for the stored table.

        Uses `prefetched`, else a pending prefetch of equal rows, else fetches now (see docs/systems.md).

        Args:
            rows: Row ids (...) int64/int32 on any device.
            dtype: The embeddings' dtype (default float32).
            prefetched: A handle of this table's `prefetch` for equal rows.

        Returns:
            The embeddings (..., dim) in `dtype` on the table's device.

        Raises:
            TypeError: `rows` is not an int64 or int32 tensor.
            ValueError: A row id is out of range, or `prefetched` is another table's or for other rows.
        """
        _check_row_ids(rows)
        self.gathers += 1
        self.rows_requested += rows.numel()
        if self._tier is not None:
            return self._gather_device(rows, dtype, prefetched)
        res = self._resident()  # every row readable in place on the device: nothing to fetch
        resident = res is not None
        if res is not None and prefetched is None and not self._pending:  # nothing to match: no host copy
            self.prefetch_misses += 1
            return self._dequantize(*res, rows.to(self.device), dtype)
        host = rows if rows.device.type == "cpu" else rows.cpu()  # sync point for CUDA rows (module doc)
        handle = claim(self._pending, host, prefetched, self)
        if handle is not None:
            handle.forgotten = True
        if handle is not None and not resident and handle.device != self.device:
            handle = None  # fetched before a .to(): its bytes are on the old device, fetch again
        if handle is None:
            self.prefetch_misses += 1
        else:
            self.prefetch_hits += 1
            t0 = time.perf_counter()
            block = handle.wait()  # raises the fetch's error (a bad row id)
            self.wait_seconds += time.perf_counter() - t0
        if res is not None:
            return self._dequantize(*res, rows.to(self.device), dtype)
        if handle is None:
            block = self._fetch_block(host, reuse=True, direct_dtype=dtype)
            if block.out is not None:  # dequantised straight from the cache's slots
                return block.out
        if block.ready is not None:  # CUDA: order the current stream after the fetch stream, no host sync
            current = torch.cuda.current_stream(self.device)
            current.wait_event(block.ready)
            for t in (block.values, block.scales, block.inverse, block.out):
                if t is not None:
                    t.record_stream(current)  # the allocator must not reuse them before this stream is done
        if block.out is not None and block.out.dtype == (torch.float32 if dtype is None else dtype):
            assert handle is not None
            handle._result = block._replace(out=None)  # the caller owns it now: serve it only once
            return block.out  # dequantised by the worker (prefetch(rows, dtype))
        # a block dequantised from cache slots keeps `out` alone: in another dtype (or served once), fetch again
        if block.inverse is None:
            block = self._fetch_block(host, reuse=True, direct_dtype=dtype)
            if block.out is not None:
                return block.out
        return self._dequantize(block.values, block.scales, block.inverse, dtype)

    def _gather_device(
        self, rows: torch.Tensor, dtype: torch.dtype | None, prefetched: PrefetchHandle | None
    ) -> torch.Tensor:
        """`gather` through the device-indexed cache (engram.systems.device_tier): a pending prefetch's
        block if it can still serve, else a fetch now; both dequantised on the current stream."""
        tier = self._tier
        assert tier is not None
        handle, host = None, rows if rows.device.type == "cpu" else None
        if prefetched is not None or self._pending:
            if host is None:
                host = rows.cpu()  # sync point for CUDA rows: matching a prefetch needs their values
            handle = claim(self._pending, host, prefetched, self)
            if handle is not None and (handle.device != self.device or handle.forgotten):
                tier.forget(handle)  # fetched before a .to(), or dropped from the pending ones (its rows
                handle = None  # were no longer protected): fetch again
        out = None
        if handle is not None:
            self.prefetch_hits += 1
            t0 = time.perf_counter()
            block = handle.wait()  # raises the fetch's error (a bad row id)
            self.wait_seconds += time.perf_counter() - t0
            out = tier.consume(block, dtype, handle)  # None: its scratch was reused before now (counted)
        else:
            self.prefetch_misses += 1
        if out is None:
            which = host if host is not None else rows
            check_rows(which, self.num_rows)  # CUDA rows: a sync point (the range check)
            with self._lock:
                out = tier.consume(tier.fetch(which, ahead=False), dtype)
            assert out is not None  # region 0 under the fetch lock: nothing reused it
        if self.verify:
            self._verify_out(host if host is not None else rows.cpu(), out, dtype)
        return out

    def _verify_out(self, host: torch.Tensor, out: torch.Tensor, dtype: torch.dtype | None) -> None:
        """Compare a gather's result with FP8Table.gather's on the backing table, row by row (a sync point)."""
        if self.placement is Placement.SSD:
            self.backing.check_files()
        ref = self._dequantize(self._host_values, self._host_scales, host, dtype)
        a, b = out.detach().cpu(), ref
        if a.dtype.is_floating_point:
            a, b = a.view(torch.uint8), b.view(torch.uint8)  # bitwise: NaN rows compare too
        bad = (a != b).reshape(*host.shape, -1).any(-1)
        self.verify_rows += int(host.numel())
        self.verify_mismatches += int(bad.sum())

    def extra_repr(self) -> str:
        cache = (
            f", cache_rows={self.cache_rows}, cache_index={self.cache_index.value}" if self.cache_rows else ""
        )
        return (
            f"num_rows={self.num_rows}, dim={self.dim}, format={self.row_format.value}, placement={self.placement.value}, "
            f"device={self.device}{cache}, max_inflight={self.max_inflight}"
        )
