"""Three levels of a quantised table by row frequency: hot rows on the device, warm in host DRAM, the rest on SSD.

`LevelTable` is an `EngramTable` whose `gather` returns exactly (bitwise) what `FP8Table.gather`
(`QuantTable.gather` for the INT8 and 4-bit row formats: every level moves the format's bytes) returns
for the stored table: each call's distinct rows are looked up in the device cache (level 1,
a `RowCache` on the compute device), its misses in the host cache (level 2, a `RowCache` in DRAM),
and what both miss is read from the backing store (level 3: a `RowFile` read with positional reads,
a memory-mapped safetensors `MmapFP8Table`, or an in-memory `FP8Table`). Each level has its own
budget (rows), policy and counters: hits, misses, bytes moved into it, seconds waited on the level
below. A call whose distinct rows exceed a level's budget is still served exactly: rows that do not
fit pass through that level uncached for this call (the cache admits at most budget - hits rows).
`verify=True` re-reads every served row from the backing store and counts rows whose bytes differ.
On a CPU-only machine level 1 is simply the first in-memory level. Synchronous (no prefetch).
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engram.checkpoint.mmap_table import MmapQuantTable
from engram.kernels import cpu_cache
from engram.model.table import EngramTable, QuantTable
from engram.rowformat.formats import RowFormat
from engram.rowformat.fp8 import check_row_ids, check_rows
from engram.storage import lookup
from engram.storage.outpool import OutputPool
from engram.storage.rowfile import RowFile
from engram.systems.cache import RowCache
from engram.systems.placement import as_device

__all__ = ["LevelStats", "LevelTable"]


@dataclass
class LevelStats:
    """Counters of one level: distinct rows found / not found, bytes moved in from below, seconds waited.

    Args:
        name: "device", "host" or "backing".
        capacity: The level's budget in rows (the table's rows for the backing store).
        hits: Distinct rows found in the level.
        misses: Distinct rows not found there.
        bytes_in: Bytes copied into this level (or, for the backing store, read from it).
        seconds: Time spent getting this level's misses from the level below.
    """

    name: str
    capacity: int
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # bytes copied into this level (or, for the backing store, read from it)
    seconds: float = 0.0  # time spent getting this level's misses from the level below

    def as_dict(self) -> dict[str, Any]:
        """The counters as a dict, with the hit rate.

        Returns:
            capacity, hits, misses, hit_rate, bytes_in and seconds.
        """
        lookups = self.hits + self.misses
        return {
            "capacity": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "bytes_in": self.bytes_in,
            "seconds": self.seconds,
        }


def _budget(name: str, value: object, num_rows: int, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int number of rows")
    if allow_zero and value == 0:
        return 0
    if value < 1:
        raise ValueError(
            f"{name}={value} rows: a level needs a budget >= 1 row; to leave out a cache level use "
            "engram.systems.TieredTable (one cache in front of one backing tier)"
        )
    if value > num_rows:
        raise ValueError(
            f"{name}={value} rows is larger than the table ({num_rows} rows); use at most {num_rows} "
            "(a level that holds every row needs no level below it: use an FP8Table)"
        )
    return value


def _cache(
    level: str,
    capacity: int,
    dim: int,
    device: torch.device,
    policy: Any,
    pinned_rows: np.ndarray | None,
    fmt: RowFormat,
) -> RowCache:
    """A RowCache, given `policy` / `pinned_rows` only when set (RowCache's default policy otherwise)."""
    kwargs = {k: v for k, v in (("policy", policy), ("pinned_rows", pinned_rows)) if v is not None}
    known = inspect.signature(RowCache).parameters
    for k in kwargs:
        if k not in known:
            raise ValueError(
                f"{level}_{k} is set, but this RowCache has one policy (exact LRU); leave it None"
            )
    return RowCache(capacity, dim, device, fmt=fmt, **kwargs)


class LevelTable(EngramTable):
    """A frozen quantised table in three levels: hot rows on the device, warm in host DRAM, the rest below.

    `gather` returns exactly (bitwise) what the stored table's own gather returns. A call whose
    distinct rows exceed a level's budget is still served exactly: rows that do not fit pass through
    that level uncached for this call. Synchronous (no prefetch).

    Args:
        backing: The store below: a `RowFile` (SSD, positional reads), an `MmapFP8Table` /
            `MmapQuantTable` (SSD, memory-mapped) or an `FP8Table` / `QuantTable` on the host, of any
            row format.
        device_rows: Level 1's budget in rows (a `RowCache` on `device`), 1..num_rows.
        host_rows: Level 2's budget in rows (a `RowCache` in DRAM); 0 leaves the host level out (on a
            CPU-only machine level 1 is already in DRAM: a second DRAM level behind it only repeats
            its work).
        device: The compute device (default: the CPU).
        device_policy: Level 1's replacement policy (None: the `RowCache` default).
        host_policy: Level 2's replacement policy (None: the `RowCache` default).
        device_pinned_rows: The rows a pinned policy of level 1 pins (`RowCache(pinned_rows=...)`).
        host_pinned_rows: The rows a pinned policy of level 2 pins.
        verify: Re-read every served row from `backing` and count mismatches
            (`stats()["verify_mismatches"]`); off by default (it reads every row twice).

    Raises:
        TypeError: `backing` is none of those kinds, or a budget is not an int.
        ValueError: A budget is out of range, an in-memory backing is not in host memory, or host
            options are given with `host_rows=0`.

    Examples:
        >>> import torch
        >>> from engram import FP8Table
        >>> from engram.systems import LevelTable
        >>> backing = FP8Table.from_float(torch.randn(1000, 64))
        >>> table = LevelTable(backing, device_rows=4, host_rows=16)
        >>> rows = torch.tensor([[3, 7, 3, 500]])
        >>> torch.equal(table.gather(rows), backing.gather(rows))
        True
        >>> _ = table.gather(rows)  # now 3 distinct rows hit on the device
        >>> table.stats()["device"]["hits"], table.stats()["backing"]["hits"]
        (3, 3)
    """

    def __init__(
        self,
        backing: RowFile | MmapQuantTable | QuantTable,
        *,
        device_rows: int,
        host_rows: int,
        device: torch.device | str | None = None,
        device_policy: Any = None,
        host_policy: Any = None,
        device_pinned_rows: np.ndarray | None = None,
        host_pinned_rows: np.ndarray | None = None,
        verify: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(backing, RowFile | MmapQuantTable | QuantTable):
            raise TypeError(
                f"backing must be a RowFile, an MmapFP8Table or an FP8Table (or an MmapQuantTable / QuantTable of "
                f"another row format), got {type(backing).__name__}; write a row file with `engram convert SRC DST "
                "--row-file` and open it with RowFile(path)"
            )
        if isinstance(backing, QuantTable) and backing.weight.device.type != "cpu":
            raise ValueError(
                f"an {type(backing).__name__} backing must be in host memory, it is on {backing.weight.device}"
            )
        self.__dict__["backing"] = backing  # not a submodule: .to() must not move the backing store
        self.num_rows, self.dim = (
            backing.num_rows if not isinstance(backing, RowFile) else backing.rows,
            backing.dim,
        )
        self.row_format = backing.row_format
        fmt = self.row_format
        self.value_bytes, self.scale_bytes = fmt.value_bytes(self.dim), fmt.scale_bytes(self.dim)
        self.row_bytes = self.value_bytes + self.scale_bytes
        self.device = as_device(device)
        d = _budget("device_rows", device_rows, self.num_rows)
        h = _budget("host_rows", host_rows, self.num_rows, allow_zero=True)
        if not h and (host_policy is not None or host_pinned_rows is not None):
            raise ValueError("host_rows=0 leaves out the host level: drop host_policy / host_pinned_rows")
        self.verify = bool(verify)
        self.l1 = _cache("device", d, self.dim, self.device, device_policy, device_pinned_rows, fmt)
        self.l2 = (
            _cache("host", h, self.dim, torch.device("cpu"), host_policy, host_pinned_rows, fmt)
            if h
            else None
        )
        self.levels = [LevelStats("device", d), LevelStats("host", h), LevelStats("backing", self.num_rows)]
        self.out_pool = OutputPool()  # reused CPU outputs (engram.storage.outpool)
        self.reset_stats()

    def __deepcopy__(self, memo: dict[int, Any]) -> LevelTable:
        """A copy with its own caches and counters; an in-memory or mapped backing table is shared (read
        only), a RowFile is opened again (its read buffer is per instance)."""
        if not isinstance(self.backing, RowFile):
            memo[id(self.backing)] = self.backing
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        """Zero every counter (the cached rows stay)."""
        for lv in self.levels:
            lv.hits = lv.misses = lv.bytes_in = 0
            lv.seconds = 0.0
        self.gathers = self.rows_requested = self.rows_distinct = 0
        self.verify_rows = self.verify_mismatches = 0
        if isinstance(self.backing, RowFile):
            self.backing.reset_stats()

    def stats(self) -> dict[str, Any]:
        """The table's counters.

        Returns:
            gathers, rows requested and distinct, verify counts, and per level (device, host,
                backing) its `LevelStats.as_dict`; for a RowFile its reads and pages too.
        """
        out: dict[str, Any] = {
            "gathers": self.gathers,
            "rows_requested": self.rows_requested,
            "rows_distinct": self.rows_distinct,
            "verify_rows": self.verify_rows,
            "verify_mismatches": self.verify_mismatches,
        }
        for lv in self.levels:
            out[lv.name] = lv.as_dict()
        if isinstance(self.backing, RowFile):
            out["backing"].update(self.backing.stats())
        return out

    # ------------------------------------------------------------------ the backing store
    def _read_backing(self, rows: np.ndarray, v: np.ndarray, s: np.ndarray, *, count: bool = True) -> None:
        """v (M, value bytes) / s (M, scale bytes) uint8 (FP8: (M, dim) / (M, nb)) <- rows (M,) (any order)
        from the backing store."""
        b = self.backing
        if isinstance(b, RowFile):
            b.read_rows(rows, v, s, count=count)
            return
        if isinstance(b, MmapQuantTable):
            b.check_files()  # a truncated file raises here, not as a SIGBUS
        idx = torch.from_numpy(rows)
        lookup.gather_rows(b.weight, idx, torch.from_numpy(v).view(self.row_format.value_dtype))
        lookup.gather_rows(b.scale, idx, torch.from_numpy(s).view(self.row_format.scale_dtype))

    # ------------------------------------------------------------------ gather
    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantised embeddings of rows, through the levels.

        Args:
            rows: Row ids (...) int64/int32 on any device (a device's ids come to the host: a sync).
            dtype: The embeddings' dtype (default float32).

        Returns:
            The embeddings (..., dim) in `dtype` on the table's device.

        Raises:
            TypeError: `rows` is not an int64 or int32 tensor.
            ValueError: A row id is out of range (the message names it and its position).
        """
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor of row ids, got {type(rows).__name__}")
        host = rows if rows.device.type == "cpu" else rows.cpu()  # sync point for device rows
        check_row_ids(host)
        self.gathers += 1
        self.rows_requested += host.numel()
        uniq, inverse_np, bad = cpu_cache.unique_rows(host.reshape(-1).numpy(), self.num_rows)  # (U,), (n,)
        if bad >= 0:
            check_rows(host, self.num_rows)  # raises, naming the first bad id and its position
        u = uniq.shape[0]
        self.rows_distinct += u
        vb, sb = self.value_bytes, self.scale_bytes  # bytes a row (FP8: dim, dim // 32)
        dev, l1, l2 = self.device, self.l1, self.l2
        lv1, lv2, lv3 = self.levels

        p1 = l1.plan(uniq)  # level 1: hits stay on the device
        m1 = p1.miss_idx.shape[0]
        lv1.hits += u - m1
        lv1.misses += m1
        miss1 = uniq[p1.miss_idx]  # (M1,) ascending (a pinned policy: admitted ones first)
        t0 = time.perf_counter()
        v1 = np.empty((m1, vb), dtype=np.uint8)  # level-1 misses' bytes, assembled on the host
        s1 = np.empty((m1, sb), dtype=np.uint8)
        if m1 and l2 is None:  # no host level: level 1's misses come from the backing store (timed in lv1)
            self._read_backing(miss1, v1, s1)
            lv3.hits += m1
            lv3.bytes_in += m1 * self.row_bytes
        elif m1:
            assert l2 is not None
            # a pinned policy may list level 1's misses admitted-first: level 2 plans them sorted
            order = np.argsort(miss1, kind="stable") if (np.diff(miss1) < 0).any() else None
            sorted1 = miss1 if order is None else miss1[order]
            p2 = l2.plan(sorted1)  # level 2: hits from DRAM
            m2 = p2.miss_idx.shape[0]
            lv2.hits += m1 - m2
            lv2.misses += m2
            at_miss = p2.miss_idx if order is None else order[p2.miss_idx]  # their rows in v1 / s1
            at_hit = p2.hit_idx if order is None else order[p2.hit_idx]
            miss2 = sorted1[p2.miss_idx]
            v2 = np.empty((m2, vb), dtype=np.uint8)
            s2 = np.empty((m2, sb), dtype=np.uint8)
            t1 = time.perf_counter()
            self._read_backing(miss2, v2, s2)  # level 3
            lv2.seconds += time.perf_counter() - t1
            lv3.hits += m2
            lv3.bytes_in += m2 * self.row_bytes
            k2 = p2.ins_slots.shape[0]
            if k2:
                l2.write(torch.from_numpy(p2.ins_slots), torch.from_numpy(v2[:k2]), torch.from_numpy(s2[:k2]))
                lv2.bytes_in += k2 * self.row_bytes
            v1[at_miss], s1[at_miss] = v2, s2
            h2 = p2.hit_idx.shape[0]
            if h2:
                hv = torch.empty((h2, vb), dtype=torch.uint8)
                hs = torch.empty((h2, sb), dtype=torch.uint8)
                l2.read(torch.from_numpy(p2.hit_slots), hv, hs)
                v1[at_hit], s1[at_hit] = hv.numpy(), hs.numpy()
        k1 = p1.ins_slots.shape[0]
        miss_v = torch.from_numpy(v1).to(dev)  # the one host -> device copy of the call
        miss_s = torch.from_numpy(s1).to(dev)
        if k1:
            l1.write(torch.from_numpy(p1.ins_slots).to(dev), miss_v[:k1], miss_s[:k1])
            lv1.bytes_in += k1 * self.row_bytes
        lv1.seconds += time.perf_counter() - t0
        inverse = torch.from_numpy(inverse_np).view(host.shape)
        if k1 == m1:  # every distinct row is in level 1 now: dequantise straight from its slots
            slot_u = np.empty(u, dtype=np.int64)
            slot_u[p1.hit_idx] = p1.hit_slots
            slot_u[p1.miss_idx] = p1.ins_slots
            index = torch.from_numpy(slot_u[inverse_np]).view(host.shape).to(dev)  # numpy: no thread pool
            values, scales = l1.values, l1.scales
        else:  # some misses did not fit (budget below this call's distinct rows): a block [misses; hits]
            h1 = p1.hit_idx.shape[0]
            values = torch.empty((u, vb), dtype=torch.uint8, device=dev)
            scales = torch.empty((u, sb), dtype=torch.uint8, device=dev)
            values[:m1], scales[:m1] = miss_v, miss_s
            if h1:
                l1.read(torch.from_numpy(p1.hit_slots).to(dev), values[m1:], scales[m1:])
            pos = np.empty(u, dtype=np.int64)
            pos[p1.miss_idx] = np.arange(m1)
            pos[p1.hit_idx] = np.arange(m1, u)
            index = torch.from_numpy(pos[inverse_np]).view(host.shape).to(dev)
            values, scales = (
                values.view(self.row_format.value_dtype),
                scales.view(self.row_format.scale_dtype),
            )
        if self.verify:
            self._verify(uniq, values, scales, index, inverse)
        dtype = torch.float32 if dtype is None else dtype
        if dtype == torch.float64:  # as QuantTable: float32, then widened
            return lookup.dequantize_gather(values, scales, index, torch.float32).double()
        out = self.out_pool.empty((*index.shape, self.dim), dtype) if dev.type == "cpu" else None
        return lookup.dequantize_gather(values, scales, index, dtype, out)

    def _verify(
        self,
        uniq: np.ndarray,
        values: torch.Tensor,
        scales: torch.Tensor,
        index: torch.Tensor,
        inverse: torch.Tensor,
    ) -> None:
        """Compare the bytes each distinct row is served from with a fresh read of the backing store."""
        u = uniq.shape[0]
        first = torch.full((u,), -1, dtype=torch.int64)
        flat_inv = inverse.reshape(-1)
        first.scatter_(0, flat_inv, torch.arange(flat_inv.numel()))  # some position of each distinct row
        src = index.reshape(-1).cpu()[first]  # the slot / block row each distinct row is read from
        served_v = values.view(torch.uint8).index_select(0, src.to(values.device)).cpu().numpy()
        served_s = scales.view(torch.uint8).index_select(0, src.to(scales.device)).cpu().numpy()
        v = np.empty((u, self.value_bytes), dtype=np.uint8)
        s = np.empty((u, self.scale_bytes), dtype=np.uint8)
        self._read_backing(uniq, v, s, count=False)
        bad = (served_v != v).any(axis=1) | (served_s != s).any(axis=1)
        self.verify_rows += u
        self.verify_mismatches += int(bad.sum())

    def extra_repr(self) -> str:
        return (
            f"num_rows={self.num_rows}, dim={self.dim}, format={self.row_format.value}, device={self.device}, "
            f"device_rows={self.l1.capacity}, "
            f"host_rows={0 if self.l2 is None else self.l2.capacity}, backing={type(self.backing).__name__}, verify={self.verify}"
        )
