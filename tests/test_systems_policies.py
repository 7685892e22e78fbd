"""engram.systems.policies against the plain twins of tests/policy_reference.py (written from the
documented rules), Belady's optimum against a brute-force twin and as the bound of every policy, and
RowCache under each policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.kernels import cpu_cache
from engram.systems.cache import RowCache
from engram.systems.policies import (
    CachePolicy,
    belady_hits,
    distinct_counts,
    make_policy,
    sorted_distinct,
)
from policy_reference import PlainClock, PlainLFU, PlainLRU, PlainPinned, plain_belady

traces = st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=14), min_size=1, max_size=40)
capacities = st.integers(1, 24)


def run_policy(policy, batches):
    """Per call (hit rows, admitted rows), checking the slots against a row -> slot map kept here."""
    where: dict[int, int] = {}
    out = []
    for rows in batches:
        uniq = np.array(sorted(set(rows)), dtype=np.int64)
        slot_of = np.empty(uniq.shape[0], dtype=np.int64)
        ins_of = np.empty(uniq.shape[0], dtype=np.int64)
        hits, inserted, evictions = policy.plan(uniq, slot_of, ins_of)
        hit_rows = uniq[slot_of >= 0].tolist()
        assert all(where[r] == s for r, s in zip(hit_rows, slot_of[slot_of >= 0].tolist(), strict=True))
        assert ((slot_of >= 0) & (ins_of >= 0)).sum() == 0  # a row is a hit or admitted, not both
        admitted = uniq[ins_of >= 0].tolist()
        slots = ins_of[ins_of >= 0].tolist()
        assert len(set(slots)) == len(slots) and not set(slots) & set(slot_of[slot_of >= 0].tolist())
        before = len(where)
        where = {r: s for r, s in where.items() if s not in set(slots)}  # the evicted rows
        assert evictions == before - len(where)
        where.update(zip(admitted, slots, strict=True))
        assert (hits, inserted) == (len(hit_rows), len(admitted))
        resident = policy.slot_rows()
        assert {r: s for s, r in enumerate(resident.tolist()) if r >= 0} == where
        out.append((hit_rows, admitted))
    return out


def run_plain(ref, batches):
    return [tuple(map(list, ref.call(sorted(set(rows))))) for rows in batches]


@settings(max_examples=200, deadline=None)
@given(traces, capacities)
def test_lru_clock_lfu_match_their_plain_twins(batches, capacity):
    for name, ref in (
        ("lru", PlainLRU(capacity)),
        ("clock", PlainClock(capacity)),
        ("lfu", PlainLFU(capacity)),
    ):
        assert run_policy(make_policy(name, capacity), batches) == run_plain(ref, batches), name


@settings(max_examples=200, deadline=None)
@given(traces, capacities, st.permutations(list(range(41))), st.integers(0, 41), st.floats(0.05, 1.0))
def test_pinned_policies_match_their_plain_twins(batches, capacity, order, n_hot, fraction):
    hottest = np.array(order[:n_hot], dtype=np.int64)
    p = min(n_hot, capacity)
    got = run_policy(make_policy("pinned", capacity, hottest), batches)
    assert got == run_plain(PlainPinned(order[:p], 0), batches)
    p = min(n_hot, round(capacity * fraction))
    got = run_policy(make_policy("pinned+lru", capacity, hottest, fraction), batches)
    assert got == run_plain(PlainPinned(order[:p], capacity - p), batches)


@settings(max_examples=150, deadline=None)
@given(traces, capacities)
def test_belady_matches_brute_force_and_bounds_every_policy(batches, capacity):
    uniq = [np.array(sorted(set(b)), dtype=np.int64) for b in batches]
    best = int(belady_hits(uniq, capacity).sum())
    assert best == plain_belady([sorted(set(b)) for b in batches], capacity)
    hottest = np.arange(41, dtype=np.int64)[::-1].copy()
    for name in CachePolicy:
        pinned = hottest if name in (CachePolicy.PINNED, CachePolicy.PINNED_LRU) else None
        hits = sum(len(h) for h, _ in run_policy(make_policy(name, capacity, pinned), batches))
        assert hits <= best, name


@settings(max_examples=40, deadline=None)
@given(traces, capacities, st.lists(st.integers(0, 40), max_size=30, unique=True))
def test_belady_bounds_policies_that_start_from_the_same_contents(batches, capacity, preload):
    uniq = [np.array(sorted(set(b)), dtype=np.int64) for b in batches]
    pre = np.array(preload[:capacity], dtype=np.int64)
    best = int(belady_hits(uniq, capacity, pre).sum())
    assert best == plain_belady([sorted(pre.tolist()), *[u.tolist() for u in uniq]], capacity)
    for name in ("lru", "clock", "lfu"):
        policy = make_policy(name, capacity)
        run_policy(policy, [sorted(pre.tolist())])  # the warm start: one uncounted call
        hits = sum(len(h) for h, _ in run_policy_continue(policy, batches))
        assert hits <= best, name


def run_policy_continue(policy, batches):
    """run_policy for a policy that already holds rows (its map taken from slot_rows)."""
    out = []
    for rows in batches:
        uniq = np.array(sorted(set(rows)), dtype=np.int64)
        slot_of = np.empty(uniq.shape[0], dtype=np.int64)
        ins_of = np.empty(uniq.shape[0], dtype=np.int64)
        policy.plan(uniq, slot_of, ins_of)
        out.append((uniq[slot_of >= 0].tolist(), uniq[ins_of >= 0].tolist()))
    return out


def test_crafted_clock_and_lfu():
    clock = make_policy("clock", 2)
    run_policy(clock, [[1, 2], [1]])  # bits: 1 set (hit), 2 set (admitted)
    assert run_policy_continue(clock, [[3]]) == [([], [3])]
    assert clock.slot_rows().tolist() == [3, 2]  # the hand cleared both bits, came back to slot 0
    lfu = make_policy("lfu", 2)
    out = run_policy_continue(lfu, [[1, 2], [1], [1], [3], [2]])
    # counts halve after calls 1 and 3 (each time 2 lookups = capacity since the last halving), so 2
    # (count 0) goes before 1 (count 1); then 1 goes before 3 (equal counts, 1 used less recently)
    assert out[3] == ([], [3]) and out[4] == ([], [2])
    assert lfu.slot_rows().tolist() == [2, 3]  # 2 took 1's slot


def test_belady_crafted():
    b = [np.array(x, dtype=np.int64) for x in ([1, 2], [3], [1], [2])]
    # capacity 1: after [1, 2] keep 1 (used at batch 2) not 2 (batch 3); 3 is never used again: not admitted
    assert belady_hits(b, 1).tolist() == [0, 0, 1, 0]
    assert belady_hits(b, 2).tolist() == [0, 0, 1, 1]
    assert belady_hits(b, 1, preload=np.array([3], dtype=np.int64)).tolist() == [0, 1, 0, 0]


def test_lru_policy_is_the_cpu_cache_kernel_bit_for_bit():
    rng = np.random.default_rng(5)
    cache, state = RowCache(50, 32, policy="lru"), cpu_cache.new_state(50)
    for _ in range(200):
        uniq = np.unique(rng.zipf(1.2, size=30) % 300).astype(np.int64)
        s_of, i_of = np.empty_like(uniq), np.empty_like(uniq)
        expect = cpu_cache.plan(uniq, *state, s_of, i_of)
        before = cache.hits
        p = cache.plan(uniq)
        assert cache.hits - before == expect[0]
        assert p.hit_slots.tolist() == s_of[s_of >= 0].tolist()
        assert p.ins_slots.tolist() == i_of[p.miss_idx[: p.ins_slots.shape[0]]].tolist()
    assert cache.resident_rows().tolist() == np.sort(state[2][state[2] >= 0]).tolist()


@pytest.mark.parametrize("policy", ["clock", "lfu", "pinned", "pinned+lru"])
def test_row_cache_under_each_policy_serves_the_stored_bytes(policy):
    rng = np.random.default_rng(0)
    table_v = torch.randint(0, 256, (200, 32), dtype=torch.uint8)
    table_s = torch.randint(0, 256, (200, 1), dtype=torch.uint8)
    hot = np.arange(0, 200, 7, dtype=np.int64)[::-1].copy()
    pinned = hot if policy.startswith("pinned") else None
    cache = RowCache(16, 32, policy=policy, pinned_rows=pinned)
    assert cache.stats()["policy"] == policy and policy in repr(cache)
    for _ in range(60):
        uniq = np.unique(rng.integers(0, 200, 12)).astype(np.int64)
        p = cache.plan(uniq)
        k = p.ins_slots.shape[0]
        admitted = uniq[p.miss_idx[:k]]
        assert set(cache.resident_rows().tolist()) >= set(admitted.tolist())
        cache.write(torch.from_numpy(p.ins_slots), table_v[admitted], table_s[admitted])
        hv = torch.empty((p.hit_idx.shape[0], 32), dtype=torch.uint8)
        hs = torch.empty((p.hit_idx.shape[0], 1), dtype=torch.uint8)
        cache.read(torch.from_numpy(p.hit_slots), hv, hs)
        assert torch.equal(hv, table_v[uniq[p.hit_idx]]) and torch.equal(hs, table_s[uniq[p.hit_idx]])
    if policy == "pinned":
        assert set(cache.resident_rows().tolist()) <= set(hot[:16].tolist())
    with pytest.raises(ValueError, match="lru_order is the order of an 'lru' cache"):
        cache.lru_order()


def test_bad_policies():
    with pytest.raises(ValueError, match=r"unknown cache policy 'fifo'; known policies: lru, clock"):
        RowCache(4, 32, policy="fifo")
    with pytest.raises(ValueError, match=r"'pinned' pins a profile's hottest rows; pass pinned_rows="):
        make_policy("pinned", 4)
    with pytest.raises(ValueError, match="'lru' pins nothing"):
        make_policy("lru", 4, np.arange(3))
    with pytest.raises(ValueError, match=r"pinned_fraction=1.5 must be in \(0, 1\]"):
        make_policy("pinned+lru", 4, np.arange(3), 1.5)
    with pytest.raises(ValueError, match="repeat a row id"):
        make_policy("pinned", 4, np.array([3, 1, 3]))
    with pytest.raises(ValueError, match="row id -2 at position 1 is negative"):
        make_policy("pinned", 4, np.array([3, -2]))
    with pytest.raises(TypeError, match="1-D integer array"):
        make_policy("pinned", 4, np.array([1.5]))
    with pytest.raises(ValueError, match="capacity >= 1"):
        make_policy("clock", 0)
    with pytest.raises(ValueError, match="capacity >= 1"):
        belady_hits([np.arange(3)], 0)


def test_distinct_helpers_match_numpy():
    a = np.random.default_rng(1).integers(0, 50, (30, 4))
    u, c = np.unique(a, return_counts=True)
    assert sorted_distinct(a).tolist() == u.tolist()
    got_u, got_c = distinct_counts(a)
    assert (got_u.tolist(), got_c.tolist()) == (u.tolist(), c.tolist())
    assert sorted_distinct(np.empty(0, dtype=np.int64)).shape == (0,)


def test_default_policy_depends_on_a_profile():
    assert RowCache(8, 32).policy.name is CachePolicy.LRU
    cache = RowCache(8, 32, pinned_rows=np.array([5, 3], dtype=np.int64))
    assert cache.policy.name is CachePolicy.PINNED_LRU and cache.policy.pinned == 2  # round(8 * 0.5) capped
    assert RowCache(8, 32, policy="clock").stats()["policy"] == "clock"


@pytest.mark.parametrize("policy", ["lru", "clock", "lfu", "pinned", "pinned+lru"])
def test_level_table_under_each_policy_is_bit_exact(policy):
    """The tiers' LevelTable (device cache, then host cache of its misses) built on RowCache's policies
    serves exactly FP8Table.gather's rows, call after call."""
    from engram.model.table import FP8Table
    from engram.systems.levels import LevelTable

    g = torch.Generator().manual_seed(0)
    table = FP8Table.from_float(torch.randn(300, 64, generator=g))
    hot = np.arange(0, 300, 3, dtype=np.int64)
    pinned = policy.startswith("pinned")
    lt = LevelTable(table, device_rows=8, host_rows=40, device_policy=policy, host_policy=policy,
                    device_pinned_rows=hot[:20] if pinned else None,
                    host_pinned_rows=hot[20:] if pinned else None)  # fmt: skip
    rng = np.random.default_rng(1)
    for _ in range(25):
        rows = torch.from_numpy((rng.zipf(1.3, (3, 7)) % 300).astype(np.int64))
        got, want = lt.gather(rows), table.gather(rows)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    s = lt.stats()
    assert s["device"]["hits"] > 0 and s["host"]["hits"] > 0
