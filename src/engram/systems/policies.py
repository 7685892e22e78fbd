"""Which rows a hot-row cache keeps: the replacement policies behind `RowCache`, one interface.

A `Policy` is the host-side index of a cache of `capacity` slots. `plan(uniq, slot_of, ins_of)` takes
one call's sorted distinct row ids and writes, per row, the slot of a hit (else -1) and the slot a
miss was admitted to (else -1); it returns (hits, inserted, evictions). Every policy follows the
same rules: a row repeated within a call is one lookup; misses are admitted in ascending row order;
a call never evicts a row it uses itself. The policies:

- `lru`: exact least-recently-used (`engram.kernels.cpu_cache`, today's RowCache, bit for bit).
- `clock`: CLOCK, one reference bit per slot, set on use, cleared as the hand passes.
- `lfu`: least-frequently-used with aging: a row's count is the calls that used it since it was
  admitted; every time the cache has served `capacity` distinct-row lookups all counts halve.
- `pinned`: the hottest rows of a profile (`engram profile`) own one slot each, never evicted
  (filled on their first miss); misses of any other row are not cached.
- `pinned+lru`: a `pinned_fraction` of the slots pinned as above, LRU over the rest.

Belady's offline optimum (`belady_hits`) needs the whole trace and lives beside them for the
simulator. Knows row ids and slots, nothing of bytes or devices. Design: docs/systems.md.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import numpy as np

from engram.kernels import cache_policies, cpu_cache

__all__ = [
    "BELADY",
    "DEFAULT_PINNED_POLICY",
    "DEFAULT_POLICY",
    "SIM_POLICIES",
    "CachePolicy",
    "Policy",
    "belady_hits",
    "default_policy",
    "distinct_counts",
    "make_policy",
    "policy_name",
    "sorted_distinct",
]


class CachePolicy(enum.StrEnum):
    """The online replacement policies a `RowCache` can run.

    Attributes:
        LRU: Exact least-recently-used.
        CLOCK: CLOCK: one reference bit per slot, set on use, cleared as the hand passes.
        LFU: Least-frequently-used with aging: a row's count is the calls that used it since it was
            admitted; every time the cache has served `capacity` distinct-row lookups all counts halve.
        PINNED: The hottest rows of a profile (`engram profile`) own one slot each, never evicted
            (filled on their first miss); misses of any other row are not cached.
        PINNED_LRU: A `pinned_fraction` of the slots pinned as PINNED, LRU over the rest.
    """

    LRU = "lru"
    CLOCK = "clock"
    LFU = "lfu"
    PINNED = "pinned"
    PINNED_LRU = "pinned+lru"


BELADY = "belady"  # the offline optimum: the simulator's bound, not a policy a cache can run
SIM_POLICIES = (*(p.value for p in CachePolicy), BELADY)  # what `engram cache-sim` reports
# The defaults are the best online policies measured on the King James Bible's held-out books (V4.1
# preset, real tokenizer, batches of 4096 tokens, profile of the training books; `engram cache-sim`,
# numbers in notes/README-policies.md). With a profile, pinned+lru: first or within 1.1 points of the
# best online policy at every size: 15.0 / 25.6 / 38.0 / 50.3 % at 64Ki / 256Ki / 1Mi / 4Mi rows
# (Belady 24.2 / 32.3 / 41.9 / 51.4 %), against lru's 10.3 / 18.7 / 32.6 / 47.6 % (caches warm from
# the profile); with caches that start empty 12.9 / - / 22.4 / 22.7 % against lru's 9.5 / 16.4 /
# 22.6 / 22.7 % (Belady 21.8 / - / 22.7 / 22.7 %). pinned alone wins at 64Ki-1Mi when warm but falls
# under lru when cold (19.7 against 22.6 % at 1Mi). Without a profile the best measured is lfu: equal
# to lru at 64Ki and 4Mi, ahead at 256Ki (19.5 against 18.7 % warm, 17.2 against 16.4 % cold) and by
# 0.03 points at 1Mi; clock is never ahead of lru. But lfu's index (a heap) costs 3.3x lru's per row
# (3.7 against 12.1 M distinct rows/s at a 100 % hit rate, 0.7 against 2.2 with misses, 1Mi slots,
# 100K rows a call; pinned+lru 10.1 / 2.4), more than its <= 0.8 points save on a gather that the
# index would then dominate: the default without a profile stays lru (the cache of before).
DEFAULT_POLICY = CachePolicy.LRU  # without a profile
DEFAULT_PINNED_POLICY = CachePolicy.PINNED_LRU  # with a profile's hottest rows


def default_policy(has_profile: bool) -> CachePolicy:
    """The policy a cache runs when none is named: DEFAULT_PINNED_POLICY given a profile, else DEFAULT_POLICY."""
    return DEFAULT_PINNED_POLICY if has_profile else DEFAULT_POLICY


def policy_name(name: str | CachePolicy) -> CachePolicy:
    """The `CachePolicy` called `name`; a ValueError naming the known ones otherwise."""
    try:
        return CachePolicy(name)
    except ValueError:
        known = ", ".join(p.value for p in CachePolicy)
        raise ValueError(f"unknown cache policy {name!r}; known policies: {known}") from None


class Policy(ABC):
    """The index of a cache of `capacity` slots under one replacement policy (see the module doc)."""

    name: CachePolicy

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a cache policy needs capacity >= 1 slots, got {capacity!r}")
        self.capacity = capacity
        self.calls = 0

    @abstractmethod
    def plan(self, uniq: np.ndarray, slot_of: np.ndarray, ins_of: np.ndarray) -> tuple[int, int, int]:
        """Look up and admit sorted distinct rows uniq (U,) int64; fill slot_of / ins_of (U,) int64
        (hit slot or -1, admitted slot or -1); return (hits, inserted, evictions)."""

    @abstractmethod
    def slot_rows(self) -> np.ndarray:
        """(capacity,) int64: the row each slot holds, -1 when empty (a copy)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every cached row (pinned rows stay pinned, and empty until fetched again)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity})"


