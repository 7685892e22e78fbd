"""Numba kernels for the n-gram hash (SPEC §4): the CPU fast path of `engram.addressing.hashing`.

`hash_range` / `hash_rows` hash a token range (over threads) a chunk of one row at a time: first
every (layer, order) mix of the chunk's tokens (`chunk_mixes`: loops over the tokens, so they
vectorise), then the rows from them with a reduction of `engram.kernels.cpu_modulo` (re-exported
here; `splitmod`, double arithmetic, so it vectorises with AVX2 as with AVX-512). `step` is one decode step of `engram.addressing.stream.HashStream` (`fastmod` per
head). Knows the layout's arrays and compressed ids, nothing of tokenizers or tables. Compiles on
first call (cached on disk). Design: docs/kernels.md.
"""

from __future__ import annotations

import numba
import numpy as np

from engram.kernels.cpu_modulo import (
    FASTMOD_MIN_PRIME,
    REDUCE_FLOOR,
    REDUCE_SPLIT,
    SPLIT_MAX_PRIME,
    SPLIT_SHIFT,
    fastmod,
    reduce_floor,
    reduce_split,
    reduction_for,
    split_tables,
    splitmod,
)
from engram.kernels.threads import run_chunks

__all__ = [
    "CHUNK",
    "FASTMOD_MIN_PRIME",
    "REDUCE_FLOOR",
    "REDUCE_SPLIT",
    "SPLIT_MAX_PRIME",
    "SPLIT_SHIFT",
    "chunk_mixes",
    "fastmod",
    "hash_range",
    "hash_rows",
    "reduction_for",
    "split_tables",
    "splitmod",
    "step",
]

STEP_OK, STEP_BAD_ID, STEP_DRAFTS_PENDING = 0, 1, 2  # step()'s return codes

# Tokens per chunk of hash_range: its look-backs and mixes (24 KiB at V4.1's 2 layers x 3 orders)
# stay in L1 between the two passes.
CHUNK = 256

_jit = numba.njit(cache=True, nogil=True)
# Helpers are inlined into the kernels at numba's IR level: an out-of-line call would pass every
# array with a reference count increment and decrement (atomics) per token. hash_range calls its
# two passes once per chunk of CHUNK tokens, where those atomics cost nothing.
_inline = numba.njit(cache=True, nogil=True, inline="always")


@_inline
def _rows_of(look, mult, primes, offsets, inv, n_heads, fast, out1, dst):
    """Rows of one token into out1[dst : dst + L*orders*K] from its look-back values look
    (max_ngram,) uint64; primes, offsets, inv flat (L*orders*K,) in (layer, order, head) order.

    Flat arrays and unsigned indices on purpose: numba adds a negative-index wrap to every signed
    index, which turns the head loop's loads into gathers and stops it vectorising, and a per-token
    array view would take a reference count (an atomic that threads sharing `out` fight over).
    """
    n_layers, n_gram = mult.shape
    uk = np.uint64(n_heads)
    col = np.uint64(0)  # (layer, order, head) column of the first head of this order
    udst = np.uint64(dst)
    for li in range(n_layers):
        mix = look[0] * np.uint64(mult[li, 0])  # uint64: wraps exactly like numpy's int64 multiply
        for o in range(n_gram - 1):
            mix ^= look[o + 1] * np.uint64(mult[li, o + 1])
            x = np.int64(mix)
            if fast and x >= 0:
                for k in range(uk):  # vectorises over the heads (4 or 8 lanes): no division
                    c = col + k
                    out1[udst + c] = fastmod(x, primes[c], inv[c]) + offsets[c]
            else:
                for k in range(uk):
                    c = col + k
                    out1[udst + c] = x % primes[c] + offsets[c]  # floor mod, as np.remainder
            col += uk


