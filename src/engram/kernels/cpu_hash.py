"""Numba kernels for the n-gram hash (SPEC §4): the CPU fast path of `engram.addressing.hashing`.

`hash_range` / `hash_rows` hash a token range (over threads), `step` is one decode step of
`engram.addressing.stream.HashStream`; both reduce with `fastmod`, an exact division-free modulo
for primes >= FASTMOD_MIN_PRIME. Knows the layout's arrays and compressed ids, nothing of
tokenizers or tables. Compiles on first call (cached on disk). Design: docs/kernels.md; the
modulo's proof: docs/addressing.md.
"""

from __future__ import annotations

import numba
import numpy as np

from engram.kernels.threads import run_chunks

__all__ = ["FASTMOD_MIN_PRIME", "fastmod", "hash_range", "hash_rows", "step"]

FASTMOD_MIN_PRIME = 4096  # > 3073, the bound on |x - q*p| outside [0, p) proven in docs/addressing.md

STEP_OK, STEP_BAD_ID, STEP_DRAFTS_PENDING = 0, 1, 2  # step()'s return codes

_jit = numba.njit(cache=True, nogil=True)
# Helpers are inlined into the kernels at numba's IR level: an out-of-line call would pass every
# array with a reference count increment and decrement (atomics) per token.
_inline = numba.njit(cache=True, nogil=True, inline="always")


@_inline
def fastmod(x: int, p: int, inv: float) -> int:
    """x mod p for 0 <= x < 2^63 and FASTMOD_MIN_PRIME <= p < 2^63, inv = 1.0 / p (module doc)."""
    q = np.int64(np.float64(x) * inv)  # floor(x/p) + {-1, 0, 1}
    r = np.int64(np.uint64(x) - np.uint64(q) * np.uint64(p))  # exact mod 2^64; the true r fits int64
    r += p & (r >> 63)  # + p where r < 0 (branch-free, so the head loop vectorises)
    r -= p & ~((r - p) >> 63)  # - p where r >= p
    return r


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
    inv,
    n_heads,
    fast,
    out,
    start,
    end,
):
    """Rows of flat tokens [start, end) (token f is xc[f // T, f % T]) into out (B, T, L, orders*K).

    xc (B, T) int64 compressed ids; dead (B, T) bool, read only if has_dead; starts (B, T) bool,
    read only if has_starts (True: a window restarts there, hiding everything before); window
    (B, max_ngram-1) int64, the carried look-back before xc[:, 0] (column 0 most recent, read only
    if has_window, else all pads); mult (L, max_ngram) int64; primes, offsets (L*orders*K,) int64
    and inv = 1.0 / primes in (layer, order, head) order; fast: every prime >= FASTMOD_MIN_PRIME.
    """
    n_tok = xc.shape[1]
    n_gram = mult.shape[1]
    width = primes.shape[0]  # L * orders * K columns per token
    out1 = out.reshape(-1)  # one view per call
    look = np.empty(n_gram, dtype=np.uint64)
    upad = np.uint64(pad)
    b = start // n_tok
    t = start - b * n_tok
    for f in range(start, end):
        blocked = has_dead and dead[b, t]  # a dead token sees only pads
        look[0] = upad if blocked else np.uint64(xc[b, t])
        for i in range(1, n_gram):
            s = t - i
            if has_starts and not blocked and s >= -1 and starts[b, s + 1]:
                blocked = True  # a window starts after position s: s and everything farther are pads
            if s >= 0:
                if not blocked and has_dead and dead[b, s]:
                    blocked = True  # sticky: this look-back and every farther one are pads
                look[i] = upad if blocked else np.uint64(xc[b, s])
            elif blocked or not has_window:
                look[i] = upad
            else:
                look[i] = np.uint64(window[b, -s - 1])  # carried values already carry their blocking
        _rows_of(look, mult, primes, offsets, inv, n_heads, fast, out1, f * width)
        t += 1
        if t == n_tok:
            t = 0
            b += 1


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
    inv: np.ndarray,
    n_heads: int,
    fast: bool,
    out: np.ndarray,
    threads: int = 1,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """Fill out (B, T, L, orders*K) with the rows of xc (B, T), split over `threads` threads.

    starts: (B, T) bool or None, True where a window restarts (see `hash_range`).

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
        inv,
        n_heads,
        fast,
        out,
    )
    run_chunks(hash_range, args, n, threads)
    return out
