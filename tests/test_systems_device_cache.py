"""engram.systems.device_cache: the device-indexed, set-associative hot-row cache, run by torch on the CPU
(the same ops CUDA runs) against a plain-Python twin of its rules; the generation guard of its scratch
regions; the refusal of a cache larger than the device's free memory (CUDA facts monkeypatched); the
Triton row copy of its fill against its twin (interpreted on a CPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engram.benchmarks.bench_lookup import make_table
from engram.kernels import reference
from engram.kernels.reference import set_of
from engram.systems.device_cache import DeviceRowCache
from engram.systems.placement import check_device_memory


def py_set(row: int, sets: int) -> int:
    h = (row ^ (row >> 29)) & 0x7FFFFFFF
    h = (h * 0x5BD1E995) & 0x7FFFFFFF
    return (h ^ (h >> 15)) % sets


class TwinCache:
    """The rules of DeviceRowCache.plan, one row at a time: hits touched, then each set's distinct misses
    in ascending row order into its least recently used unprotected ways (ties: the lowest way), the
    rest spilled to scratch in (set, row) order."""

    def __init__(self, sets: int, ways: int, scratch_rows: int) -> None:
        self.sets, self.ways, self.scratch_rows = sets, ways, scratch_rows
        self.tags = [[-1] * ways for _ in range(sets)]
        self.stamps = [[-1] * ways for _ in range(sets)]
        self.t = 0
        self.hits = self.misses = self.evictions = self.spilled = 0

    def plan(self, rows: list[int], region: int = 0, protect_from: int | None = None) -> list[int]:
        self.t += 1
        t = self.t
        floor = t if protect_from is None else min(protect_from, t)
        w = self.ways
        where: dict[int, int] = {}
        for r in sorted(set(rows)):
            s = py_set(r, self.sets)
            if r in self.tags[s]:
                k = self.tags[s].index(r)
                self.stamps[s][k] = t
                where[r] = s * w + k
                self.hits += 1
        misses = sorted((py_set(r, self.sets), r) for r in set(rows) if r not in where)
        self.misses += len(misses)
        spill = 0
        by_set: dict[int, list[int]] = {}
        for s, r in misses:
            by_set.setdefault(s, []).append(r)
        for s in sorted(by_set):
            free = sorted(
                (k for k in range(w) if self.stamps[s][k] < floor), key=lambda k: (self.stamps[s][k], k)
            )
            for i, r in enumerate(by_set[s]):
                if i < len(free):
                    k = free[i]
                    self.evictions += self.tags[s][k] >= 0
                    self.tags[s][k], self.stamps[s][k] = r, t
                    where[r] = s * w + k
                else:
                    where[r] = self.sets * w + region * self.scratch_rows + spill
                    spill += 1
                    self.spilled += 1
        return [where[r] for r in rows]


@pytest.fixture(scope="module")
def table():
    return make_table(600, 64, 0)


def check_bytes(cache: DeviceRowCache, plan, rows: torch.Tensor, table) -> None:
    assert torch.equal(cache.values.view(torch.uint8)[plan.final], table.weight.view(torch.uint8)[rows])
    assert torch.equal(cache.scales.view(torch.uint8)[plan.final], table.scale.view(torch.uint8)[rows])


def test_set_of_matches_python_and_stays_in_range():
    rows = torch.tensor([0, 1, 2, 2**31 - 1, 2**31, 2**40 + 17, 384_016_681, 7 * 2**29])
    for sets in (1, 3, 64, 1_200_007):
        got = set_of(rows, sets)
        assert got.tolist() == [py_set(int(r), sets) for r in rows]
        assert bool((got >= 0).all()) and bool((got < sets).all())
    spread = torch.bincount(set_of(torch.arange(64_000), 64), minlength=64)  # consecutive ids spread out
    assert int(spread.min()) > 800 and int(spread.max()) < 1200


@pytest.mark.parametrize(("capacity", "ways"), [(40, 4), (64, 16), (7, 1), (300, 8)])
def test_plan_equals_twin_and_places_every_row(table, capacity, ways):
    cache = DeviceRowCache(capacity, 64, table.num_rows, "cpu", ways=ways, regions=3)
    rng = random.Random(capacity * 31 + ways)
    twin = None
    for call in range(40):
        n = rng.choice([0, 1, 5, 57, 200])
        rows = torch.tensor([min(int(rng.paretovariate(0.7)), 599) for _ in range(n)], dtype=torch.int64)
        region = rng.randrange(3)
        protect = rng.choice([None, max(1, call - 2), call + 1])
        cache.reserve(region, n)
        if twin is None or twin.scratch_rows != cache.scratch_rows:  # scratch regrew: rebuild the twin's view
            twin = twin or TwinCache(cache.sets, ways, cache.scratch_rows)
            twin.scratch_rows = cache.scratch_rows
        plan = cache.plan(rows, region=region, protect_from=protect)
        expected = twin.plan(rows.tolist(), region, protect)
        assert plan.final.tolist() == expected, call
        cache.fill(plan, table.weight, table.scale)
        check_bytes(cache, plan, rows, table)
        assert cache.tags[: cache.capacity].tolist() == [r for s in twin.tags for r in s]
        assert cache.stamps[: cache.capacity].tolist() == [x for s in twin.stamps for x in s]
    st = cache.stats()
    assert (st["hits"], st["misses"], st["evictions"], st["spilled"]) == (
        twin.hits,
        twin.misses,
        twin.evictions,
        twin.spilled,
    )


def test_hits_and_protected_rows_are_never_evicted(table):
    cache = DeviceRowCache(16, 64, table.num_rows, "cpu", ways=4)
    first = torch.arange(0, 40)  # more than the cache holds: some rows spill
    cache.reserve(1, 40)
    p1 = cache.plan(first, region=1)
    cache.fill(p1, table.weight, table.scale)
    kept = {int(r) for r in cache.tags[: cache.capacity] if r >= 0}
    # later calls of other rows, protecting everything from p1's call on: p1's slots must survive
    for k in range(5):
        other = torch.arange(100 + 40 * k, 140 + 40 * k)
        cache.reserve(0, 40)
        p = cache.plan(other, protect_from=p1.stamp)
        cache.fill(p, table.weight, table.scale)
        check_bytes(cache, p, other, table)
        assert kept <= {int(r) for r in cache.tags[: cache.capacity] if r >= 0}
    assert cache.valid(p1)  # region 1 untouched since
    check_bytes(cache, p1, first, table)  # p1 still reads the right bytes
    # a call's own hits stay: rows 0..39 again, each set's hits protected within the call
    cache.reserve(0, 40)
    again = cache.plan(first)
    hit_slots = {int(s) for s, r in zip(p1.final, first, strict=True) if int(s) < cache.capacity}
    assert hit_slots <= {int(s) for s in again.final}


def test_generation_guard_of_scratch_regions(table):
    cache = DeviceRowCache(8, 64, table.num_rows, "cpu", ways=2, regions=3)
    assert [cache.take_region() for _ in range(5)] == [1, 2, 1, 2, 1]
    cache.reserve(1, 30)
    a = cache.plan(torch.arange(30), region=1)
    assert cache.valid(a)
    cache.reserve(2, 30)
    b = cache.plan(torch.arange(30, 60), region=2)
    assert cache.valid(a) and cache.valid(b)
    cache.reserve(1, 30)  # a third call ahead reuses region 1: `a` is stale, `b` is not
    assert not cache.valid(a) and cache.valid(b)
    cache.reserve(0, 10_000)  # a larger call regrows every region: every plan is stale
    assert not cache.valid(b)
    c = cache.plan(torch.arange(10), region=0)
    cache.clear()
    assert not cache.valid(c) and int((cache.tags >= 0).sum()) == 0
    with pytest.raises(ValueError, match=r"regions 0\.\.2"):
        cache.reserve(3, 1)


def test_refuses_cache_larger_than_free_device_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    cuda = torch.device("cuda", 0)
    with pytest.raises(
        ValueError,
        match=r"needs 5\.22 GiB \(5,600,000,000 bytes\) on cuda:0, but only 3\.00 GiB of its 80\.00 GiB are free",
    ):
        DeviceRowCache(20_000_000, 256, 384_000_000, cuda)  # refused before any CUDA allocation
    with pytest.raises(ValueError, match="fewer cache_rows"):
        check_device_memory(4 << 30, cuda, "a cache", "use fewer cache_rows")
    check_device_memory(2 << 30, cuda, "a cache", "use fewer cache_rows")  # fits
    check_device_memory(1 << 50, torch.device("cpu"), "a cache", "-")  # a CPU is not checked


def test_constructor_refusals():
    with pytest.raises(ValueError, match="capacity >= 1"):
        DeviceRowCache(0, 64, 10, "cpu")
    with pytest.raises(ValueError, match="multiple of 32"):
        DeviceRowCache(8, 48, 10, "cpu")
    with pytest.raises(ValueError, match="regions"):
        DeviceRowCache(8, 64, 10, "cpu", regions=1)
    with pytest.raises(ValueError, match="overflow the sort key"):
        DeviceRowCache(2**30, 64, 2**40, "cpu", ways=1)


@pytest.mark.triton
def test_triton_copy_rows_equals_twin():
    from engram.kernels import copy_rows

    g = torch.Generator().manual_seed(0)
    for width, idx_dtype in ((256, torch.int64), (8, torch.int32), (6, torch.int64), (3, torch.int32)):
        src = torch.randint(0, 256, (100, width), dtype=torch.uint8, generator=g)
        dst = torch.randint(0, 256, (40, width), dtype=torch.uint8, generator=g)
        si = torch.randint(0, 100, (70,), generator=g).to(idx_dtype)
        di = torch.full((70,), -1, dtype=idx_dtype)
        di[torch.randperm(70, generator=g)[:25]] = torch.randperm(40, generator=g)[:25].to(idx_dtype)
        a, b = dst.clone(), dst.clone()
        copy_rows(src, si, a, di)
        reference.copy_rows(src, si, b, di)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="one row width"):
        copy_rows(src, si, torch.zeros(4, width + 1, dtype=torch.uint8), di)


@pytest.mark.triton
@pytest.mark.parametrize(("sets", "ways"), [(5, 4), (64, 16), (3, 1), (7, 5)])
def test_triton_cache_lookup_equals_twin(sets, ways):
    from engram.kernels import cache_lookup

    g = torch.Generator().manual_seed(sets * ways)
    c = sets * ways
    cached = torch.randperm(1000, generator=g)[: c // 2]
    tags = torch.full((c + 1,), -1, dtype=torch.int64)
    for r in cached.tolist():  # each cached row in a free way of its own set
        s = int(set_of(torch.tensor([r]), sets))
        free = [k for k in range(ways) if tags[s * ways + k] < 0]
        if free:
            tags[s * ways + free[0]] = r
    stamps = torch.randint(-1, 9, (c + 1,), generator=g)
    rows = torch.cat([cached[:40], torch.randint(0, 1000, (60,), generator=g), cached[:10]])  # repeats
    rows = rows[torch.randperm(rows.numel(), generator=g)]
    got = (stamps.clone(), torch.zeros(4, dtype=torch.int64))
    want = (stamps.clone(), torch.zeros(4, dtype=torch.int64))
    slot = cache_lookup(rows, tags, got[0], got[1], sets, ways, 10)
    ref = reference.cache_lookup(rows, tags, want[0], want[1], sets, ways, 10)
    assert torch.equal(slot, ref) and torch.equal(got[0][:c], want[0][:c]) and torch.equal(got[1], want[1])
    assert int(got[1][0]) == torch.unique(ref[ref >= 0]).numel() > 0
    assert torch.equal(cache_lookup(rows[:0], tags, got[0], got[1], sets, ways, 11), rows[:0])


def test_counters_are_distinct_rows_per_call(table):
    cache = DeviceRowCache(64, 64, table.num_rows, "cpu", ways=8)
    rows = torch.tensor([5, 5, 9, 5, 9, 11])
    for _ in range(2):
        cache.reserve(0, rows.numel())
        cache.fill(cache.plan(rows), table.weight, table.scale)
    st = cache.stats()
    assert (st["misses"], st["hits"], st["bytes_fetched"]) == (3, 3, 3 * 66)
    assert st["resident"] == 3 and np.isclose(st["hit_rate"], 0.5)
