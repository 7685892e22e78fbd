"""The passes of the Sinkhorn-balanced update (SPEC §7b) over a table's active rows, as numba kernels.

`model.sinkhorn.SparseSinkhorn` keeps the momentum of the rows whose momentum is nonzero (the active
set, A rows of n features) and calls, once a step: `blend` (momentum and the Nesterov blend into one
(A, n) workspace, with each row's norm), `rows` (the mask and the first row normalisation, giving the
column sums of squares), then `cols_rows` once per column / row pair (K = 11: five), `apply`, and
`compact` (rows whose momentum underflowed to zero leave, in place).
Every pass is one sweep over the workspace in place: the K normalisations never copy it. Column
sums are returned per call, so a row-sharded table can all-reduce them between passes (n numbers).
Sums are taken in float64. The plain torch version of the whole update is `reference.sinkhorn_update`.
Compiles on first call (cached on disk). Design: docs/model.md.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from engram.kernels.threads import resolve_threads, run_chunks

__all__ = ["PARALLEL_MIN", "apply", "blend", "cols_rows", "compact", "merge", "rows"]

PARALLEL_MIN = 4096  # active rows from which a pass splits over every core

_jit = numba.njit(cache=True, nogil=True)


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
def _apply_range(w, rows, u, keep, step, start, end):  # pragma: no cover - numba
    """w[rows[i]] -= step * u[i] for the kept rows start..end (w float32 or float64)."""
    n = u.shape[1]
    for i in range(start, end):
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


def merge(rows: np.ndarray, mom: np.ndarray, grows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(active rows, their momentum, gidx) after adding the sorted distinct gradient rows `grows` to
    the sorted active set: the same arrays when nothing is new, else new ones (one linear pass)."""
    gidx = np.empty(rows.shape[0], dtype=np.int64)
    if grows.shape[0] == 0:
        gidx[:] = -1
        return rows, mom, gidx
    new = _count_new(rows, grows)
    if new == 0:
        _locate(rows, grows, gidx)
        return rows, mom, gidx
    a = rows.shape[0] + new
    out_rows = np.empty(a, dtype=rows.dtype)
    out_mom = np.empty((a, mom.shape[1]), dtype=mom.dtype)
    gidx = np.empty(a, dtype=np.int64)
    _merge_into(rows, mom, grows, out_rows, out_mom, gidx)
    return out_rows, out_mom, gidx


def compact(rows: np.ndarray, mom: np.ndarray) -> int:
    """Drop the rows of all-zero momentum from (rows, mom) in place; returns the rows kept (a prefix)."""
    return int(_compact(rows, mom))


def _sum(parts: list) -> np.ndarray:
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
    a = mom.shape[0]
    t = resolve_threads(threads, a, PARALLEL_MIN)
    parts = run_chunks(_blend_range, (mom, gidx, grad, beta, u, rho), a, t) if a else [(0.0, 0)]
    return float(sum(p[0] for p in parts)), int(sum(p[1] for p in parts))


def rows(
    u: np.ndarray, rho: np.ndarray, thresh: float, eps: float, keep: np.ndarray, threads: int | None = None
) -> np.ndarray:
    """Mask and first row normalisation; the column sums of squares (n,) float64."""
    a = u.shape[0]
    if a == 0:
        return np.zeros(u.shape[1], dtype=np.float64)
    t = resolve_threads(threads, a, PARALLEL_MIN)
    return _sum(run_chunks(_rows_range, (u, rho, thresh, eps, keep), a, t))


def cols_rows(
    u: np.ndarray,
    colinv: np.ndarray,
    keep: np.ndarray,
    eps: float,
    want_colsq: bool,
    threads: int | None = None,
) -> np.ndarray:
    """One column / row pair over the kept rows; the new column sums of squares (n,) float64."""
    a = u.shape[0]
    if a == 0:
        return np.zeros(u.shape[1], dtype=np.float64)
    t = resolve_threads(threads, a, PARALLEL_MIN)
    return _sum(run_chunks(_cols_rows_range, (u, colinv, keep, eps, want_colsq), a, t))


def apply(
    w: np.ndarray, rows_: np.ndarray, u: np.ndarray, keep: np.ndarray, step: float, threads: int | None = None
) -> None:
    """w[rows_[i]] -= step * u[i] for the kept active rows (distinct rows: the chunks never meet)."""
    a = u.shape[0]
    if a:
        run_chunks(_apply_range, (w, rows_, u, keep, step), a, resolve_threads(threads, a, PARALLEL_MIN))