class LRU(Policy):
    name = CachePolicy.LRU

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clear()

    def clear(self) -> None:
        self.state = cpu_cache.new_state(self.capacity)  # keys, vals, slot_row, prev, nxt, ends

    def plan(self, uniq: np.ndarray, slot_of: np.ndarray, ins_of: np.ndarray) -> tuple[int, int, int]:
        self.calls += 1
        h, i, e = cpu_cache.plan(uniq, *self.state, slot_of, ins_of)
        return int(h), int(i), int(e)

    def slot_rows(self) -> np.ndarray:
        return self.state[2].copy()

    def lru_order(self) -> np.ndarray:
        """Cached row ids from the least to the most recently used."""
        _, _, slot_row, prev, _, ends = self.state
        out, s = [], ends[1]
        while s >= 0:
            if slot_row[s] >= 0:
                out.append(int(slot_row[s]))
            s = prev[s]
        return np.array(out, dtype=np.int64)


class Clock(Policy):
    name = CachePolicy.CLOCK

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clear()

    def clear(self) -> None:
        self.keys, self.vals = cache_policies.new_map(self.capacity)
        self.slot_row = np.full(self.capacity, cache_policies.EMPTY, dtype=np.int64)
        self.ref = np.zeros(self.capacity, dtype=np.uint8)
        self.stamp = np.full(self.capacity, -1, dtype=np.int64)  # the last call that used the slot
        self.hand = np.zeros(1, dtype=np.int64)

    def plan(self, uniq: np.ndarray, slot_of: np.ndarray, ins_of: np.ndarray) -> tuple[int, int, int]:
        self.calls += 1
        h, i, e = cache_policies.clock_plan(
            uniq,
            self.keys,
            self.vals,
            self.slot_row,
            self.ref,
            self.stamp,
            self.hand,
            self.calls,
            slot_of,
            ins_of,
        )
        return int(h), int(i), int(e)

    def slot_rows(self) -> np.ndarray:
        return self.slot_row.copy()


