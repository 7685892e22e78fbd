"""Numba kernels of the cache policies beside exact LRU (`engram.systems.policies`): CLOCK, LFU with
aging, and Belady's offline optimum for the simulator.

CLOCK and LFU keep their own open-addressing map row -> slot (`cpu_cache`'s map functions) and
follow `cpu_cache.plan`'s contract: look the call's sorted distinct rows up, then admit misses in
ascending row order, at most capacity - hits of them, never evicting a row the call itself uses.
`belady_hits` replays whole batched traces offline. Knows slots and row ids, nothing of bytes or
devices. Compiles on first call (cached on disk) and releases the GIL. Design: docs/kernels.md.
"""

from __future__ import annotations

import numba
import numpy as np

from engram.kernels.cpu_cache import EMPTY, map_delete, map_find, map_insert

__all__ = ["EMPTY", "belady_hits", "clock_plan", "lfu_plan", "new_map", "next_use"]

NEVER = np.iinfo(np.int64).max  # the next use of a row used never again

_jit = numba.njit(cache=True, nogil=True)


def new_map(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, vals) of an empty map for up to `capacity` rows (a power of two >= 2 * capacity)."""
    size = 1 << max(1, int(2 * capacity - 1).bit_length())
    return np.full(size, EMPTY, dtype=np.int64), np.zeros(size, dtype=np.int64)


# ------------------------------------------------------------------------------------------- the map
@_jit
def _lookup(uniq, keys, vals, mask, slot_of, ins_of):
    hits = 0
    for i in range(uniq.shape[0]):
        at = map_find(keys, mask, uniq[i])
        slot_of[i] = vals[at] if at >= 0 else -1
        ins_of[i] = -1
        if at >= 0:
            hits += 1
    return hits


@_jit
def _replace(keys, vals, mask, slot_row, s, row):
    """Give slot s to `row`, dropping its old row from the map; returns 1 if a row was evicted."""
    old = slot_row[s]
    evicted = 0
    if old != EMPTY:
        map_delete(keys, vals, mask, map_find(keys, mask, old))
        evicted = 1
    map_insert(keys, vals, mask, row, s)
    slot_row[s] = row
    return evicted


# ------------------------------------------------------------------------------------------- CLOCK
@_jit
def clock_plan(uniq, keys, vals, slot_row, ref, stamp, hand, call, slot_of, ins_of):
    """CLOCK (second chance) over sorted distinct rows uniq (U,); returns (hits, inserted, evictions).

    A hit sets its slot's reference bit. A miss takes the first slot under the hand that is empty, or
    whose bit is clear, clearing set bits as the hand passes; slots the call uses (stamp == call) are
    skipped. An admitted row starts with its bit set. hand (1,) and the arrays are updated in place.
    """
    mask = np.int64(keys.shape[0] - 1)
    capacity = slot_row.shape[0]
    hits = _lookup(uniq, keys, vals, mask, slot_of, ins_of)
    for i in range(uniq.shape[0]):
        s = slot_of[i]
        if s >= 0:
            ref[s] = 1
            stamp[s] = call
    room = capacity - hits
    inserted = 0
    evictions = 0
    for i in range(uniq.shape[0]):
        if inserted >= room:
            break
        if slot_of[i] >= 0:
            continue
        while True:  # ends: fewer than `capacity` slots carry this call's stamp (see `room`)
            s = hand[0]
            hand[0] = (s + 1) % capacity
            if stamp[s] == call:
                continue
            if slot_row[s] != EMPTY and ref[s]:
                ref[s] = 0
                continue
            break
        evictions += _replace(keys, vals, mask, slot_row, s, uniq[i])
        ref[s] = 1
        stamp[s] = call
        ins_of[i] = s
        inserted += 1
    return hits, inserted, evictions


# ------------------------------------------------------------------------------------------- LFU
@_jit
def _less(count, stamp, slot_row, a, b):
    """Slot a is a better victim than slot b: fewer uses, then less recent, then the smaller row id."""
    if count[a] != count[b]:
        return count[a] < count[b]
    if stamp[a] != stamp[b]:
        return stamp[a] < stamp[b]
    return slot_row[a] < slot_row[b]


@_jit
def _swap(heap, pos, i, j):
    """Swap heap entries i and j, keeping pos (slot -> its heap index) in step."""
    heap[i], heap[j] = heap[j], heap[i]
    pos[heap[i]] = i
    pos[heap[j]] = j


@_jit
def _sift_up(heap, pos, count, stamp, slot_row, i):
    while i > 0:
        p = (i - 1) >> 1
        if not _less(count, stamp, slot_row, heap[i], heap[p]):
            break
        _swap(heap, pos, i, p)
        i = p


@_jit
def _sift_down(heap, pos, count, stamp, slot_row, i, n):
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(count, stamp, slot_row, heap[c + 1], heap[c]):
            c += 1
        if not _less(count, stamp, slot_row, heap[c], heap[i]):
            break
        _swap(heap, pos, i, c)
        i = c


@_jit
def lfu_plan(uniq, keys, vals, slot_row, count, stamp, heap, pos, meta, call, slot_of, ins_of):
    """LFU with aging over sorted distinct rows uniq (U,); returns (hits, inserted, evictions).

    count[s]: calls that used slot s's row since it was admitted (1 at admission), halved (floor) for
    every row each time the cache has served `capacity` distinct-row lookups since the last halving.
    A miss evicts the row of fewest uses, the least recently used (stamp) among equal counts, then the
    smaller row id; never a row this call uses. heap / pos: a binary min-heap of the used slots;
    meta (2,) = [slots in use, lookups since the last halving].
    """
    mask = np.int64(keys.shape[0] - 1)
    capacity = slot_row.shape[0]
    big = np.int64(1) << np.int64(60)  # lifts the call's own rows out of reach of eviction
    hits = _lookup(uniq, keys, vals, mask, slot_of, ins_of)
    n = meta[0]
    for i in range(uniq.shape[0]):
        s = slot_of[i]
        if s >= 0:
            count[s] += 1 + big
            stamp[s] = call
            _sift_down(heap, pos, count, stamp, slot_row, pos[s], n)
    room = capacity - hits
    inserted = 0
    evictions = 0
    for i in range(uniq.shape[0]):
        if inserted >= room:
            break
        if slot_of[i] >= 0:
            continue
        if n < capacity:  # an empty slot: slots fill in order 0, 1, 2, ...
            s = n
            heap[n] = s
            pos[s] = n
            n += 1
        else:
            s = heap[0]  # the victim; never lifted (fewer than `capacity` slots are)
        evictions += _replace(keys, vals, mask, slot_row, s, uniq[i])
        count[s] = 1 + big
        stamp[s] = call
        ins_of[i] = s
        _sift_down(heap, pos, count, stamp, slot_row, pos[s], n)
        inserted += 1
    meta[0] = n
    for i in range(uniq.shape[0]):  # put the call's rows back at their true counts
        s = slot_of[i] if slot_of[i] >= 0 else ins_of[i]
        if s >= 0:
            count[s] -= big
            _sift_up(heap, pos, count, stamp, slot_row, pos[s])
    meta[1] += uniq.shape[0]
    if meta[1] >= capacity:  # aging: halve every count, then rebuild the heap (ties may reorder)
        meta[1] = 0
        for j in range(n):
            count[heap[j]] >>= 1
        for j in range(n // 2 - 1, -1, -1):
            _sift_down(heap, pos, count, stamp, slot_row, j, n)
    return hits, inserted, evictions


# ------------------------------------------------------------------------------------------- Belady
def next_use(flat: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nxt, prev) of the concatenated sorted distinct rows of B batches flat (N,) (batch b is
    flat[starts[b]:starts[b + 1]]): nxt[p] the batch that next uses entry p's row (NEVER if none),
    prev[p] the entry of the same row in the latest earlier batch (-1 if none)."""
    batch = np.repeat(np.arange(starts.shape[0] - 1, dtype=np.int64), np.diff(starts))
    order = np.argsort(flat, kind="stable")  # grouped by row, batches ascending within a row
    nxt = np.full(flat.shape[0], NEVER, dtype=np.int64)
    prev = np.full(flat.shape[0], -1, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    first, second = order[:-1][same], order[1:][same]
    nxt[first] = batch[second]
    prev[second] = first
    return nxt, prev


@_jit
def _heap_push(hk, hv, n, key, val):
    """Max-heap on key (ties: larger val first) of n entries; returns n + 1."""
    i = n
    hk[i] = key
    hv[i] = val
    while i > 0:
        p = (i - 1) >> 1
        if hk[p] > hk[i] or (hk[p] == hk[i] and hv[p] >= hv[i]):
            break
        hk[i], hk[p] = hk[p], hk[i]
        hv[i], hv[p] = hv[p], hv[i]
        i = p
    return n + 1


@_jit
def _heap_pop(hk, hv, n):
    """Drop the top of a max-heap of n entries; returns n - 1."""
    n -= 1
    hk[0] = hk[n]
    hv[0] = hv[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (hk[c + 1] > hk[c] or (hk[c + 1] == hk[c] and hv[c + 1] > hv[c])):
            c += 1
        if hk[i] > hk[c] or (hk[i] == hk[c] and hv[i] >= hv[c]):
            break
        hk[i], hk[c] = hk[c], hk[i]
        hv[i], hv[c] = hv[c], hv[i]
        i = c
    return n


@_jit
def belady_hits(flat, starts, nxt, prev, capacity, hits_per_batch):
    """Belady's optimum over batches (see `next_use`); prev[p]: the entry of the same row in its
    previous batch, or -1. Writes each batch's hits to hits_per_batch (B,).

    After each batch the cache may hold any `capacity` rows of what it held and what the batch
    fetched; keeping those used soonest again is optimal (the row used furthest in the future is
    evicted, or a miss not admitted if it is that row). Rows never used again are not kept.
    Residency is tracked per entry (a row's latest entry); the max-heap of (next use, entry) is lazy.
    Needs capacity >= 1.
    """
    n_batches = starts.shape[0] - 1
    total = flat.shape[0]
    res = np.zeros(total, dtype=np.uint8)  # 1: entry p's row is resident (p is its latest entry)
    hit = np.zeros(total, dtype=np.uint8)
    hk = np.empty(total + 1, dtype=np.int64)  # each entry is pushed at most once: no overflow
    hv = np.empty(total + 1, dtype=np.int64)
    size = 0  # heap entries (stale ones included)
    held = 0  # rows resident
    for b in range(n_batches):
        lo, hi = starts[b], starts[b + 1]
        h = 0
        for p in range(lo, hi):  # hits: the row's previous entry is resident; it moves to this entry
            q = prev[p]
            if q >= 0 and res[q]:
                h += 1
                hit[p] = 1
                res[q] = 0
                held -= 1
                if nxt[p] != NEVER:
                    res[p] = 1
                    held += 1
                    size = _heap_push(hk, hv, size, nxt[p], p)
        hits_per_batch[b] = h
        for p in range(lo, hi):  # misses: admit when a slot is free or the furthest resident is later
            if hit[p] or nxt[p] == NEVER:
                continue
            if held >= capacity:
                while not res[hv[0]]:  # stale entries (a resident row is always in the heap)
                    size = _heap_pop(hk, hv, size)
                if hk[0] <= nxt[p]:
                    continue  # this row is the one used furthest ahead: not admitted
                res[hv[0]] = 0
                size = _heap_pop(hk, hv, size)
                held -= 1
            res[p] = 1
            held += 1
            size = _heap_push(hk, hv, size, nxt[p], p)
