"""Triton kernels for the passes of the Sinkhorn-balanced table update (SPEC §7b) on CUDA.

The CUDA twins of `cpu_sinkhorn` with the signatures of `reference.sinkhorn_*` (what they must equal):
`sinkhorn_blend` (momentum, Nesterov blend into the (A, n) workspace u, row norms), `sinkhorn_rows`
(the mask and the first row normalisation), `sinkhorn_cols_rows` (one column / row pair) and
`sinkhorn_apply` (W[rows] -= step * u for the kept rows). Each pass is one sweep over u in place: a
program takes a contiguous run of row blocks, a row's n features in one tile. Arithmetic in u's dtype
(fp32, or fp64), sums of squares in fp64; column sums are per-program partials added by torch
(deterministic, no atomics). Every product and sum is rounded as written (launched without FMA
contraction, `_ROUNDED`), so the bits do not depend on the layouts the compiler picks for a table's
strides. Knows nothing of optimizers or tables. Imports triton. Design: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sinkhorn_apply", "sinkhorn_blend", "sinkhorn_cols_rows", "sinkhorn_rows"]

_TILE = 4096  # elements of a (rows, features) tile per step of a program
_MAX_BLOCK_R = 64  # rows per tile at most (narrow tables)
_MAX_PROGRAMS = 1024  # programs per pass at most: bounds the (programs, n) fp64 partial buffer
# Launch option of every pass: no FMA contraction. Left to the compiler, `w - step * u` of the apply
# became one fma (one rounding) for a row-major table but a mul and a sub (two roundings) for a
# column-major one, whose w tile has another register layout: the product crosses shared memory to
# reach it, and nothing fuses across that (triton 3.6, sm_90). Rounding each op as written is the
# same arithmetic in every layout, the interpreter's and the torch twins'.
_ROUNDED = {"enable_fp_fusion": False}


@triton.jit
def _blend_kernel(
    mom_ptr,  # (A, n) state dtype, updated in place
    gidx_ptr,  # (A,) int64: the row of grad, or -1
    grad_ptr,  # (R, n)
    u_ptr,  # (A, n) out: the Nesterov blend
    rho_ptr,  # (A,) float64 out: row norms of u
    part_ptr,  # (programs, 2) float64 out: sum of rho, rows whose momentum is zero
    a,
    n,
    per_prog,  # row blocks per program
    beta: tl.float64,
    beta1: tl.float64,  # 1 - beta, rounded once on the host as the twin does
    BLOCK_R: tl.constexpr,
    N_P2: tl.constexpr,
    CT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, N_P2)
    cmask = cols < n
    b = tl.full([], beta, CT)
    b1 = tl.full([], beta1, CT)
    total = tl.zeros([BLOCK_R], tl.float64)
    zeros = tl.zeros([BLOCK_R], tl.int32)
    for k in range(per_prog):
        rows = (pid * per_prog + k).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < a
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n + cols[None, :]
        gi = tl.load(gidx_ptr + rows, mask=rmask, other=-1)
        gmask = mask & (gi >= 0)[:, None]
        g = tl.load(grad_ptr + gi[:, None] * n + cols[None, :], mask=gmask, other=0.0).to(CT)
        m = tl.load(mom_ptr + offs, mask=mask, other=0.0).to(CT)
        m = (b * m + b1 * g).to(mom_ptr.dtype.element_ty)  # the state's rounding
        tl.store(mom_ptr + offs, m, mask=mask)
        v = (b * m.to(CT) + b1 * g).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + offs, v, mask=mask)
        v64 = v.to(tl.float64)
        r = tl.sqrt(tl.sum(v64 * v64, axis=1))
        tl.store(rho_ptr + rows, r, mask=rmask)
        total += tl.where(rmask, r, 0.0)
        nonzero = tl.sum((m != 0).to(tl.int32), axis=1)
        zeros += (rmask & (nonzero == 0)).to(tl.int32)
    tl.store(part_ptr + 2 * pid, tl.sum(total, axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(zeros, axis=0).to(tl.float64))


@triton.jit
def _rows_kernel(
    u_ptr,  # (A, n), normalised in place
    rho_ptr,  # (A,) float64
    keep_ptr,  # (A,) uint8 out (a bool tensor's bytes)
    part_ptr,  # (programs, n) float64 out: column sums of squares
    a,
    n,
    per_prog,
    thresh: tl.float64,
    eps: tl.float64,
    BLOCK_R: tl.constexpr,
    N_P2: tl.constexpr,
    CT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, N_P2)
    cmask = cols < n
    th = tl.full([], thresh, tl.float64)
    e = tl.full([], eps, tl.float64)
    colsq = tl.zeros([N_P2], tl.float64)
    for k in range(per_prog):
        rows = (pid * per_prog + k).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < a
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n + cols[None, :]
        r = tl.load(rho_ptr + rows, mask=rmask, other=0.0)
        kept = rmask & (r > th)
        tl.store(keep_ptr + rows, kept.to(tl.uint8), mask=rmask)
        inv = tl.where(kept, 1.0 / (r + e), 0.0).to(CT)  # fp64 reciprocal, rounded once
        x = tl.load(u_ptr + offs, mask=mask & kept[:, None], other=0.0).to(CT)
        x = (x * inv[:, None]).to(u_ptr.dtype.element_ty)  # masked rows: 0
        tl.store(u_ptr + offs, x, mask=mask)
        x64 = x.to(tl.float64)
        colsq += tl.sum(x64 * x64, axis=0)
    tl.store(part_ptr + pid.to(tl.int64) * n + cols, colsq, mask=cmask)


@triton.jit
def _cols_rows_kernel(
    u_ptr,  # (A, n), normalised in place
    colinv_ptr,  # (n,) 1 / (column norm + eps)
    keep_ptr,  # (A,) uint8
    part_ptr,  # (programs, n) float64 out, written if WANT_COLSQ
    a,
    n,
    per_prog,
    eps: tl.float64,
    BLOCK_R: tl.constexpr,
    N_P2: tl.constexpr,
    CT: tl.constexpr,
    WANT_COLSQ: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, N_P2)
    cmask = cols < n
    e = tl.full([], eps, tl.float64)
    ci = tl.load(colinv_ptr + cols, mask=cmask, other=0.0).to(CT)
    colsq = tl.zeros([N_P2], tl.float64)
    for k in range(per_prog):
        rows = (pid * per_prog + k).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < a
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n + cols[None, :]
        kept = rmask & (tl.load(keep_ptr + rows, mask=rmask, other=0) != 0)
        x = tl.load(u_ptr + offs, mask=mask & kept[:, None], other=0.0).to(CT)
        x = (x * ci[None, :]).to(u_ptr.dtype.element_ty)  # the column step, rounded as stored
        x64 = x.to(tl.float64)
        norm = tl.sqrt(tl.sum(x64 * x64, axis=1))
        inv = tl.where(kept, 1.0 / (norm + e), 0.0).to(CT)
        x = (x.to(CT) * inv[:, None]).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + offs, x, mask=mask)
        if WANT_COLSQ:
            x64 = x.to(tl.float64)
            colsq += tl.sum(x64 * x64, axis=0)
    if WANT_COLSQ:
        tl.store(part_ptr + pid.to(tl.int64) * n + cols, colsq, mask=cmask)


@triton.jit
def _apply_kernel(
    w_ptr,  # (m, n) the table, any float dtype and strides
    rows_ptr,  # (A,) int64: the table row of each active row (distinct)
    u_ptr,  # (A, n)
    keep_ptr,  # (A,) uint8
    a,
    n,
    per_prog,
    w_row,  # w's strides
    w_col,
    step: tl.float64,
    BLOCK_R: tl.constexpr,
    N_P2: tl.constexpr,
    CT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, N_P2)
    cmask = cols < n
    s = tl.full([], step, CT)
    for k in range(per_prog):
        rows = (pid * per_prog + k).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < a
        kept = rmask & (tl.load(keep_ptr + rows, mask=rmask, other=0) != 0)
        mask = kept[:, None] & cmask[None, :]
        r = tl.load(rows_ptr + rows, mask=kept, other=0)
        x = tl.load(u_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0.0).to(CT)
        wp = w_ptr + r[:, None] * w_row + cols[None, :].to(tl.int64) * w_col
        ww = tl.load(wp, mask=mask, other=0.0).to(CT)
        tl.store(wp, (ww - s * x).to(w_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------ launch
def _grid(a: int, n: int) -> tuple[int, int, int, int, int]:
    """(programs, row blocks per program, rows per block, n's power of two, warps) for A rows of n."""
    n_p2 = triton.next_power_of_2(max(n, 1))
    block_r = max(1, min(_MAX_BLOCK_R, _TILE // n_p2))
    blocks = triton.cdiv(a, block_r)
    per = triton.cdiv(blocks, min(blocks, _MAX_PROGRAMS))
    warps = min(16, max(4, block_r * n_p2 // 1024))
    return triton.cdiv(blocks, per), per, block_r, n_p2, warps


def _compute_type(*tensors: torch.Tensor) -> tl.dtype:
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


def _check_work(u: torch.Tensor, where: str, **vectors: torch.Tensor) -> None:
    """u (A, n) contiguous fp32/fp64; each vector (A,) contiguous of its expected dtype."""
    if u.dim() != 2 or u.dtype not in (torch.float32, torch.float64) or not u.is_contiguous():
        raise ValueError(
            f"{where}: the workspace u must be a contiguous (A, n) float32 or float64 tensor, got "
            f"{u.dtype} {tuple(u.shape)} (contiguous: {u.is_contiguous()})"
        )
    want = {"rho": torch.float64, "keep": torch.bool, "gidx": torch.int64, "rows": torch.int64}
    for name, t in vectors.items():
        if t.shape != (u.shape[0],) or t.dtype != want[name] or not t.is_contiguous():
            raise ValueError(
                f"{where}: {name} must be a contiguous ({u.shape[0]},) {want[name]} tensor (one per row of "
                f"u), got {t.dtype} {tuple(t.shape)}"
            )


def sinkhorn_blend(
    mom: torch.Tensor, gidx: torch.Tensor, grad: torch.Tensor, beta: float, u: torch.Tensor, rho: torch.Tensor
) -> tuple[float, int]:
    """mom <- beta * mom + (1 - beta) * g; u <- beta * mom + (1 - beta) * g (g = grad[gidx[i]], zeros
    where gidx[i] < 0); rho <- row norms of u; returns (sum of rho, rows whose momentum is now zero)."""
    _check_work(u, "sinkhorn_blend", rho=rho, gidx=gidx)
    if mom.shape != u.shape or not mom.is_contiguous():
        raise ValueError(
            f"sinkhorn_blend: mom must be contiguous of u's shape {tuple(u.shape)}, got {tuple(mom.shape)}"
        )
    if grad.dim() != 2 or grad.shape[1] != u.shape[1] or not grad.is_contiguous():
        raise ValueError(
            f"sinkhorn_blend: grad must be a contiguous (R, {u.shape[1]}) tensor, got {tuple(grad.shape)}"
        )
    a, n = u.shape
    if a == 0:
        return 0.0, 0
    progs, per, block_r, n_p2, warps = _grid(a, n)
    part = torch.empty((progs, 2), dtype=torch.float64, device=u.device)
    _blend_kernel[(progs,)](
        mom, gidx, grad, u, rho, part, a, n, per, float(beta), 1.0 - float(beta),
        BLOCK_R=block_r, N_P2=n_p2, CT=_compute_type(mom, u), num_warps=warps, **_ROUNDED,
    )  # fmt: skip
    total, zero_rows = part.sum(dim=0).tolist()  # sync point
    return float(total), int(zero_rows)


def sinkhorn_rows(
    u: torch.Tensor, rho: torch.Tensor, thresh: float, eps: float, keep: torch.Tensor
) -> torch.Tensor:
    """Rows with rho <= thresh set to 0 (keep False), the others divided by (rho + eps); the column
    sums of squares (n,) float64."""
    _check_work(u, "sinkhorn_rows", rho=rho, keep=keep)
    a, n = u.shape
    if a == 0:
        return torch.zeros(n, dtype=torch.float64, device=u.device)
    progs, per, block_r, n_p2, warps = _grid(a, n)
    part = torch.empty((progs, n), dtype=torch.float64, device=u.device)
    _rows_kernel[(progs,)](
        u, rho, keep.view(torch.uint8), part, a, n, per, float(thresh), float(eps),
        BLOCK_R=block_r, N_P2=n_p2, CT=_compute_type(u), num_warps=warps, **_ROUNDED,
    )  # fmt: skip
    return part.sum(dim=0)


def sinkhorn_cols_rows(
    u: torch.Tensor, colinv: torch.Tensor, keep: torch.Tensor, eps: float, want_colsq: bool
) -> torch.Tensor:
    """u_ij *= colinv_j, then each kept row divided by (its norm + eps) (the others 0); the new column
    sums of squares (n,) float64 (zeros unless want_colsq)."""
    _check_work(u, "sinkhorn_cols_rows", keep=keep)
    a, n = u.shape
    if colinv.shape != (n,) or not colinv.is_floating_point() or not colinv.is_contiguous():
        raise ValueError(
            f"sinkhorn_cols_rows: colinv must be a contiguous float ({n},) tensor (one per column of u), got "
            f"{colinv.dtype} {tuple(colinv.shape)}"
        )
    if a == 0 or not want_colsq:
        colsq = torch.zeros(n, dtype=torch.float64, device=u.device)
        if a == 0:
            return colsq
    progs, per, block_r, n_p2, warps = _grid(a, n)
    part = torch.empty((progs, n), dtype=torch.float64, device=u.device) if want_colsq else colsq
    _cols_rows_kernel[(progs,)](
        u, colinv, keep.view(torch.uint8), part, a, n, per, float(eps),
        BLOCK_R=block_r, N_P2=n_p2, CT=_compute_type(u), WANT_COLSQ=bool(want_colsq), num_warps=warps, **_ROUNDED,
    )  # fmt: skip
    return part.sum(dim=0) if want_colsq else colsq


def sinkhorn_apply(
    w: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, keep: torch.Tensor, step: float
) -> None:
    """w[rows[i]] -= step * u[i] for the kept rows i, in place (rows distinct; w fp32, bf16, fp16 or
    fp64, any strides: computed in fp32, fp64 for fp64 w or u, and rounded once on store)."""
    _check_work(u, "sinkhorn_apply", rows=rows, keep=keep)
    a, n = u.shape
    if w.dim() != 2 or w.shape[1] != n or not w.is_floating_point():
        raise ValueError(f"sinkhorn_apply: w must be a float (m, {n}) table, got {w.dtype} {tuple(w.shape)}")
    if a == 0:
        return
    progs, per, block_r, n_p2, warps = _grid(a, n)
    _apply_kernel[(progs,)](
        w, rows, u, keep.view(torch.uint8), a, n, per, w.stride(0), w.stride(1), float(step),
        BLOCK_R=block_r, N_P2=n_p2, CT=_compute_type(w, u), num_warps=warps, **_ROUNDED,
    )  # fmt: skip