@_jit
def chunk_mixes(
    xc1,
    row0,
    t0,
    nb,
    dead,
    has_dead,
    starts,
    has_starts,
    window,
    has_window,
    b,
    pad,
    mult,
    barrier,
    ext,
    lb,
    look,
    mixes,
):
    """Every (layer, order) mix of positions t0 .. t0+nb-1 of row b into mixes[:, :nb] (L*orders,
    CHUNK) int64; returns (the barrier after the chunk, the OR of the mixes: negative if one is).

    xc1: the compressed ids flat, row b from row0; the rest as `hash_range`. barrier: the first
    position the chunk's first token may see (a start, one after a dead token, -(max_ngram-1) with a
    carried window, else 0). Scratch: ext (CHUNK + max_ngram,) uint64, lb (CHUNK,) int64, look
    (max_ngram, CHUNK) uint64. Look-back i of token j is position t0 + j - i: ext[j + w - i], or the
    pad where that is before the token's barrier lb[j] (a dead token's barrier is after itself).
    """
    n_layers, n_gram = mult.shape
    w = n_gram - 1
    upad = np.uint64(pad)
    for i in range(w):  # ext[i]: position t0 - w + i; before the row, the carried window or pads
        s = t0 - w + i
        if s >= 0:
            ext[i] = np.uint64(xc1[row0 + s])
        elif has_window:
            ext[i] = np.uint64(window[b, -s - 1])  # carried values already carry their blocking
        else:
            ext[i] = upad
    src = np.uint64(row0 + t0)
    uw = np.uint64(w)
    # unsigned indices in the token loops: numba adds a negative-index wrap to every signed index,
    # which turns their loads into gathers and stops them vectorising
    for j in range(np.uint64(nb)):
        ext[uw + j] = np.uint64(xc1[src + j])
    masked = has_dead or has_starts
    if masked:
        for j in range(nb):  # sticky: nothing before the latest start or dead token is visible
            t = t0 + j
            if has_starts and starts[b, t]:
                barrier = t
            if has_dead and dead[b, t]:
                barrier = t + 1  # the token itself too: a dead token sees only pads
            lb[j] = barrier
    for i in range(n_gram):
        base = np.uint64(w - i)
        if masked:
            for j in range(nb):
                look[i, j] = ext[base + np.uint64(j)] if t0 + j - i >= lb[j] else upad
        else:
            for j in range(np.uint64(nb)):
                look[i, j] = ext[base + j]
    neg = np.uint64(0)
    q = 0
    for li in range(n_layers):
        m0 = np.uint64(mult[li, 0])
        m1 = np.uint64(mult[li, 1])
        for j in range(np.uint64(nb)):
            mix = (look[0, j] * m0) ^ (look[1, j] * m1)  # uint64: wraps like numpy's int64 multiply
            mixes[q, j] = np.int64(mix)
            neg |= mix
        for o in range(1, w):
            m = np.uint64(mult[li, o + 1])
            for j in range(np.uint64(nb)):
                mix = np.uint64(mixes[q, j]) ^ (look[o + 1, j] * m)
                mixes[q + 1, j] = np.int64(mix)
                neg |= mix
            q += 1
        q += 1
    return barrier, neg


@_jit
def hash_range(
    xc,
    dead,
    has_dead,
    starts,
    has_starts,
    window,
    has_window,
    pad,
    mult,
    primes,
    offsets,
    n_heads,
    reduce,
    wrap,
    inv_hi,
    pf,
    out,
    start,
    end,
):
    """Rows of flat tokens [start, end) (token f is xc[f // T, f % T]) into out (B, T, L, orders*K).

    xc (B, T) int64 compressed ids; dead (B, T) bool, read only if has_dead; starts (B, T) bool,
    read only if has_starts (True: a window restarts there, hiding everything before); window
    (B, max_ngram-1) int64, the carried look-back before xc[:, 0] (column 0 most recent, read only
    if has_window, else all pads); mult (L, max_ngram) int64; primes, offsets (L*orders*K,) int64
    in (layer, order, head) order; reduce: `reduction_for(primes)`; wrap, inv_hi, pf:
    `split_tables(primes)` (read for REDUCE_SPLIT). A chunk with a negative mix (ids off the
    spec's domain) takes REDUCE_FLOOR.
    """
    n_tok = xc.shape[1]
    n_layers, n_gram = mult.shape
    w = n_gram - 1
    width = primes.shape[0]
    out1 = out.reshape(-1)  # one view per call
    xc1 = xc.reshape(-1)
    ext = np.empty(CHUNK + n_gram, dtype=np.uint64)
    lb = np.empty(CHUNK, dtype=np.int64)
    look = np.empty((n_gram, CHUNK), dtype=np.uint64)
    mixes = np.empty((n_layers * w, CHUNK), dtype=np.int64)
    f = start
    while f < end:
        b = f // n_tok
        row0 = b * n_tok
        t0 = f - row0
        t_end = min(n_tok, end - row0)
        barrier = -w if has_window else 0
        if has_dead or has_starts:  # a range that starts mid-row: the barriers within reach
            for s in range(max(0, t0 - w), t0):
                if has_starts and starts[b, s]:
                    barrier = s
                if has_dead and dead[b, s]:
                    barrier = s + 1
        while t0 < t_end:
            nb = min(CHUNK, t_end - t0)
            barrier, neg = chunk_mixes(
                xc1,
                row0,
                t0,
                nb,
                dead,
                has_dead,
                starts,
                has_starts,
                window,
                has_window,
                b,
                pad,
                mult,
                barrier,
                ext,
                lb,
                look,
                mixes,
            )
            dst = (row0 + t0) * width
            if np.int64(neg) < 0 or reduce == REDUCE_FLOOR:
                reduce_floor(mixes, nb, primes, offsets, n_heads, out1, dst)
            else:
                reduce_split(mixes, nb, wrap, inv_hi, pf, offsets, n_heads, out1, dst)
            t0 += nb
        f = row0 + t_end


