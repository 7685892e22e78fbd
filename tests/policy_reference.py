"""Plain Python twins of the cache policies of engram.systems.policies, written from their documented
rules (not from the kernels): each returns (hits, admitted rows) per call, so tests can compare exactly."""

from __future__ import annotations

from collections import OrderedDict


class PlainLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[int, None] = OrderedDict()  # least recent first

    def call(self, uniq: list[int]) -> tuple[list[int], list[int]]:
        hits = [r for r in uniq if r in self.rows]
        for r in hits:
            self.rows.move_to_end(r)
        admitted = []
        for r in [r for r in uniq if r not in self.rows][: self.capacity - len(hits)]:
            if len(self.rows) == self.capacity:
                self.rows.popitem(last=False)
            self.rows[r] = None
            admitted.append(r)
        return hits, admitted


class PlainClock:
    """Slots in a ring; a hit sets the slot's bit; a miss takes the first slot at the hand that is empty
    or has its bit clear, clearing set bits on the way and skipping slots this call used; new bit set."""

    def __init__(self, capacity: int) -> None:
        self.slots: list[int | None] = [None] * capacity
        self.bit = [0] * capacity
        self.hand = 0

    def call(self, uniq: list[int]) -> tuple[list[int], list[int]]:
        where = {r: s for s, r in enumerate(self.slots) if r is not None}
        hits = [r for r in uniq if r in where]
        used = {where[r] for r in hits}
        for s in used:
            self.bit[s] = 1
        admitted = []
        for r in [r for r in uniq if r not in where][: len(self.slots) - len(hits)]:
            while True:
                s = self.hand
                self.hand = (s + 1) % len(self.slots)
                if s in used:
                    continue
                if self.slots[s] is not None and self.bit[s]:
                    self.bit[s] = 0
                    continue
                break
            self.slots[s], self.bit[s] = r, 1
            used.add(s)
            admitted.append(r)
        return hits, admitted


class PlainLFU:
    """count = calls using the row since admission (1 at admission); evict min (count, last call, row)
    among rows this call does not use; all counts halve once `capacity` lookups passed since the last."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.calls = self.since = 0

    def call(self, uniq: list[int]) -> tuple[list[int], list[int]]:
        self.calls += 1
        hits = [r for r in uniq if r in self.count]
        for r in hits:
            self.count[r] += 1
            self.last[r] = self.calls
        mine = set(hits)
        admitted = []
        for r in [r for r in uniq if r not in self.count][: self.capacity - len(hits)]:
            if len(self.count) == self.capacity:
                victim = min(
                    (k for k in self.count if k not in mine), key=lambda k: (self.count[k], self.last[k], k)
                )
                del self.count[victim], self.last[victim]
            self.count[r], self.last[r] = 1, self.calls
            mine.add(r)
            admitted.append(r)
        self.since += len(uniq)
        if self.since >= self.capacity:
            self.since = 0
            self.count = {k: v // 2 for k, v in self.count.items()}
        return hits, admitted


class PlainPinned:
    """The first P hottest rows pinned (cached from their first use, never evicted); with lru_slots > 0
    an LRU of that many slots over every other row."""

    def __init__(self, pinned: list[int], lru_slots: int) -> None:
        self.pinned = set(pinned)
        self.loaded: set[int] = set()
        self.lru = PlainLRU(lru_slots) if lru_slots else None

    def call(self, uniq: list[int]) -> tuple[list[int], list[int]]:
        mine = [r for r in uniq if r in self.pinned]
        hits = [r for r in mine if r in self.loaded]
        admitted = [r for r in mine if r not in self.loaded]
        self.loaded.update(admitted)
        if self.lru is not None:
            h, a = self.lru.call([r for r in uniq if r not in self.pinned])
            hits, admitted = sorted(hits + h), sorted(admitted + a)
        return hits, admitted


def plain_belady(batches: list[list[int]], capacity: int) -> int:
    """Total hits of the offline optimum by brute force over keep-sets: after each batch keep the
    `capacity` rows of (cache | batch) used again soonest (ties: any), rows never used again dropped."""
    cache: set[int] = set()
    hits = 0
    for b, uniq in enumerate(batches):
        hits += sum(r in cache for r in uniq)

        def next_use(r: int, b: int = b) -> float:
            return next((j for j in range(b + 1, len(batches)) if r in batches[j]), float("inf"))

        cands = sorted(cache | set(uniq), key=next_use)
        cache = {r for r in cands[:capacity] if next_use(r) != float("inf")}
    return hits