class LFU(Policy):
    name = CachePolicy.LFU

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clear()

    def clear(self) -> None:
        c = self.capacity
        self.keys, self.vals = cache_policies.new_map(c)
        self.slot_row = np.full(c, cache_policies.EMPTY, dtype=np.int64)
        self.count = np.zeros(c, dtype=np.int64)
        self.stamp = np.full(c, -1, dtype=np.int64)
        self.heap = np.zeros(c, dtype=np.int64)
        self.pos = np.zeros(c, dtype=np.int64)
        self.meta = np.zeros(2, dtype=np.int64)  # slots in use, lookups since the last halving

    def plan(self, uniq: np.ndarray, slot_of: np.ndarray, ins_of: np.ndarray) -> tuple[int, int, int]:
        self.calls += 1
        h, i, e = cache_policies.lfu_plan(
            uniq, self.keys, self.vals, self.slot_row, self.count, self.stamp, self.heap, self.pos,
            self.meta, self.calls, slot_of, ins_of,
        )  # fmt: skip
        return int(h), int(i), int(e)

    def slot_rows(self) -> np.ndarray:
        return self.slot_row.copy()


class Pinned(Policy):
    """`pinned` (pinned_fraction 1) and `pinned+lru`: the first P slots belong to the P hottest rows
    (slot i to the i-th hottest), the other capacity - P run LRU over every other row."""

    def __init__(self, capacity: int, hottest: np.ndarray, pinned_fraction: float, name: CachePolicy) -> None:
        super().__init__(capacity)
        self.name = name
        hottest = check_rows(hottest, "the pinned rows (a profile's hottest rows)")
        p = min(
            hottest.shape[0], capacity if name is CachePolicy.PINNED else round(capacity * pinned_fraction)
        )
        order = np.argsort(hottest[:p], kind="stable")
        self.by_slot = hottest[:p].copy()  # (P,) row of each pinned slot
        self.sorted_rows = self.by_slot[order]  # (P,) ascending, for searchsorted
        self.sorted_slots = order.astype(np.int64)  # (P,) their slots
        self.lru = LRU(capacity - p) if name is CachePolicy.PINNED_LRU and capacity > p else None
        self.clear()

    @property
    def pinned(self) -> int:
        return int(self.by_slot.shape[0])

    def clear(self) -> None:
        self.loaded = np.zeros(self.pinned, dtype=bool)
        if self.lru is not None:
            self.lru.clear()

    def plan(self, uniq: np.ndarray, slot_of: np.ndarray, ins_of: np.ndarray) -> tuple[int, int, int]:
        self.calls += 1
        p = self.pinned
        at = np.minimum(np.searchsorted(self.sorted_rows, uniq), max(p - 1, 0))
        inset = (self.sorted_rows[at] == uniq) if p else np.zeros(uniq.shape[0], dtype=bool)
        slot = self.sorted_slots[at] if p else np.zeros(uniq.shape[0], dtype=np.int64)
        was = np.zeros(uniq.shape[0], dtype=bool)
        was[inset] = self.loaded[slot[inset]]
        slot_of[:] = np.where(was, slot, -1)
        ins_of[:] = np.where(inset & ~was, slot, -1)
        self.loaded[slot[inset]] = True
        hits, inserted, evictions = int(was.sum()), int((inset & ~was).sum()), 0
        if self.lru is not None:
            rest = np.flatnonzero(~inset)
            if rest.shape[0]:
                s_of = np.empty(rest.shape[0], dtype=np.int64)
                i_of = np.empty(rest.shape[0], dtype=np.int64)
                h, i, e = self.lru.plan(np.ascontiguousarray(uniq[rest]), s_of, i_of)
                slot_of[rest] = np.where(s_of >= 0, s_of + p, -1)
                ins_of[rest] = np.where(i_of >= 0, i_of + p, -1)
                hits, inserted, evictions = hits + h, inserted + i, evictions + e
        return hits, inserted, evictions

    def slot_rows(self) -> np.ndarray:
        out = np.full(self.capacity, cache_policies.EMPTY, dtype=np.int64)
        out[: self.pinned] = np.where(self.loaded, self.by_slot, cache_policies.EMPTY)
        if self.lru is not None:
            out[self.pinned :] = self.lru.slot_rows()
        return out