@_jit
def step(
    ids,
    lookup,
    dead,
    has_dead,
    starts,
    has_starts,
    restart_id,
    window,
    position,
    n_draft,
    pad,
    mult,
    primes,
    offsets,
    inv,
    n_heads,
    fast,
    look,
    out,
):
    """One decode step of B sequences, in place: returns (0, -1), or (code, b) and changes nothing.

    ids (B,) int64 tokenizer ids; lookup (vocab,) int64 compression map; dead (B,) bool (read if
    has_dead); starts (B,) bool (read if has_starts: the token begins a new window); restart_id: the
    window after this id restarts (-1: none); window (B, max_ngram-1) int64 and position (B,) int64 are updated in place;
    n_draft (B,) int64 must be all 0; look (max_ngram,) uint64 scratch; out (B, L, orders*K);
    the layout arrays as in `hash_range`.
    Codes: STEP_BAD_ID (ids[b] outside [0, vocab)), STEP_DRAFTS_PENDING (sequence b has drafts).
    """
    n_seq = ids.shape[0]
    vocab = lookup.shape[0]
    n_win = window.shape[1]
    width = primes.shape[0]
    for b in range(n_seq):  # validate everything before touching any state: ids first, as feed()
        if ids[b] < 0 or ids[b] >= vocab:
            return STEP_BAD_ID, b
    for b in range(n_seq):
        if n_draft[b] != 0:
            return STEP_DRAFTS_PENDING, b
    out1 = out.reshape(-1)
    upad = np.uint64(pad)
    for b in range(n_seq):
        is_dead = has_dead and dead[b]
        is_start = has_starts and starts[b]
        x0 = pad if is_dead else lookup[ids[b]]
        look[0] = np.uint64(x0)
        for i in range(n_win):
            look[i + 1] = upad if is_dead or is_start else np.uint64(window[b, i])
        _rows_of(look, mult, primes, offsets, inv, n_heads, fast, out1, b * width)
        if is_dead or ids[b] == restart_id:  # sticky: nothing before is visible after it
            for i in range(n_win):
                window[b, i] = pad
        else:
            for i in range(n_win - 1, 0, -1):
                window[b, i] = pad if is_start else window[b, i - 1]
            if n_win > 0:
                window[b, 0] = x0
        position[b] += 1
    return STEP_OK, -1


def hash_rows(
    xc: np.ndarray,
    dead: np.ndarray | None,
    window: np.ndarray | None,
    pad: int,
    mult: np.ndarray,
    primes: np.ndarray,
    offsets: np.ndarray,
    n_heads: int,
    reduce: int,
    split: tuple[np.ndarray, np.ndarray, np.ndarray],
    out: np.ndarray,
    threads: int = 1,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """Fill out (B, T, L, orders*K) with the rows of xc (B, T), split over `threads` threads.

    reduce: `reduction_for(primes)` (or REDUCE_FLOOR: the rows are the same);
    split: `split_tables(primes)`. starts: (B, T) bool or None, True where a window restarts (see
    `hash_range`).

    Every array must be C-contiguous with the dtypes `hash_range` documents; out int64 or int32.
    Each thread takes a contiguous range of tokens: the result does not depend on `threads`.
    """
    n = xc.size
    has_dead = dead is not None
    has_window = window is not None
    dead_arr = dead if dead is not None else np.zeros((1, 1), dtype=np.bool_)
    win_arr = window if window is not None else np.zeros((1, 1), dtype=np.int64)
    has_starts = starts is not None
    starts_arr = starts if starts is not None else np.zeros((1, 1), dtype=np.bool_)
    args = (
        xc,
        dead_arr,
        has_dead,
        starts_arr,
        has_starts,
        win_arr,
        has_window,
        pad,
        mult,
        primes,
        offsets,
        n_heads,
        reduce,
        *split,
        out,
    )
    run_chunks(hash_range, args, n, threads)
    return out
