"""The passes of the Sinkhorn-balanced update (SPEC §7b) over a table's active rows, as numba kernels.

`model.sinkhorn.SparseSinkhorn` keeps the momentum of the rows whose momentum is nonzero (the active
set, A rows of n features) and calls, once a step: `merge` (the gradient's rows join the sorted active
set; new rows are merged in place into room kept after the arrays, so a growing set needs no fresh
memory most steps), `blend` (momentum and the Nesterov blend into one (A, n) workspace, with each
row's norm), `rows` (the mask and the first row normalisation, giving the
column sums of squares), then `cols_rows` once per column / row pair but the last (K = 11: four),
`cols_rows_apply` for the last pair (its final row normalisation writes each kept row's update
W[rows[i]] -= step * u_i straight away, the same float operations as `cols_rows` then `apply`), and
`compact` (rows whose momentum underflowed to zero leave, in place). `apply` alone serves K = 1.
Every pass is one sweep over the workspace in place: the K normalisations never copy it. Column
sums are returned per call, so a row-sharded table can all-reduce them between passes (n numbers).
Sums are taken in float64. The plain torch version of the whole update is `reference.sinkhorn_update`.

W's rows (sorted, but scattered over a table of gigabytes) are cache and TLB misses: the passes that
write W prefetch the row `PREFETCH` active rows ahead (LLVM's `llvm.prefetch`, `_prefetch_w`), so
the misses overlap (measured on a 64M x 16 fp32 table with 7.3M sorted random active rows: the apply
alone 44 -> 15 ns a row; the last pair and the apply, fused, 22-29 ns a row against 52-79 as two passes).
Compiles on first call (cached on disk). Design: docs/model.md.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.core.extending import intrinsic

from engram.kernels.threads import resolve_threads, run_chunks

__all__ = [
    "PARALLEL_MIN",
    "PREFETCH",
    "apply",
    "blend",
    "cols_rows",
    "cols_rows_apply",
    "compact",
    "merge",
    "rows",
]

PARALLEL_MIN = 4096  # active rows from which a pass splits over every core
PREFETCH = 24  # the passes writing W prefetch the W row of the active row this far ahead

_jit = numba.njit(cache=True, nogil=True)


@intrinsic
def _prefetch_w(typingctx, addr):  # pragma: no cover - numba
    """Prefetch the cache line at the integer address `addr` for writing (LLVM's `llvm.prefetch`: a
    hint, never a fault; x86 `prefetchw`)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        # (address, 1: for writing, 3: keep in every cache level, 1: data)
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(addr), codegen


@_jit
def _blend_range(mom, gidx, grad, beta, u, rho, start, end):  # pragma: no cover - numba
    """Rows start..end: mom (A, n) <- beta * mom + (1 - beta) * g, u <- beta * mom + (1 - beta) * g
    (g = grad[gidx[i]], or zeros where gidx[i] < 0), rho[i] <- ||u_i||; returns the rows' rho sum and
    how many of them now have zero momentum (they leave the active set)."""
    n = mom.shape[1]
    b1 = 1.0 - beta
    total = 0.0
    zero_rows = 0
    for i in range(start, end):
        k = gidx[i]
        s = 0.0
        nonzero = False
        if k >= 0:
            for j in range(n):
                g = grad[k, j]
                mom[i, j] = beta * mom[i, j] + b1 * g  # stored in the state's dtype (rounded)
                m = mom[i, j]
                u[i, j] = beta * m + b1 * g
                v = u[i, j]
                s += np.float64(v) * v
                nonzero = nonzero or m != 0
        else:
            for j in range(n):
                mom[i, j] = beta * mom[i, j]
                m = mom[i, j]
                u[i, j] = beta * m
                v = u[i, j]
                s += np.float64(v) * v
                nonzero = nonzero or m != 0
        r = math.sqrt(s)
        rho[i] = r
        total += r
        if not nonzero:
            zero_rows += 1
    return total, zero_rows