def sorted_distinct(a: np.ndarray) -> np.ndarray:
    """np.unique(a.ravel()) as int64, by one sort: numpy 2.4's hash-based np.unique is ~20x slower on
    millions of row ids."""
    return distinct_counts(a)[0]


def distinct_counts(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values of a as int64, how often each occurs), by one sort."""
    s = np.sort(a, axis=None).astype(np.int64, copy=False)
    first = np.empty(s.shape[0], dtype=bool)
    first[:1] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return s[starts], np.diff(np.append(starts, s.shape[0])).astype(np.int64)


def check_rows(rows: object, what: str) -> np.ndarray:
    """rows as a 1-D int64 array of distinct ids >= 0; a ValueError / TypeError naming the problem."""
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        found = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
        raise TypeError(f"{what} must be a 1-D integer array of row ids, got {found}")
    rows = rows.astype(np.int64, copy=False)
    if rows.shape[0] and rows.min() < 0:
        i = int(np.flatnonzero(rows < 0)[0])
        raise ValueError(f"{what}: row id {int(rows[i])} at position {i} is negative; row ids are >= 0")
    if sorted_distinct(rows).shape[0] != rows.shape[0]:
        raise ValueError(f"{what} repeat a row id; give each row once (hottest first)")
    return rows


def make_policy(
    name: str | CachePolicy,
    capacity: int,
    pinned_rows: np.ndarray | None = None,
    pinned_fraction: float = 0.5,
) -> Policy:
    """A fresh, empty `Policy` called `name` over `capacity` slots.

    `pinned_rows`: the rows to pin, hottest first (`Profile.hottest`), for `pinned` (the first
    `capacity` of them) and `pinned+lru` (the first round(capacity * pinned_fraction)).
    """
    policy = policy_name(name)
    if policy in (CachePolicy.PINNED, CachePolicy.PINNED_LRU):
        if pinned_rows is None:
            raise ValueError(
                f"cache policy {policy.value!r} pins a profile's hottest rows; pass pinned_rows="
                "profile.hottest(layer_id, n) (write a profile with `engram profile`), or use 'lru'"
            )
        if not 0.0 < pinned_fraction <= 1.0:
            raise ValueError(
                f"pinned_fraction={pinned_fraction!r} must be in (0, 1] (the share of slots pinned)"
            )
        return Pinned(capacity, pinned_rows, pinned_fraction, policy)
    if pinned_rows is not None:
        raise ValueError(
            f"cache policy {policy.value!r} pins nothing; pinned_rows is for 'pinned' and 'pinned+lru'"
        )
    return {CachePolicy.LRU: LRU, CachePolicy.CLOCK: Clock, CachePolicy.LFU: LFU}[policy](capacity)


def belady_hits(batches: list[np.ndarray], capacity: int, preload: np.ndarray | None = None) -> np.ndarray:
    """Hits per batch (B,) of Belady's offline optimum over sorted distinct batches of row ids.

    After each batch the cache may keep any `capacity` rows of those it held and those the batch
    fetched; it keeps the ones used again soonest (evicting the row used furthest in the future, or
    not admitting a miss that is that row). No online policy starting from the same contents does
    better. `preload`: rows the cache starts with (a first batch whose hits are not reported).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"Belady's bound needs capacity >= 1 rows, got {capacity!r}")
    first = [] if preload is None else [sorted_distinct(check_rows(preload, "preload"))]
    all_batches = [*first, *batches]
    sizes = np.array([b.shape[0] for b in all_batches], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.concatenate(all_batches).astype(np.int64) if all_batches else np.empty(0, np.int64)
    nxt, prev = cache_policies.next_use(flat, starts)
    hits = np.zeros(len(all_batches), dtype=np.int64)
    cache_policies.belady_hits(flat, starts, nxt, prev, capacity, hits)
    return hits[len(first) :]
