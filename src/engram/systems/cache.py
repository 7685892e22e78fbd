"""A hot-row cache of stored table rows on the compute device, under a chosen replacement policy.

`RowCache` holds a row format's raw bytes (FP8 by default; `engram.rowformat.formats.RowFormat`) in
slots on the device and a host-side index row -> slot (a
`engram.systems.policies.Policy`: exact LRU, CLOCK, LFU with aging, pinned, pinned + LRU); `plan`
is the host half of a call, `read` / `write` the device half, and hits, misses, evictions and bytes
fetched are first-class counters. A cached row is bit-for-bit the stored row. Knows slots and bytes, nothing of tiers or staging; holds no locks
(its owner, `TieredTable`, serialises calls). Design: docs/systems.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engram.kernels import cpu_cache
from engram.rowformat.formats import RowFormat, as_row_format
from engram.rowformat.fp8 import BLOCK
from engram.storage import lookup
from engram.systems.policies import LRU, CachePolicy, default_policy, make_policy

__all__ = ["CachePlan", "RowCache"]


class CachePlan(NamedTuple):
    """The host-side outcome of one call of `RowCache.plan` over sorted distinct rows uniq (U,).

    Attributes:
        hit_idx: (H,) int64 positions in uniq of the cached rows.
        hit_slots: (H,) their slots.
        miss_idx: (M,) positions in uniq of the rows to fetch: the I admitted ones first, then the
            others, each run ascending (lru, clock, lfu admit a prefix of the misses, so there it is
            ascending throughout; pinned and pinned+lru may admit any subset).
        ins_slots: (I,) slots given to the first I misses (I <= M).
    """

    hit_idx: np.ndarray  # (H,) int64 positions in uniq of the cached rows
    hit_slots: np.ndarray  # (H,) their slots
    # (M,) positions in uniq of the rows to fetch: the I admitted ones first, then the others, each
    # run ascending (lru, clock, lfu admit a prefix of the misses, so there it is ascending throughout;
    # pinned and pinned+lru may admit any subset)
    miss_idx: np.ndarray
    ins_slots: np.ndarray  # (I,) slots given to the first I misses (I <= M)


class RowCache:
    """A hot-row cache: slots of a row format's bytes on a device, with a host index under a policy.

    Per slot the row's value bytes (`fmt.value_bytes(dim)`) and scale bytes. `plan` is the host half
    of a call (hits, admissions, counters), `read` / `write` the device half. A cached row is
    bit-for-bit the stored row. Holds no locks (its owner, `TieredTable`, serialises calls). Design:
    docs/systems.md.

    Args:
        capacity: Slots (rows), >= 1.
        dim: Row width, a positive multiple of 32.
        device: Where the cached bytes live.
        policy: A `CachePolicy` or its name ('lru', 'clock', 'lfu', 'pinned', 'pinned+lru'); None:
            `default_policy` ('pinned+lru' given `pinned_rows`, else 'lru').
        pinned_rows: For the pinned policies: rows to pin, hottest first (from `Profile.hottest`).
        pinned_fraction: For 'pinned+lru': the share of slots pinned.
        fmt: The row format (FP8 by default).

    Raises:
        ValueError: `capacity` or `dim` is out of range, or the policy's arguments are invalid.

    Examples:
        >>> import numpy as np, torch
        >>> from engram.systems import RowCache
        >>> cache = RowCache(capacity=2, dim=64)  # FP8 rows: 64 value bytes + 2 scale bytes a slot
        >>> plan = cache.plan(np.array([3, 7, 9]))  # nothing cached: 3 misses, the first 2 admitted
        >>> plan.miss_idx.tolist(), plan.ins_slots.tolist()
        ([0, 1, 2], [0, 1])
        >>> fetched = torch.randint(0, 256, (2, 66), dtype=torch.uint8)  # rows 3 and 7, fetched
        >>> values, scales = fetched[:, :64].contiguous(), fetched[:, 64:].contiguous()
        >>> cache.write(torch.from_numpy(plan.ins_slots), values, scales)
        >>> cache.plan(np.array([3])).hit_slots.tolist()
        [0]
        >>> cache.stats()["hits"], cache.stats()["misses"]
        (1, 3)
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        device: torch.device | str = "cpu",
        policy: CachePolicy | str | None = None,
        pinned_rows: np.ndarray | None = None,
        pinned_fraction: float = 0.5,
        fmt: RowFormat | str = RowFormat.FP8,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a RowCache needs capacity >= 1 rows, got {capacity!r} (use no cache for 0)")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim % BLOCK:
            raise ValueError(f"row width dim={dim!r} must be a positive multiple of {BLOCK}")
        self.capacity, self.dim = capacity, dim
        self.row_format = as_row_format(fmt)
        self.value_bytes = self.row_format.value_bytes(dim)  # FP8: dim
        self.scale_bytes = self.row_format.scale_bytes(dim)  # FP8: dim // 32
        self.row_bytes = self.value_bytes + self.scale_bytes
        self.device = torch.device(device)
        self._values = torch.empty((capacity, self.value_bytes), dtype=torch.uint8, device=self.device)
        self._scales = torch.empty((capacity, self.scale_bytes), dtype=torch.uint8, device=self.device)
        policy = default_policy(pinned_rows is not None) if policy is None else policy
        self.policy = make_policy(policy, capacity, pinned_rows, pinned_fraction)
        self._slot_of = np.empty(0, dtype=np.int64)  # (U,) per-call scratch, grown as needed
        self._ins_of = np.empty(0, dtype=np.int64)
        self.reset_stats()

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        """Zero the counters (the cached rows stay)."""
        self.hits = 0  # distinct rows of a call found cached
        self.misses = 0  # distinct rows of a call fetched from the backing tier
        self.evictions = 0  # cached rows replaced by a miss
        self.bytes_fetched = 0  # bytes read from the backing tier (misses * row_bytes)

    def stats(self) -> dict[str, float | str]:
        """The cache's counters.

        Returns:
            hits, misses (distinct rows per call), evictions, bytes_fetched, hit_rate, resident
                (rows cached now), capacity and policy (its name).
        """
        lookups = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_fetched": self.bytes_fetched,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "resident": int((self.policy.slot_rows() >= 0).sum()),
            "capacity": self.capacity,
            "policy": self.policy.name.value,
        }

    def clear(self) -> None:
        """Forget every cached row (the counters stay; pinned rows stay pinned, empty until fetched)."""
        self.policy.clear()

    # ------------------------------------------------------------------ host half
    def plan(self, uniq: np.ndarray) -> CachePlan:
        """The host half of a call: which rows are cached, which misses get a slot; updates the counters.

        The caller then reads the hits (`read`) and writes the admitted misses' bytes into their
        slots (`write`).

        Args:
            uniq: Sorted distinct row ids (U,) int64.

        Returns:
            The plan: hit positions in `uniq` and their slots, the misses' positions (the admitted
                ones first) and the slots given to the admitted misses.

        Raises:
            TypeError: `uniq` is not a 1-D int64 array.
            ValueError: A row id is negative, or `uniq` is not strictly increasing.
        """
        if not isinstance(uniq, np.ndarray) or uniq.dtype != np.int64 or uniq.ndim != 1:
            found = f"{uniq.dtype} {uniq.shape}" if isinstance(uniq, np.ndarray) else type(uniq).__name__
            raise TypeError(f"uniq must be a 1-D int64 array of distinct rows, got {found}")
        n = uniq.shape[0]
        # O(U) checks: a repeated or negative id would corrupt the index (two slots for one row)
        if n and uniq[0] < 0:
            raise ValueError(f"row id {int(uniq[0])} at position 0 is negative; row ids are >= 0")
        unsorted = np.flatnonzero(uniq[1:] <= uniq[:-1])
        if unsorted.shape[0]:
            i = int(unsorted[0]) + 1
            raise ValueError(
                f"uniq must be strictly increasing (sorted distinct rows), but uniq[{i}]={int(uniq[i])} follows "
                f"uniq[{i - 1}]={int(uniq[i - 1])}; pass np.unique(rows)"
            )
        if self._slot_of.shape[0] < n:
            self._slot_of = np.empty(max(n, 2 * self._slot_of.shape[0]), dtype=np.int64)
            self._ins_of = np.empty_like(self._slot_of)
        slot_of, ins_of = self._slot_of[:n], self._ins_of[:n]
        hits, inserted, evictions = self.policy.plan(uniq, slot_of, ins_of)
        hit_idx = np.flatnonzero(slot_of >= 0)
        miss_idx = np.flatnonzero(slot_of < 0)
        admitted = ins_of[miss_idx] >= 0
        if not admitted[:inserted].all():  # a pinned policy admitted a subset: put those first
            miss_idx = np.concatenate([miss_idx[admitted], miss_idx[~admitted]])
        ins_slots = ins_of[miss_idx[:inserted]].copy()
        assert hit_idx.shape[0] == hits and (ins_slots >= 0).all()
        self.hits += int(hits)
        self.misses += int(miss_idx.shape[0])
        self.evictions += int(evictions)
        self.bytes_fetched += int(miss_idx.shape[0]) * self.row_bytes
        return CachePlan(hit_idx, slot_of[hit_idx].copy(), miss_idx, ins_slots)

    def slot_of(self, rows: np.ndarray) -> np.ndarray:
        """The slot holding each row: a read-only query, no counters or recency change.

        Args:
            rows: Row ids, any shape.

        Returns:
            The slot of each row, -1 where it is not cached.
        """
        rows = np.asarray(rows, dtype=np.int64)
        slot_row = self.policy.slot_rows()  # (C,) row per slot, -1 when empty
        order = np.argsort(slot_row, kind="stable")
        keys = slot_row[order]  # sorted
        pos = np.minimum(np.searchsorted(keys, rows), self.capacity - 1)
        return np.where((keys[pos] == rows) & (rows >= 0), order[pos], -1)

    def resident_rows(self) -> np.ndarray:
        """The rows cached now.

        Returns:
            Their sorted ids.
        """
        rows = self.policy.slot_rows()
        return np.sort(rows[rows >= 0])

    def lru_order(self) -> np.ndarray:
        """The cached rows from the least to the most recently used (for tests and inspection).

        Returns:
            Their ids, in that order.

        Raises:
            ValueError: The cache's policy is not 'lru'.
        """
        if not isinstance(self.policy, LRU):
            raise ValueError(
                f"lru_order is the order of an 'lru' cache; this one runs {self.policy.name.value!r}"
            )
        return self.policy.lru_order()

    # ------------------------------------------------------------------ device half
    @property
    def values(self) -> torch.Tensor:
        """The cached values in the format's dtype (FP8: (C, dim) float8_e4m3fn); empty slots hold garbage."""
        return self._values.view(self.row_format.value_dtype)

    @property
    def scales(self) -> torch.Tensor:
        """The cached scales in the format's dtype (FP8: (C, dim // 32) float8_e8m0fnu)."""
        return self._scales.view(self.row_format.scale_dtype)

    def read(self, slots: torch.Tensor, out_values: torch.Tensor, out_scales: torch.Tensor) -> None:
        """Copy cached rows out of their slots.

        On the CPU through `lookup.gather_rows`' numba byte copy (GIL released, slots checked), else
        index_select (which checks them on the device).

        Args:
            slots: (H,) int64 slots (e.g. a plan's `hit_slots`).
            out_values: (H, value_bytes) uint8 (FP8: (H, dim)), written.
            out_scales: (H, scale_bytes) uint8 (FP8: (H, dim // 32)), written.

        Raises:
            TypeError: `slots` is not a 1-D int64 tensor.
            ValueError: An output has the wrong dtype, shape or device.
        """
        self._check_rows_args("read", slots, out_values, out_scales)
        if self.device.type == "cpu":
            lookup.gather_rows(self._values, slots, out_values)
            lookup.gather_rows(self._scales, slots, out_scales)
        else:
            torch.index_select(self._values, 0, slots, out=out_values)
            torch.index_select(self._scales, 0, slots, out=out_scales)

    def write(self, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Store rows' bytes into slots (a plan's `ins_slots`).

        Args:
            slots: (I,) int64 slots.
            values: (I, value_bytes) uint8.
            scales: (I, scale_bytes) uint8.

        Raises:
            TypeError: `slots` is not a 1-D int64 tensor.
            ValueError: A tensor has the wrong dtype, shape or device, or a slot is out of range.
        """
        self._check_rows_args("write", slots, values, scales)
        if self.device.type == "cpu":  # numba, GIL released (index_copy_ on byte rows is ~10x slower)
            s = slots.numpy()
            if s.shape[0] and (s.min() < 0 or s.max() >= self.capacity):  # the numba scatter is unchecked
                i = int(np.flatnonzero((s < 0) | (s >= self.capacity))[0])
                raise ValueError(
                    f"slot {int(s[i])} at position {i} is outside this cache's slots [0, {self.capacity}); "
                    "write the slots RowCache.plan gave (ins_slots)"
                )
            cpu_cache.scatter_rows(self._values.numpy(), s, values.numpy())
            cpu_cache.scatter_rows(self._scales.numpy(), s, scales.numpy())
        else:
            self._values.index_copy_(0, slots, values)
            self._scales.index_copy_(0, slots, scales)

    def _check_rows_args(
        self, op: str, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
    ) -> None:
        """Shapes, dtypes and devices only (no device sync): slots (I,) int64, values (I, value_bytes), scales
        (I, scale_bytes)."""
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            found = f"{slots.dtype} {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots)
            raise TypeError(f"{op}: slots must be a 1-D int64 tensor, got {found}")
        i = slots.shape[0]
        for name, t, width in (("values", values, self.value_bytes), ("scales", scales, self.scale_bytes)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != (i, width):
                found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{op}: {name} must be uint8 ({i}, {width}) for {i} slots of a dim={self.dim} "
                    f"{self.row_format.value} cache, got {found}"
                )
        for name, t in (("slots", slots), ("values", values), ("scales", scales)):
            if t.device != self._values.device:
                raise ValueError(f"{op}: {name} are on {t.device} but the cache is on {self._values.device}")

    def to(self, device: torch.device | str) -> RowCache:
        """Move the cached bytes to a device (the index stays on the host).

        Args:
            device: The new device.

        Returns:
            This cache.
        """
        self.device = torch.device(device)
        self._values = self._values.to(self.device)
        self._scales = self._scales.to(self.device)
        return self

    def __repr__(self) -> str:
        return (
            f"RowCache(capacity={self.capacity}, dim={self.dim}, format={self.row_format.value}, device={self.device}, "
            f"policy={self.policy.name.value!r}, "
            f"hits={self.hits}, misses={self.misses}, evictions={self.evictions})"
        )