@_jit
def _rows_range(u, rho, thresh, eps, keep, start, end):  # pragma: no cover - numba
    """Rows start..end: rows with rho <= thresh set to 0 (keep False), the others divided by
    (rho + eps); returns their column sums of squares (n,) float64."""
    n = u.shape[1]
    colsq = np.zeros(n, dtype=np.float64)
    for i in range(start, end):
        if rho[i] <= thresh:
            keep[i] = False
            for j in range(n):
                u[i, j] = 0.0
            continue
        keep[i] = True
        inv = 1.0 / (rho[i] + eps)
        for j in range(n):
            u[i, j] = u[i, j] * inv
            v = u[i, j]
            colsq[j] += np.float64(v) * v
    return colsq


@_jit
def _cols_rows_range(u, colinv, keep, eps, want_colsq, start, end):  # pragma: no cover - numba
    """Rows start..end of the kept rows: u_ij *= colinv_j, then each row divided by (its norm + eps);
    returns the new column sums of squares (zeros unless want_colsq)."""
    n = u.shape[1]
    colsq = np.zeros(n, dtype=np.float64)
    for i in range(start, end):
        if not keep[i]:
            continue
        s = 0.0
        for j in range(n):
            u[i, j] = u[i, j] * colinv[j]
            v = u[i, j]
            s += np.float64(v) * v
        inv = 1.0 / (math.sqrt(s) + eps)
        for j in range(n):
            u[i, j] = u[i, j] * inv
            v = u[i, j]
            if want_colsq:
                colsq[j] += np.float64(v) * v
    return colsq


@_jit
def _cols_rows_apply_range(u, colinv, keep, eps, w, rows, step, start, end):  # pragma: no cover - numba
    """The last column / row pair of rows start..end fused with the apply: for each kept row, u_ij *=
    colinv_j, the row divided by (its norm + eps), then w[rows[i]] -= step * u[i] (the same operations
    as `_cols_rows_range` then `_apply_range`); W's row PREFETCH rows ahead is prefetched."""
    n = u.shape[1]
    base, stride = w.ctypes.data, w.strides[0]
    ahead = end - PREFETCH
    for i in range(start, end):
        if i < ahead:
            _prefetch_w(base + rows[i + PREFETCH] * stride)
        if not keep[i]:
            continue
        s = 0.0
        for j in range(n):
            u[i, j] = u[i, j] * colinv[j]
            v = u[i, j]
            s += np.float64(v) * v
        inv = 1.0 / (math.sqrt(s) + eps)
        r = rows[i]
        for j in range(n):
            u[i, j] = u[i, j] * inv
            w[r, j] = w[r, j] - step * u[i, j]


@_jit
def _apply_range(w, rows, u, keep, step, start, end):  # pragma: no cover - numba
    """w[rows[i]] -= step * u[i] for the kept rows start..end (w float32 or float64); W's row
    PREFETCH rows ahead is prefetched."""
    n = u.shape[1]
    base, stride = w.ctypes.data, w.strides[0]
    ahead = end - PREFETCH
    for i in range(start, end):
        if i < ahead:
            _prefetch_w(base + rows[i + PREFETCH] * stride)
        if keep[i]:
            r = rows[i]
            for j in range(n):
                w[r, j] = w[r, j] - step * u[i, j]


@_jit
def _count_new(rows, grows):  # pragma: no cover - numba
    """How many of the sorted distinct ids `grows` are not in the sorted distinct ids `rows`."""
    i, new = 0, 0
    for j in range(grows.shape[0]):
        while i < rows.shape[0] and rows[i] < grows[j]:
            i += 1
        if i < rows.shape[0] and rows[i] == grows[j]:
            i += 1
        else:
            new += 1
    return new


@_jit
def _merge_into(rows, mom, grows, out_rows, out_mom, gidx):  # pragma: no cover - numba
    """The union of sorted `rows` (with their momentum) and `grows` (new rows: zero momentum) into
    out_rows / out_mom; gidx[k]: the index in grows of out_rows[k], or -1."""
    a, r, n = rows.shape[0], grows.shape[0], mom.shape[1]
    i = j = k = 0
    while i < a or j < r:
        take_old = j == r or (i < a and rows[i] <= grows[j])
        take_new = i == a or (j < r and grows[j] <= rows[i])
        if take_old:
            out_rows[k] = rows[i]
            for c in range(n):
                out_mom[k, c] = mom[i, c]
            i += 1
        else:
            out_rows[k] = grows[j]
            for c in range(n):
                out_mom[k, c] = 0.0
        if take_new:
            gidx[k] = j
            j += 1
        else:
            gidx[k] = -1
        k += 1


