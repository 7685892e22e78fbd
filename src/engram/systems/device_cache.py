"""A hot-row cache whose index lives on the compute device: set-associative, LRU within a set.

`DeviceRowCache` holds FP8 row bytes in `sets * ways` slots and, beside them, the index: `tags`
(which row each slot holds) and `stamps` (the call that last used it), all device tensors. A row may
only live in the `ways` slots of its set (a hash of the row id), so a lookup compares `ways` tags per
row and a call's `plan` (lookup, LRU admission of its distinct misses, where each position's bytes
will be) never passes over the capacity: the lookup is one Triton kernel on CUDA with no host sync
(`engram.kernels.cache_lookup`; its torch twin on a CPU), one sync reads the number of missing
positions, and the admission (a sort) runs over those alone, so a call that hits everywhere costs the
lookup and the gather. FBGEMM's LXU cache is the same idea. Misses a set cannot take (more distinct
misses than unprotected ways) go to a scratch region after the slots, so every row of a call has a
place and a gather is one `fp8_gather` over the storage. Counters are device tensors (`stats()`
syncs). Knows bytes and slots, nothing of tiers or streams. Design and the sync points:
docs/systems.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engram import kernels
from engram.kernels import reference
from engram.kernels.reference import set_of
from engram.rowformat.fp8 import BLOCK, SCALE_DTYPE, VALUE_DTYPE, fp8_row_bytes
from engram.systems.placement import check_device_memory

__all__ = ["DEFAULT_WAYS", "DevicePlan", "DeviceRowCache", "set_of"]

DEFAULT_WAYS = 16  # slots a row may live in: 16 tags (128 B) compared per lookup
_NEVER = -1  # stamp of an empty slot: older than every call (calls are stamped 1, 2, ...)
_PROTECTED = torch.iinfo(torch.int64).max  # sort key of a slot a call may not take


class DevicePlan(NamedTuple):
    """One call's plan, on the device: where each position's bytes are once the fills are done."""

    final: torch.Tensor  # (n,) int64 storage row of each position (a slot, or a scratch row)
    fill_src: torch.Tensor  # (n,) int64 table row to read where fill_dst >= 0
    fill_dst: torch.Tensor  # (n,) int64 storage row to fill, -1 elsewhere (one position per distinct miss)
    region: int  # scratch region of the call's unplaced misses
    generation: int  # that region's generation when planned: a later plan of the region bumps it
    stamp: int  # the call's number (its hits and admissions carry it)


class DeviceRowCache:
    """A hot-row cache of FP8 rows whose index lives on the device: set-associative, LRU within a set.

    A row may only live in the `ways` slots of its set (a hash of the row id), so a lookup compares
    `ways` tags per row, with no host sync on CUDA; misses a set cannot take go to a scratch region.
    Counters are device tensors (`stats()` syncs). Memory: slots * (row bytes + 16) plus
    regions * (largest call) * row bytes. Design and the sync points: docs/systems.md.

    Args:
        capacity: Rows, rounded up to whole sets of `ways`.
        dim: Row width, a positive multiple of 32.
        num_rows: Rows of the table it caches.
        device: Where the slots and the index live.
        ways: Slots a row may live in (tags compared per lookup).
        regions: Scratch regions for unplaced misses (>= 2: region 0 for calls consumed at once,
            the others taken in turn by calls consumed later, e.g. prefetches); each holds as many
            rows as the largest call so far.

    Raises:
        ValueError: An argument is out of range, or the memory is more than the device has free
            (naming the numbers).

    Examples:
        >>> import torch
        >>> from engram import FP8Table
        >>> from engram.systems import DeviceRowCache
        >>> table = FP8Table.from_float(torch.randn(1000, 64))
        >>> cache = DeviceRowCache(capacity=32, dim=64, num_rows=1000, device="cpu")
        >>> rows = torch.tensor([5, 9, 5])
        >>> plan = cache.plan(rows)  # 2 distinct misses, admitted
        >>> cache.fill(plan, table.weight, table.scale)
        >>> torch.equal(cache.values[plan.final].view(torch.uint8), table.weight[rows].view(torch.uint8))
        True
        >>> cache.plan(rows).fill_dst.numel(), cache.stats()["hits"]  # the second call hits everywhere
        (0, 2)
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        num_rows: int,
        device: torch.device | str,
        *,
        ways: int = DEFAULT_WAYS,
        regions: int = 3,
    ) -> None:
        for name, v, lo in (("capacity", capacity, 1), ("num_rows", num_rows, 1), ("ways", ways, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"a DeviceRowCache needs {name} >= {lo}, got {v!r}")
        if isinstance(regions, bool) or not isinstance(regions, int) or regions < 2:
            raise ValueError(
                f"regions={regions!r} must be an int >= 2 (one for direct calls, one or more ahead)"
            )
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim % BLOCK:
            raise ValueError(f"row width dim={dim!r} must be a positive multiple of {BLOCK}")
        self.dim, self.num_rows, self.ways, self.regions = dim, num_rows, ways, regions
        self.sets = -(-capacity // ways)
        self.capacity = self.sets * ways
        if self.sets * num_rows >= 2**62:  # the (set, row) sort key must fit an int64
            raise ValueError(
                f"{self.sets} sets x {num_rows} rows overflow the sort key; use fewer cache rows or more ways"
            )
        self.row_bytes = fp8_row_bytes(dim)
        self.device = torch.device(device)
        check_device_memory(
            self.index_bytes(self.capacity, dim),
            self.device,
            f"a device row cache of {self.capacity:,} rows x {self.row_bytes} bytes (+16 bytes of index a row)",
            "use fewer cache_rows (or free device memory first)",
        )
        c = self.capacity
        nb = dim // BLOCK
        # slot c is a trash slot: scatters of positions that write nothing go there
        self.tags = torch.full((c + 1,), -1, dtype=torch.int64, device=self.device)  # row held, -1 empty
        self.stamps = torch.full((c + 1,), _NEVER, dtype=torch.int64, device=self.device)  # last call
        self._values = torch.empty((c, dim), dtype=torch.uint8, device=self.device)  # (C + R*X, dim)
        self._scales = torch.empty((c, nb), dtype=torch.uint8, device=self.device)
        self._way = torch.arange(ways, device=self.device)  # (W,)
        self.scratch_rows = 0  # X: rows of each scratch region
        self.generations = [0] * regions
        self._next_region = 1
        self._stamp = 0
        self.reset_stats()

    @staticmethod
    def index_bytes(capacity: int, dim: int) -> int:
        """Device bytes of a cache's slots: the rows and their 16 bytes of index (tag, stamp).

        Args:
            capacity: Slots.
            dim: Row width.

        Returns:
            capacity * (FP8 row bytes + 16); scratch regions come on top.
        """
        return capacity * (fp8_row_bytes(dim) + 16)

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        """Zero the counters (device tensors; the cached rows stay)."""
        z = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._counts = z  # hits, misses, evictions, spilled: distinct rows per call, summed

    def stats(self) -> dict[str, float | str]:
        """The cache's counters: a sync point (they live on the device).

        Returns:
            hits, misses (distinct rows per call), evictions, spilled (misses no slot took),
                bytes_fetched, hit_rate, resident rows, capacity, ways and policy.
        """
        hits, misses, evictions, spilled = (int(x) for x in self._counts.tolist())
        lookups = hits + misses
        return {
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "spilled": spilled,
            "bytes_fetched": misses * self.row_bytes,
            "hit_rate": hits / lookups if lookups else 0.0,
            "resident": int((self.tags[: self.capacity] >= 0).sum()),
            "capacity": self.capacity,
            "ways": self.ways,
            "policy": "set-lru (device index)",
        }

    # ------------------------------------------------------------------ storage
    @property
    def values(self) -> torch.Tensor:
        """(C + R*X, dim) float8_e4m3fn: the slots, then the scratch regions."""
        return self._values.view(VALUE_DTYPE)

    @property
    def scales(self) -> torch.Tensor:
        """(C + R*X, dim // 32) float8_e8m0fnu, as `values`."""
        return self._scales.view(SCALE_DTYPE)

    def take_region(self) -> int:
        """The next scratch region for a call consumed later.

        Returns:
            A region, 1..regions-1 in turn.
        """
        r = self._next_region
        self._next_region = r % (self.regions - 1) + 1
        return r

    def reserve(self, region: int, n: int) -> int:
        """Claim a scratch region for a call, growing the regions if needed.

        Args:
            region: The region, 0..regions-1.
            n: The call's rows.

        Returns:
            The region's new generation, which invalidates every earlier plan of that region.

        Raises:
            ValueError: No such region, or growing the regions needs more than the device has free.
        """
        if not 0 <= region < self.regions:
            raise ValueError(f"region={region} is not one of this cache's regions 0..{self.regions - 1}")
        self._ensure_scratch(n)
        self.generations[region] += 1
        return self.generations[region]

    def valid(self, plan: DevicePlan) -> bool:
        """Whether a plan's scratch region still holds its rows (no later plan of that region, no regrowth).

        Its slots are the caller's to protect (`plan`'s `protect_from`).

        Args:
            plan: A plan of this cache.

        Returns:
            True while the plan can be read.
        """
        return self.generations[plan.region] == plan.generation

    def _ensure_scratch(self, n: int) -> None:
        """Grow every scratch region to `n` rows (copying the slots; outstanding plans become invalid)."""
        if n <= self.scratch_rows:
            return
        x = max(n, self.scratch_rows * 3 // 2)
        c = self.capacity
        grow = self.regions * (x - self.scratch_rows) * self.row_bytes
        check_device_memory(
            grow,
            self.device,
            f"the row cache's {self.regions} scratch regions for calls of {n:,} rows",
            "gather fewer rows a call, or use fewer cache_rows",
        )
        for name in ("_values", "_scales"):
            old = getattr(self, name)
            new = torch.empty((c + self.regions * x, old.shape[1]), dtype=torch.uint8, device=self.device)
            new[:c].copy_(old[:c])
            if old.is_cuda:  # the copy runs on this stream: the allocator must not hand `old` out before
                old.record_stream(torch.cuda.current_stream(self.device))
            setattr(self, name, new)
        self.scratch_rows = x
        self.generations = [g + 1 for g in self.generations]

    def clear(self) -> None:
        """Forget every cached row (counters stay; outstanding plans become invalid)."""
        self.tags.fill_(-1)
        self.stamps.fill_(_NEVER)
        self.generations = [g + 1 for g in self.generations]

    def to(self, device: torch.device | str) -> DeviceRowCache:
        """Move slots, index and counters to a device; outstanding plans become invalid.

        Args:
            device: The new device.

        Returns:
            This cache.
        """
        self.device = torch.device(device)
        for name in ("tags", "stamps", "_values", "_scales", "_way", "_counts"):
            setattr(self, name, getattr(self, name).to(self.device))
        self.generations = [g + 1 for g in self.generations]
        return self

    # ------------------------------------------------------------------ the plan of a call
    def plan(self, rows: torch.Tensor, *, region: int = 0, protect_from: int | None = None) -> DevicePlan:
        """Look up rows, admit the distinct misses and place every position.

        The lookup (compare the `ways` tags of each row's set, touch the hits) has no host sync; then ONE
        sync reads how many positions missed (M: data), and the admission runs over those M alone, so a
        call that hits everywhere costs the lookup and nothing more. Each set takes its distinct misses in
        ascending row order into its least recently used ways, never a way stamped at or after
        `protect_from`, so no call evicts a row it uses, nor one a pending plan relies on. Misses beyond
        a set's free ways take rows of the scratch region. The caller fills `fill_dst` from the table
        (`fill`, or staged bytes through `write`) before reading `final`.

        Args:
            rows: (n,) int64 on the device, already checked to be in [0, num_rows).
            region: The scratch region `reserve` claimed for this call (calls made without `reserve`
                use its rows as they are: only for a caller that consumes each plan before the next).
            protect_from: Ways stamped at or after this call number are not evicted (None: this call).

        Returns:
            The plan: each position's storage row (`final`), the fills (`fill_src`, `fill_dst`), the
                region, its generation and the call's stamp.
        """
        n = rows.numel()
        self._ensure_scratch(n)
        self._stamp += 1
        t = self._stamp
        floor = t if protect_from is None else min(protect_from, t)
        rows = rows.reshape(-1).long()
        # the lookup: one Triton kernel on CUDA (hits touched, counts[0] += distinct hits), else its twin
        lookup = kernels.cache_lookup if kernels.use_triton(rows, self.tags) else reference.cache_lookup
        slot = lookup(rows, self.tags, self.stamps, self._counts, self.sets, self.ways, t)  # (n,) -1: miss
        miss_pos = (slot < 0).nonzero().squeeze(1)  # sync point: M, the call's one
        if miss_pos.numel() == 0:  # every row cached: no admission, nothing to fill
            none = rows[:0]
            return DevicePlan(slot, none, none, region, self.generations[region], t)
        missed = rows[miss_pos]
        fill_src, fill_dst, placed, counts = self._admit(missed, set_of(missed, self.sets), t, floor, region)
        self._counts[1:] += counts
        final = slot.index_copy(0, miss_pos, placed)
        return DevicePlan(final, fill_src, fill_dst, region, self.generations[region], t)

    def _admit(
        self, rows: torch.Tensor, sets: torch.Tensor, t: int, floor: int, region: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Admission of the missing positions rows (M,) of sets (M,): (fill_src (M,), fill_dst (M,), each
        position's storage row (M,), counts [misses, evictions, spilled]); no sync."""
        m, w, c = rows.numel(), self.ways, self.capacity
        # sorted by (set, row): distinct rows are runs, sets are runs of runs
        key, perm = torch.sort(sets * self.num_rows + rows)  # (M,)
        s_rows, s_set = rows[perm], sets[perm]
        lead = torch.ones(m, dtype=torch.bool, device=rows.device)
        first = lead.clone()
        lead[1:] = key[1:] != key[:-1]  # first position of a distinct row
        first[1:] = s_set[1:] != s_set[:-1]  # first position of a set
        cum = torch.cumsum(lead, 0)
        set_start = torch.cummax(torch.where(first, cum - lead.long(), 0), 0).values
        rank = cum - 1 - set_start  # each distinct miss's rank among its set's misses
        s_base = s_set * w
        st = self.stamps[s_base[:, None] + self._way]  # (M, W) after the hits' touch
        free = st < floor
        # ways by least recent use (then lowest way); protected ones last
        order = torch.argsort(torch.where(free, st, _PROTECTED), dim=1, stable=True)
        admit = lead & (rank < free.sum(1))
        new_slot = s_base + order.gather(1, rank.clamp(0, w - 1)[:, None]).squeeze(1)
        dst = torch.where(admit, new_slot, c)
        evicted = admit & (self.tags[dst] >= 0)
        self.tags[dst] = s_rows
        self.stamps[dst] = t
        spill = lead & ~admit
        scratch = c + region * self.scratch_rows + torch.cumsum(spill, 0) - 1
        fill_dst = torch.where(admit, new_slot, torch.where(spill, scratch, -1))  # (M,) one per distinct row
        ar = torch.arange(m, device=rows.device)
        run = torch.cummax(torch.where(lead, ar, 0), 0).values  # each position's distinct-row run start
        placed = torch.empty_like(fill_dst).scatter_(0, perm, fill_dst[run])
        return s_rows, fill_dst, placed, torch.stack([lead.sum(), evicted.sum(), spill.sum()])

    # ------------------------------------------------------------------ fills
    def fill(self, plan: DevicePlan, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Copy the plan's missing rows from the table into their storage rows (no sync on CUDA).

        Args:
            plan: A plan of this cache.
            values: The table's values (N, dim): on this device, or (CUDA) a UVA view of it in pinned
                host memory, read in place by the Triton row copy; on a CPU, the host table itself.
            scales: The table's scales (N, dim // 32), as `values`.
        """
        copy = kernels.copy_rows if kernels.use_triton(self._values, values) else reference.copy_rows
        copy(values.view(torch.uint8), plan.fill_src, self._values, plan.fill_dst)
        copy(scales.view(torch.uint8), plan.fill_src, self._scales, plan.fill_dst)

    def missing(self, plan: DevicePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The fills a plan needs, on the host (the staged path's copy back of its M missing positions).

        Args:
            plan: A plan of this cache (already synced on M: 16 bytes a position come back).

        Returns:
            The pair (table rows (D,), storage rows (D,)), int64 on the host.
        """
        pairs = torch.stack([plan.fill_src, plan.fill_dst]).cpu()  # (2, M)
        keep = pairs[1] >= 0
        return pairs[0][keep], pairs[1][keep]

    def write(self, dst: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Store rows' bytes into storage rows (staged fills).

        Args:
            dst: (M,) int64 storage rows (from `missing`).
            values: (M, dim) uint8 on the device.
            scales: (M, dim // 32) uint8 on the device.
        """
        self._values.index_copy_(0, dst, values)
        self._scales.index_copy_(0, dst, scales)

    def __repr__(self) -> str:
        return (
            f"DeviceRowCache(capacity={self.capacity}, ways={self.ways}, dim={self.dim}, device={self.device}, "
            f"scratch_rows={self.scratch_rows} x {self.regions})"
        )
