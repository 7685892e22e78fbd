"""Numba kernels of `engram.systems.cache.RowCache`: the host-side index of the hot-row cache.

An open-addressing map row -> slot and an intrusive LRU list over the slots, so a call costs
O(distinct rows), never O(capacity); plus the byte-row scatter a CPU cache writes with, and
`unique_rows`, a call's sorted distinct rows and inverse index on one thread (torch.unique's
thread pool stalls for hundreds of ms when a loaded machine has no core free for it). Knows
slots and row ids, nothing of the rows' bytes or devices. Compiles on first call (cached on
disk) and releases the GIL. Design: docs/kernels.md.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = [
    "EMPTY",
    "map_delete",
    "map_find",
    "map_home",
    "map_insert",
    "new_state",
    "plan",
    "scatter_rows",
    "unique_rows",
]

EMPTY = -1  # an empty map key / an empty slot's row
_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads consecutive row ids

_jit = numba.njit(cache=True, nogil=True)


def new_state(capacity: int) -> tuple[np.ndarray, ...]:
    """(keys, vals, slot_row, prev, nxt, ends) of an empty cache of `capacity` slots.

    The list runs head = slot 0 ... tail = slot capacity-1 reversed, so that the first rows
    inserted take slots 0, 1, 2, ... (the tail is evicted, i.e. filled, first).
    """
    size = 1 << max(1, int(2 * capacity - 1).bit_length())  # power of two >= 2 * capacity
    keys = np.full(size, EMPTY, dtype=np.int64)
    vals = np.zeros(size, dtype=np.int64)
    slot_row = np.full(capacity, EMPTY, dtype=np.int64)
    # list order head -> tail: capacity-1, ..., 1, 0 (so slot 0 is the tail, filled first)
    idx = np.arange(capacity, dtype=np.int64)
    nxt = idx - 1  # towards the tail; slot 0's next is -1
    prev = idx + 1  # towards the head
    prev[capacity - 1] = -1
    ends = np.array([capacity - 1, 0], dtype=np.int64)  # [head, tail]
    return keys, vals, slot_row, prev, nxt, ends


@_jit
def map_home(key, mask):
    """Where `key`'s probe run starts in a map of mask + 1 entries (Fibonacci hashing)."""
    return np.int64((np.uint64(key) * _FIB) >> np.uint64(20)) & mask


@_jit
def map_find(keys, mask, key):
    """Map index holding `key`, or -1."""
    i = map_home(key, mask)
    while keys[i] != EMPTY:
        if keys[i] == key:
            return i
        i = (i + 1) & mask
    return -1


@_jit
def map_delete(keys, vals, mask, i):
    """Remove the entry at map index i, shifting later entries of its probe run back (no tombstones)."""
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            break
        k = map_home(keys[j], mask)
        # the entry at j may move to i only if its home k is not cyclically within (i, j]
        if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
            continue
        keys[i] = keys[j]
        vals[i] = vals[j]
        i = j
    keys[i] = EMPTY


@_jit
def map_insert(keys, vals, mask, key, val):
    i = map_home(key, mask)
    while keys[i] != EMPTY:
        i = (i + 1) & mask
    keys[i] = key
    vals[i] = val


@_jit
def _unlink(prev, nxt, ends, s):
    p, n = prev[s], nxt[s]
    if p >= 0:
        nxt[p] = n
    else:
        ends[0] = n
    if n >= 0:
        prev[n] = p
    else:
        ends[1] = p


@_jit
def _push_front(prev, nxt, ends, s):
    head = ends[0]
    prev[s] = -1
    nxt[s] = head
    if head >= 0:
        prev[head] = s
    else:
        ends[1] = s
    ends[0] = s


