"""Tests for engram.systems.cache.RowCache: exact LRU, counters, overflow, against a plain twin."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.systems.cache import RowCache


class PlainLRU:
    """The reference twin: an OrderedDict LRU with RowCache's documented policy (hits touched in
    ascending row order, then misses admitted in ascending order while capacity - hits allows)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.hits = self.misses = self.evictions = 0

    def call(self, rows: list[int]) -> None:
        uniq = sorted(set(rows))
        hits = [r for r in uniq if r in self.rows]
        misses = [r for r in uniq if r not in self.rows]
        self.hits += len(hits)
        self.misses += len(misses)
        for r in hits:
            self.rows.move_to_end(r)
        for r in misses[: self.capacity - len(hits)]:
            if len(self.rows) == self.capacity:
                self.rows.popitem(last=False)
                self.evictions += 1
            self.rows[r] = None


def plan(cache: RowCache, rows: list[int]):
    return cache.plan(np.unique(np.array(rows, dtype=np.int64)))


def test_crafted_sequence_counts_and_lru_order():
    c = RowCache(3, 32, policy="lru")
    p = plan(c, [1, 2, 3])
    assert p.hit_idx.tolist() == [] and p.miss_idx.tolist() == [0, 1, 2] and p.ins_slots.tolist() == [0, 1, 2]
    assert c.lru_order().tolist() == [1, 2, 3]
    p = plan(c, [1, 1, 1])  # a repeat within a call is one lookup
    assert p.hit_slots.tolist() == [0]
    assert c.lru_order().tolist() == [2, 3, 1]
    p = plan(c, [4])  # evicts 2, the least recently used, and takes its slot
    assert p.ins_slots.tolist() == [1]
    assert c.lru_order().tolist() == [3, 1, 4]
    plan(c, [2, 3])  # 3 hits (touched first), 2 misses and evicts 1 (LRU after 3 was touched)
    assert c.lru_order().tolist() == [4, 3, 2]
    assert (c.hits, c.misses, c.evictions) == (2, 5, 2)
    assert c.bytes_fetched == 5 * (32 + 1)
    assert c.slot_of(np.array([1, 2, 3, 4, 99])).tolist() == [-1, 0, 2, 1, -1]
    s = c.stats()
    assert s["resident"] == 3 and s["hit_rate"] == pytest.approx(2 / 7)
    c.reset_stats()
    assert (c.hits, c.misses, c.evictions, c.bytes_fetched) == (0, 0, 0, 0)
    assert c.resident_rows().tolist() == [2, 3, 4]  # reset_stats keeps the rows
    c.clear()
    assert c.resident_rows().tolist() == []


def test_more_distinct_rows_than_capacity():
    c = RowCache(3, 32, policy="lru")
    p = plan(c, [10, 11, 12, 13, 14])
    assert p.miss_idx.tolist() == [0, 1, 2, 3, 4]
    assert p.ins_slots.tolist() == [0, 1, 2]  # only the first 3 misses fit; 13, 14 served uncached
    assert c.resident_rows().tolist() == [10, 11, 12]
    p = plan(c, [10, 11, 12, 13, 14])
    # 3 hits fill the cache: admitting 13 would evict a row this call uses, so nothing is admitted
    assert p.hit_idx.tolist() == [0, 1, 2] and p.miss_idx.tolist() == [3, 4] and p.ins_slots.size == 0
    assert (c.hits, c.misses, c.evictions) == (3, 7, 0)
    p = plan(c, [11, 20, 21, 22])  # 1 hit leaves room for 2 of the 3 misses: 10 and 12 go
    assert p.ins_slots.size == 2 and c.evictions == 2
    assert c.resident_rows().tolist() == [11, 20, 21]


def test_device_half_reads_and_writes_bytes():
    c = RowCache(4, 32, policy="lru")
    v = torch.randint(0, 255, (2, 32), dtype=torch.uint8)
    s = torch.randint(100, 140, (2, 1), dtype=torch.uint8)
    c.write(torch.tensor([3, 1]), v, s)
    out_v, out_s = torch.empty(2, 32, dtype=torch.uint8), torch.empty(2, 1, dtype=torch.uint8)
    c.read(torch.tensor([1, 3]), out_v, out_s)
    assert torch.equal(out_v, v.flip(0)) and torch.equal(out_s, s.flip(0))
    assert c.values.dtype == torch.float8_e4m3fn and c.scales.dtype == torch.float8_e8m0fnu