@_jit
def _merge_back(rows, mom, a, total, grows, gidx):  # pragma: no cover - numba
    """`_merge_into` in place: rows[:a] / mom[:a] (sorted, with their momentum) become the union with
    `grows` (`total` rows) in rows[:total] / mom[:total], filled from the back (a row only moves back, to a place
    already read: nothing is overwritten before it is read; the rows before the first new one stay)."""
    n = mom.shape[1]
    i, j = a - 1, grows.shape[0] - 1
    k = total - 1
    while j >= 0:
        if i >= 0 and rows[i] >= grows[j]:
            if k != i:
                rows[k] = rows[i]
                for c in range(n):
                    mom[k, c] = mom[i, c]
            if rows[i] == grows[j]:
                gidx[k] = j
                j -= 1
            else:
                gidx[k] = -1
            i -= 1
        else:
            rows[k] = grows[j]
            for c in range(n):
                mom[k, c] = 0.0
            gidx[k] = j
            j -= 1
        k -= 1
    for q in range(i + 1):  # every gradient row placed: k == i, the rest stays where it is
        gidx[q] = -1


@_jit
def _locate(rows, grows, gidx):  # pragma: no cover - numba
    """gidx[i] = the index in grows of rows[i] (every id of grows is in rows), else -1."""
    gidx[:] = -1
    i = 0
    for j in range(grows.shape[0]):
        while rows[i] < grows[j]:
            i += 1
        gidx[i] = j


@_jit
def _compact(rows, mom):  # pragma: no cover - numba
    """Move the rows of nonzero momentum to the front, in order; returns how many there are."""
    n = mom.shape[1]
    k = 0
    for i in range(rows.shape[0]):
        alive = False
        for c in range(n):
            if mom[i, c] != 0:
                alive = True
                break
        if alive:
            if k != i:
                rows[k] = rows[i]
                for c in range(n):
                    mom[k, c] = mom[i, c]
            k += 1
    return k


def _room(buf: np.ndarray | None, need: int, tail: tuple[int, ...], dtype: Any, grow: float) -> np.ndarray:
    """The first `need` rows of `buf` where it has them, else of a new array of grow x `need` rows."""
    if buf is not None and buf.shape[0] >= need and buf.shape[1:] == tail and buf.dtype == dtype:
        return buf[:need]
    return np.empty((max(need, int(grow * need)), *tail), dtype=dtype)[:need]