@_jit
def plan(uniq, keys, vals, slot_row, prev, nxt, ends, slot_of, ins_of):
    """Look up and admit the sorted distinct rows `uniq` (U,); return (hits, inserted, evictions).

    Writes slot_of[i] = the cached slot of uniq[i] (a hit) or -1, and ins_of[i] = the slot uniq[i]
    was just given (a miss admitted to the cache) or -1 (a hit, or a miss that did not fit).
    Order of recency within the call: hits are touched first, then misses are admitted in ascending
    row order, so the call's last admitted miss is the most recent row. At most
    capacity - hits misses are admitted: the rest would evict rows this very call uses.
    """
    mask = np.int64(keys.shape[0] - 1)
    capacity = slot_row.shape[0]
    n = uniq.shape[0]
    hits = 0
    for i in range(n):  # (1) look up
        at = map_find(keys, mask, uniq[i])
        slot_of[i] = vals[at] if at >= 0 else -1
        ins_of[i] = -1
        if at >= 0:
            hits += 1
    for i in range(n):  # (2) touch the hits: they move to the head, away from eviction
        s = slot_of[i]
        if s >= 0:
            _unlink(prev, nxt, ends, s)
            _push_front(prev, nxt, ends, s)
    room = capacity - hits
    inserted = 0
    evictions = 0
    for i in range(n):  # (3) admit misses while they fit, evicting from the tail
        if inserted >= room:
            break
        if slot_of[i] >= 0:
            continue
        s = ends[1]  # least recently used; never a slot this call touched (see `room`)
        old = slot_row[s]
        if old != EMPTY:
            map_delete(keys, vals, mask, map_find(keys, mask, old))
            evictions += 1
        map_insert(keys, vals, mask, uniq[i], s)
        slot_row[s] = uniq[i]
        _unlink(prev, nxt, ends, s)
        _push_front(prev, nxt, ends, s)
        ins_of[i] = s
        inserted += 1
    return hits, inserted, evictions


@_jit
def scatter_rows(dst, slots, src):
    """dst[slots[i], :] = src[i, :] for uint8 rows dst (C, W), src (I, W), slots (I,) int64 in [0, C)."""
    width = dst.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        for c in range(width):
            dst[s, c] = src[i, c]


@_jit
def _first_seen(ids, num_rows, keys, vals, uniq, inverse):
    """Distinct ids in order of first occurrence into uniq, each position's index into it into inverse;
    returns (distinct count, -1), or (-1, position) of the first id outside [0, num_rows)."""
    mask = np.int64(keys.shape[0] - 1)
    u = 0
    for i in range(ids.shape[0]):
        r = np.int64(ids[i])
        if r < 0 or r >= num_rows:
            return -1, i
        h = map_home(r, mask)
        while True:
            k = keys[h]
            if np.int64(k) == r:
                inverse[i] = vals[h]
                break
            if np.int64(k) == EMPTY:
                keys[h] = r
                vals[h] = u
                uniq[u] = r
                inverse[i] = u
                u += 1
                break
            h = (h + 1) & mask
    return u, -1


@_jit
def _remap(inverse, rank):
    for i in range(inverse.shape[0]):
        inverse[i] = rank[inverse[i]]


def unique_rows(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(uniq, inverse, bad): the sorted distinct ids (U,) int64 of ids (n,) int64/int32 and each position's
    index into them (n,) int64, as torch.unique(sorted=True, return_inverse=True); bad = the position of
    the first id outside [0, num_rows) (uniq and inverse then meaningless), else -1. One thread, O(n)."""
    n = ids.shape[0]
    size = 1 << max(1, int(2 * n - 1).bit_length())  # power of two >= 2n: at most half full
    small = num_rows < 2**31  # 4-byte keys and values: half the map's cache footprint
    keys = np.full(size, EMPTY, dtype=np.int32 if small else np.int64)
    vals = np.empty(size, dtype=np.int32 if small else np.int64)
    uniq = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    u, bad = _first_seen(ids, np.int64(num_rows), keys, vals, uniq, inverse)
    if bad >= 0:
        return uniq[:0], inverse, int(bad)
    order = np.argsort(uniq[:u], kind="stable")  # U log U on the distinct rows only
    rank = np.empty(u, dtype=np.int64)
    rank[order] = np.arange(u, dtype=np.int64)
    _remap(inverse, rank)
    return uniq[:u][order], inverse, -1