def test_errors():
    with pytest.raises(ValueError, match=r"capacity >= 1 rows, got 0"):
        RowCache(0, 32, policy="lru")
    with pytest.raises(ValueError, match=r"capacity >= 1 rows, got -2"):
        RowCache(-2, 32)
    with pytest.raises(ValueError, match=r"dim=48 must be a positive multiple of 32"):
        RowCache(4, 48)
    with pytest.raises(TypeError, match=r"1-D int64"):
        RowCache(4, 32, policy="lru").plan(np.array([1, 2], dtype=np.int32))


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 9),
    calls=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=25),
)
def test_matches_plain_lru(capacity, calls):
    """Random call sequences: same resident rows, LRU order and counters as the OrderedDict twin;
    hits + misses = distinct rows requested; slots always hold the row the index says."""
    c, ref = RowCache(capacity, 32, policy="lru"), PlainLRU(capacity)
    distinct = 0
    for rows in calls:
        p = plan(c, rows)
        ref.call(rows)
        distinct += len(set(rows))
        assert p.hit_idx.size + p.miss_idx.size == len(set(rows))
        assert c.lru_order().tolist() == list(ref.rows)
        assert (c.hits, c.misses, c.evictions) == (ref.hits, ref.misses, ref.evictions)
    assert c.hits + c.misses == distinct
    resident = c.resident_rows()
    slots = c.slot_of(resident)
    assert len(set(slots.tolist())) == resident.size and (slots >= 0).all()


def test_map_survives_heavy_churn():
    """Many evictions through the open-addressing map (backward-shift deletion): the index stays exact."""
    rng = np.random.default_rng(0)
    c, ref = RowCache(64, 32, policy="lru"), PlainLRU(64)
    for _ in range(300):
        rows = rng.integers(0, 1 << 40, size=int(rng.integers(1, 40))).tolist()
        rows += rng.integers(0, 100, size=20).tolist()  # a hot set that keeps hitting
        plan(c, rows)
        ref.call(rows)
    assert c.lru_order().tolist() == list(ref.rows)
    assert (c.hits, c.misses, c.evictions) == (ref.hits, ref.misses, ref.evictions)


@pytest.mark.parametrize(
    ("uniq", "match"),
    [
        ([5, 5], r"uniq\[1\]=5 follows uniq\[0\]=5; pass np.unique"),
        ([1, 7, 3], r"uniq\[2\]=3 follows uniq\[1\]=7"),
        ([-1, 3], r"row id -1 at position 0 is negative"),
    ],
)
def test_plan_rejects_repeated_unsorted_or_negative_rows(uniq, match):
    """A repeated id used to take two slots for one row (and later serve another row's bytes)."""
    c = RowCache(2, 32, policy="lru")
    with pytest.raises(ValueError, match=match):
        c.plan(np.array(uniq, dtype=np.int64))
    assert c.resident_rows().tolist() == [] and (c.hits, c.misses) == (0, 0)  # nothing changed
    plan(c, [5])
    assert plan(c, [5]).hit_slots.tolist() == [0]


def test_write_and_read_check_slots_and_shapes():
    """The CPU write is an unchecked numba scatter: bad slots or lengths used to corrupt memory."""
    c = RowCache(4, 32, policy="lru")
    v, s = torch.full((1, 32), 7, dtype=torch.uint8), torch.full((1, 1), 9, dtype=torch.uint8)
    c._values.zero_()
    for slot in (-1, 4):
        with pytest.raises(
            ValueError, match=rf"slot {slot} at position 0 is outside this cache's slots \[0, 4\)"
        ):
            c.write(torch.tensor([slot]), v, s)
    assert int(c._values.sum()) == 0  # nothing written
    with pytest.raises(ValueError, match=r"values must be uint8 \(2, 32\) for 2 slots"):
        c.write(torch.tensor([0, 1]), v, s)
    with pytest.raises(ValueError, match=r"scales must be uint8 \(1, 1\)"):
        c.write(torch.tensor([0]), v, torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"slots must be a 1-D int64 tensor"):
        c.write(torch.tensor([0], dtype=torch.int32), v, s)
    out_v, out_s = torch.empty(1, 32, dtype=torch.uint8), torch.empty(1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"4"):
        c.read(torch.tensor([4]), out_v, out_s)
    with pytest.raises(ValueError, match=r"values must be uint8 \(2, 32\)"):
        c.read(torch.tensor([0, 1]), out_v, out_s)
    c.write(torch.tensor([2]), v, s)
    c.read(torch.tensor([2]), out_v, out_s)
    assert torch.equal(out_v, v) and torch.equal(out_s, s)