def merge(
    rows: np.ndarray,
    mom: np.ndarray,
    grows: np.ndarray,
    rows_room: np.ndarray | None = None,
    mom_room: np.ndarray | None = None,
    gidx_room: np.ndarray | None = None,
    grow: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(active rows, their momentum, gidx) after adding the sorted distinct gradient rows `grows` to
    the sorted active set: the same arrays when nothing is new, else the union (one linear pass).

    Without rooms the union is new arrays. `rows_room` / `mom_room`: arrays whose first A rows are
    `rows` / `mom` (the same memory) and that go on past them: the union is merged into them in place
    (from the back) when it fits, else into new arrays of `grow` x its rows. `gidx_room`: gidx is its
    prefix when it is long enough, else a new array of `grow` x its rows. Whatever is new is a prefix
    of an array (its `.base`) that the caller may pass back as the room of the next call: then a
    growing active set needs no new memory most steps (fresh memory costs a page fault every 4 KiB)."""
    a, n = rows.shape[0], mom.shape[1]
    if grows.shape[0] == 0:
        gidx = _room(gidx_room, a, (), np.int64, grow)
        gidx[:] = -1
        return rows, mom, gidx
    new = _count_new(rows, grows)
    gidx = _room(gidx_room, a + new, (), np.int64, grow)
    if new == 0:
        _locate(rows, grows, gidx)
        return rows, mom, gidx
    if rows_room is not None and mom_room is not None:
        if rows_room.ctypes.data != rows.ctypes.data or mom_room.ctypes.data != mom.ctypes.data:
            raise ValueError("merge: rows_room / mom_room must begin with rows / mom (the same memory)")
        if rows_room.shape[0] >= a + new and mom_room.shape[0] >= a + new:
            _merge_back(rows_room, mom_room, a, a + new, grows, gidx)
            return rows_room[: a + new], mom_room[: a + new], gidx
    out_rows = _room(None, a + new, (), rows.dtype, grow)
    out_mom = _room(None, a + new, (n,), mom.dtype, grow)
    _merge_into(rows, mom, grows, out_rows, out_mom, gidx)
    return out_rows, out_mom, gidx


def compact(rows: np.ndarray, mom: np.ndarray) -> int:
    """Drop the rows of all-zero momentum from (rows, mom) in place; returns the rows kept (a prefix)."""
    return int(_compact(rows, mom))


def _over_rows(kernel, args: tuple, a: int, threads: int | None) -> list:
    """kernel(*args, start, end) over the `a` active rows in contiguous chunks (`resolve_threads`);
    each chunk's result, in position order ([] for no rows)."""
    return run_chunks(kernel, args, a, resolve_threads(threads, a, PARALLEL_MIN)) if a else []


def _column_sums(parts: list, n: int) -> np.ndarray:
    """The chunks' column sums of squares added up in position order (n,) float64; zeros for none."""
    if not parts:
        return np.zeros(n, dtype=np.float64)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def blend(
    mom: np.ndarray,
    gidx: np.ndarray,
    grad: np.ndarray,
    beta: float,
    u: np.ndarray,
    rho: np.ndarray,
    threads: int | None = None,
) -> tuple[float, int]:
    """Momentum and Nesterov blend of the A active rows (see `_blend_range`); (rho sum, zero rows)."""
    parts = _over_rows(_blend_range, (mom, gidx, grad, beta, u, rho), mom.shape[0], threads)
    return float(sum(p[0] for p in parts)), int(sum(p[1] for p in parts))


def rows(
    u: np.ndarray, rho: np.ndarray, thresh: float, eps: float, keep: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """Mask and first row normalisation; the column sums of squares (n,) float64."""
    return _column_sums(_over_rows(_rows_range, (u, rho, thresh, eps, keep), u.shape[0], threads), u.shape[1])


def cols_rows(
    u: np.ndarray,
    colinv: np.ndarray,
    keep: np.ndarray,
    eps: float,
    want_colsq: bool,
    threads: int | None = None,
) -> np.ndarray:
    """One column / row pair over the kept rows; the new column sums of squares (n,) float64."""
    parts = _over_rows(_cols_rows_range, (u, colinv, keep, eps, want_colsq), u.shape[0], threads)
    return _column_sums(parts, u.shape[1])


def cols_rows_apply(
    u: np.ndarray,
    colinv: np.ndarray,
    keep: np.ndarray,
    eps: float,
    w: np.ndarray,
    rows_: np.ndarray,
    step: float,
    threads: int | None = None,
) -> None:
    """The last column / row pair over the kept rows, each row's update written to W right away:
    `cols_rows(..., want_colsq=False)` then `apply(w, rows_, u, keep, step)` in one sweep (w of u's
    dtype, contiguous; distinct rows: the chunks never meet)."""
    _over_rows(_cols_rows_apply_range, (u, colinv, keep, eps, w, rows_, step), u.shape[0], threads)


def apply(
    w: np.ndarray, rows_: np.ndarray, u: np.ndarray, keep: np.ndarray, step: float, threads: int | None = None
) -> None:
    """w[rows_[i]] -= step * u[i] for the kept active rows (distinct rows: the chunks never meet)."""
    _over_rows(_apply_range, (w, rows_, u, keep, step), u.shape[0], threads)
