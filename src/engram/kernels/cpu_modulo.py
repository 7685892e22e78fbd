"""The exact division-free reductions of the n-gram hash (SPEC §4, `mix mod p`) on the CPU, and the
loops of `engram.kernels.cpu_hash.hash_range` that apply them to a chunk of mixes.

`splitmod` (double arithmetic only, so the heads loop vectorises with AVX2 as with AVX-512) and
`fastmod` (int64 arithmetic, used by the decode step; vectorises only with AVX-512DQ) give x mod p
exactly without a division. `reduce_split` writes a chunk's rows with `splitmod`, `reduce_floor`
with the hardware `%` (any mix, any prime); `reduction_for` says which a layout takes. Knows
primes, offsets and mixes, nothing of tokens or look-backs. Proofs: docs/addressing.md; design:
docs/kernels.md.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = [
    "FASTMOD_MIN_PRIME",
    "REDUCE_FLOOR",
    "REDUCE_SPLIT",
    "SPLIT_MAX_PRIME",
    "SPLIT_SHIFT",
    "fastmod",
    "reduce_floor",
    "reduce_split",
    "reduction_for",
    "split_tables",
    "splitmod",
]

FASTMOD_MIN_PRIME = 4096  # > 3073, the bound on |x - q*p| outside [0, p) proven in docs/addressing.md
SPLIT_MAX_PRIME = 2**31  # splitmod: primes below it (its remainder goes through int32)
SPLIT_SHIFT = 48  # splitmod: x = hi * 2^48 + lo
REDUCE_FLOOR, REDUCE_SPLIT = 0, 1  # reduction_for's answers

_jit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, nogil=True, inline="always")  # inlined at numba's IR level


def reduction_for(primes: np.ndarray) -> int:
    """hash_range's reduction for these primes: REDUCE_SPLIT where `splitmod` holds (every prime in
    [1, SPLIT_MAX_PRIME), as in every preset), else REDUCE_FLOOR. Both give the same rows."""
    return REDUCE_SPLIT if int(primes.min()) >= 1 and int(primes.max()) < SPLIT_MAX_PRIME else REDUCE_FLOOR


def split_tables(primes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(2^48 mod p, inv_hi, p) as float64 arrays, what `splitmod` takes for each prime p >= 1;
    inv_hi = fl(fl(1/p) * (1 + 2^-50)), just above 1/p (docs/addressing.md)."""
    p = np.asarray(primes, dtype=np.int64)
    wrap = (np.uint64(1 << SPLIT_SHIFT) % p.astype(np.uint64)).astype(np.float64)
    inv_hi = (1.0 / p.astype(np.float64)) * (1.0 + 2.0**-50)
    return wrap, inv_hi, p.astype(np.float64)


@_inline
def fastmod(x: int, p: int, inv: float) -> int:
    """x mod p for 0 <= x < 2^63 and FASTMOD_MIN_PRIME <= p < 2^63, inv = 1.0 / p (docs/addressing.md)."""
    q = np.int64(np.float64(x) * inv)  # floor(x/p) + {-1, 0, 1}
    r = np.int64(np.uint64(x) - np.uint64(q) * np.uint64(p))  # exact mod 2^64; the true r fits int64
    r += p & (r >> 63)  # + p where r < 0 (branch-free, so the head loop vectorises)
    r -= p & ~((r - p) >> 63)  # - p where r >= p
    return r


@_inline
def splitmod(hi: float, lo: float, wrap: float, inv_hi: float, p: float) -> int:
    """x mod p for 0 <= x < 2^63 and 1 <= p < SPLIT_MAX_PRIME, as int64, in double arithmetic
    only: hi = x >> 48 and lo = x & (2^48 - 1) as doubles, (wrap, inv_hi, p) from `split_tables`.
    y = hi*wrap + lo = x (mod p) is below 2^49, so every product is exact and trunc(y*inv_hi) is
    floor(y/p) (docs/addressing.md)."""
    y = hi * wrap + lo
    r = y - np.trunc(y * inv_hi) * p  # exact, in [0, p)
    return np.int64(np.int32(r))  # via int32: AVX2 converts doubles to int32 lanes, not int64


@_jit
def reduce_split(mixes, nb, wrap, inv_hi, pf, offsets, n_heads, out1, dst):
    """out1[dst + j*width + c] = mixes[c // K, j] mod p[c] + offsets[c] for the chunk's nb tokens
    (mixes >= 0; wrap, inv_hi, pf: `split_tables(primes)`, every prime below SPLIT_MAX_PRIME).

    The heads loop is double arithmetic and one double -> int32 conversion: AVX2 vectorises it as
    AVX-512 does. Tokens go in pairs, one heads loop for both: one loop's overhead and one load of
    the tables (1.2-1.3x). The second token's row is the next one, a distance LLVM sees:
    min(j + 1, nb - 1) for an odd last token instead of the tail loop cost up to 13 %.
    """
    n_lo = mixes.shape[0]
    uk = np.uint64(n_heads)
    uw = np.uint64(pf.shape[0])
    udst = np.uint64(dst)
    low = np.uint64((1 << SPLIT_SHIFT) - 1)
    shift = np.uint64(SPLIT_SHIFT)
    j = 0
    while j + 2 <= nb:
        udst1 = udst + uw
        col = np.uint64(0)
        for q in range(n_lo):
            x0 = np.uint64(mixes[q, j])
            x1 = np.uint64(mixes[q, j + 1])
            hi0 = np.float64(np.int64(x0 >> shift))
            lo0 = np.float64(np.int64(x0 & low))
            hi1 = np.float64(np.int64(x1 >> shift))
            lo1 = np.float64(np.int64(x1 & low))
            for k in range(uk):
                c = col + k
                wr = wrap[c]
                ih = inv_hi[c]
                p = pf[c]
                off = offsets[c]
                out1[udst + c] = splitmod(hi0, lo0, wr, ih, p) + off
                out1[udst1 + c] = splitmod(hi1, lo1, wr, ih, p) + off
            col += uk
        udst += uw + uw
        j += 2
    if j < nb:  # an odd last token
        col = np.uint64(0)
        for q in range(n_lo):
            x = np.uint64(mixes[q, j])
            hi = np.float64(np.int64(x >> shift))
            lo = np.float64(np.int64(x & low))
            for k in range(uk):
                c = col + k
                out1[udst + c] = splitmod(hi, lo, wrap[c], inv_hi[c], pf[c]) + offsets[c]
            col += uk


@_jit
def reduce_floor(mixes, nb, primes, offsets, n_heads, out1, dst):
    """`reduce_split` with the hardware `%` (floor mod, as np.remainder): any mix, any prime."""
    n_lo = mixes.shape[0]
    uk = np.uint64(n_heads)
    uw = np.uint64(primes.shape[0])
    udst = np.uint64(dst)
    for j in range(nb):
        col = np.uint64(0)
        for q in range(n_lo):
            x = mixes[q, j]
            for k in range(uk):
                c = col + k
                out1[udst + c] = x % primes[c] + offsets[c]
            col += uk
        udst += uw
