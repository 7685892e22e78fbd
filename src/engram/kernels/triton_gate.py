"""Triton kernels for the V4.1 context gate after `wkv` (SPEC §6) on CUDA, forward and backward.

`fused_gate` (the autograd function `FusedGate`) computes (h + gate * v, gates) in float32 and
gives gradients for h, key, v and w; its twin is `reference.gate`, the eager code of `Engram`.
Reads inputs in their own dtypes and strides; deterministic (no atomics). Knows nothing of tables
or rows. Imports triton. Design, with the forward and backward math: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.kernels.reference import check_gate_inputs

__all__ = ["FusedGate", "fused_gate"]

_BLOCK_D = 256  # dim columns per step of the per-token kernels
_BLOCK_T = 32  # tokens per program of the elementwise backward kernel (and per partial dw)
_BLOCK_D_BWD = 128  # dim columns per program of the elementwise backward kernel


@triton.jit
def _gate_fwd_kernel(
    h_ptr,
    k_ptr,
    v_ptr,
    w_ptr,
    dead_ptr,
    out_ptr,
    gates_ptr,  # (n_tok, HC) in the gates' dtype
    stats_ptr,  # (n_tok, 4, HC) float32: dot, rh, rk, g
    h_tok,  # token stride of h (stream stride is dim); out has h's layout
    k_tok,
    k_m,
    v_tok,
    dim,
    eps,
    clamp,
    scale,  # dim ** -0.5
    HC: tl.constexpr,
    HC_P2: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, HC_P2)
    mmask = m < HC
    dot = tl.zeros([HC_P2], tl.float32)
    ssh = tl.zeros([HC_P2], tl.float32)
    ssk = tl.zeros([HC_P2], tl.float32)
    for d0 in range(0, dim, BLOCK_D):  # pass 1: the three reductions over dim
        d = d0 + tl.arange(0, BLOCK_D)
        mask = mmask[:, None] & (d < dim)[None, :]
        hh = tl.load(h_ptr + tok * h_tok + m[:, None] * dim + d[None, :], mask=mask, other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + tok * k_tok + m[:, None] * k_m + d[None, :], mask=mask, other=0.0).to(tl.float32)
        ww = tl.load(w_ptr + m[:, None] * dim + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(hh * ww * kk, axis=1)
        ssh += tl.sum(hh * hh, axis=1)
        ssk += tl.sum(kk * kk, axis=1)
    rh = 1.0 / tl.sqrt(ssh / dim + eps)
    rk = 1.0 / tl.sqrt(ssk / dim + eps)
    z = dot * rh * rk * scale
    root = tl.sqrt(tl.maximum(tl.abs(z), clamp))
    negative = z.to(tl.int32, bitcast=True) < 0  # the sign bit, as copysign reads it (-0.0 included)
    g = 1.0 / (1.0 + tl.exp(-tl.where(negative, -root, root)))
    if HAS_DEAD:
        dead = tl.load(dead_ptr + tok) != 0
        g = tl.where(dead, 0.0, g)
    tl.store(gates_ptr + tok * HC + m, g.to(gates_ptr.dtype.element_ty), mask=mmask)
    st = stats_ptr + tok * 4 * HC + m
    tl.store(st, dot, mask=mmask)
    tl.store(st + HC, rh, mask=mmask)
    tl.store(st + 2 * HC, rk, mask=mmask)
    tl.store(st + 3 * HC, g, mask=mmask)
    for d0 in range(0, dim, BLOCK_D):  # pass 2: out = h + g * v
        d = d0 + tl.arange(0, BLOCK_D)
        mask = mmask[:, None] & (d < dim)[None, :]
        offs = tok * h_tok + m[:, None] * dim + d[None, :]
        hh = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + tok * v_tok + d, mask=d < dim, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (hh + g[:, None] * vv[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_scalars_kernel(
    dout_ptr,  # (n_tok, HC, dim) contiguous
    dgates_ptr,  # (n_tok, HC) float32, read if HAS_DGATES
    v_ptr,
    stats_ptr,  # (n_tok, 4, HC): dot, rh, rk, g
    coef_ptr,  # (n_tok, 3, HC) float32 out: a, b_h, b_k
    v_tok,
    dim,
    clamp,
    scale,
    HC: tl.constexpr,
    HC_P2: tl.constexpr,
    HAS_DGATES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, HC_P2)
    mmask = m < HC
    dg = tl.zeros([HC_P2], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = mmask[:, None] & (d < dim)[None, :]
        do = tl.load(dout_ptr + tok * HC * dim + m[:, None] * dim + d[None, :], mask=mask, other=0.0)
        vv = tl.load(v_ptr + tok * v_tok + d, mask=d < dim, other=0.0).to(tl.float32)
        dg += tl.sum(do.to(tl.float32) * vv[None, :], axis=1)
    if HAS_DGATES:
        dg += tl.load(dgates_ptr + tok * HC + m, mask=mmask, other=0.0)
    st = stats_ptr + tok * 4 * HC + m
    dot = tl.load(st, mask=mmask, other=0.0)
    rh = tl.load(st + HC, mask=mmask, other=0.0)
    rk = tl.load(st + 2 * HC, mask=mmask, other=0.0)
    g = tl.load(st + 3 * HC, mask=mmask, other=0.0)  # 0 for a dead token: no gradient through its gate
    z = dot * rh * rk * scale
    az = tl.abs(z)
    live = az >= clamp  # below the clamp the gate is constant in z
    dz = tl.where(live, dg * g * (1.0 - g) / (2.0 * tl.sqrt(tl.where(live, az, 1.0))), 0.0)
    a = dz * rh * rk * scale
    b_h = -a * dot * rh * rh / dim
    b_k = -a * dot * rk * rk / dim
    c = coef_ptr + tok * 3 * HC + m
    tl.store(c, a, mask=mmask)
    tl.store(c + HC, b_h, mask=mmask)
    tl.store(c + 2 * HC, b_k, mask=mmask)


@triton.jit
def _gate_bwd_elementwise_kernel(
    dout_ptr,
    h_ptr,
    k_ptr,
    w_ptr,
    stats_ptr,
    coef_ptr,
    dh_ptr,  # (n_tok, HC, dim) contiguous, h's dtype
    dk_ptr,  # (n_tok, HC, dim) contiguous, key's dtype
    dv_ptr,  # (n_tok, dim) contiguous, v's dtype
    dw_part_ptr,  # (n_blocks, HC, dim) float32
    n_tok,
    h_tok,
    k_tok,
    k_m,
    dim,
    HC: tl.constexpr,
    HC_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    m = tl.arange(0, HC_P2)
    mmask = m < HC
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    mask = mmask[:, None] & dmask[None, :]
    ww = tl.load(w_ptr + m[:, None] * dim + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([HC_P2, BLOCK_D], tl.float32)
    first = pid_t.to(tl.int64) * BLOCK_T
    rows = m[:, None] * dim + d[None, :]
    for j in range(tl.minimum(BLOCK_T, n_tok - first)):  # the last block may be short
        tok = first + j
        do = tl.load(dout_ptr + tok * HC * dim + rows, mask=mask, other=0.0).to(tl.float32)
        hh = tl.load(h_ptr + tok * h_tok + rows, mask=mask, other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + tok * k_tok + m[:, None] * k_m + d[None, :], mask=mask, other=0.0).to(tl.float32)
        c = coef_ptr + tok * 3 * HC + m
        a = tl.load(c, mask=mmask, other=0.0)[:, None]
        b_h = tl.load(c + HC, mask=mmask, other=0.0)[:, None]
        b_k = tl.load(c + 2 * HC, mask=mmask, other=0.0)[:, None]
        g = tl.load(stats_ptr + tok * 4 * HC + 3 * HC + m, mask=mmask, other=0.0)
        dh = do + a * ww * kk + b_h * hh
        tl.store(dh_ptr + tok * HC * dim + rows, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(
            dk_ptr + tok * HC * dim + rows, (a * ww * hh + b_k * kk).to(dk_ptr.dtype.element_ty), mask=mask
        )
        dv = tl.sum(g[:, None] * do, axis=0)
        tl.store(dv_ptr + tok * dim + d, dv.to(dv_ptr.dtype.element_ty), mask=dmask)
        dw += a * hh * kk
    tl.store(dw_part_ptr + pid_t.to(tl.int64) * HC * dim + m[:, None] * dim + d[None, :], dw, mask=mask)


def _tokens(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(x, token stride, stream stride) for x (B, T, hc, dim) or (B, T, dim): x itself when its last
    stride is 1 and (B, T) flatten to one token axis (a view of the wkv output does), else a copy."""
    b, t = x.shape[:2]
    if not (x.stride(-1) == 1 and (b == 1 or t == 1 or x.stride(0) == t * x.stride(1))):
        x = x.contiguous()
    tok = x.stride(1) if t > 1 or b == 1 else x.stride(0)
    return x, tok, (x.stride(2) if x.dim() == 4 else 0)


class FusedGate(torch.autograd.Function):
    """(h, key, v, w, dead, eps, clamp) -> (h + gate * v, gates) with Triton forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        key: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        dead: torch.Tensor | None,
        eps: float,
        clamp: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq, hc, dim = h.shape
        h = h.contiguous()  # out, dh and the saved h share its (tokens, hc, dim) layout
        h_tok = hc * dim
        key, k_tok, k_m = _tokens(key)
        v, v_tok, _ = _tokens(v)
        w = w.contiguous()
        n_tok = bsz * seq
        out = torch.empty((bsz, seq, hc, dim), dtype=h.dtype, device=h.device)
        gates = torch.empty((bsz, seq, hc), dtype=h.dtype, device=h.device)
        stats = torch.empty((n_tok, 4, hc), dtype=torch.float32, device=h.device)
        if n_tok:
            dead_u8 = dead.contiguous().view(torch.uint8) if dead is not None else stats
            _gate_fwd_kernel[(n_tok,)](
                h, key, v, w, dead_u8, out, gates, stats,
                h_tok, k_tok, k_m, v_tok, dim, float(eps), float(clamp), dim**-0.5,
                HC=hc, HC_P2=triton.next_power_of_2(hc), HAS_DEAD=dead is not None, BLOCK_D=_BLOCK_D,
            )  # fmt: skip
        ctx.save_for_backward(h, key, v, w, stats)
        ctx.clamp = float(clamp)
        return out, gates

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor, dgates: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        h, key, v, w, stats = ctx.saved_tensors  # type: ignore[attr-defined]
        bsz, seq, hc, dim = h.shape
        n_tok = bsz * seq
        h_tok = hc * dim
        _, k_tok, k_m = _tokens(key)  # saved as the forward read them
        _, v_tok, _ = _tokens(v)
        dout = dout.contiguous()
        dh = torch.empty((bsz, seq, hc, dim), dtype=h.dtype, device=h.device)
        dk = torch.empty((bsz, seq, hc, dim), dtype=key.dtype, device=h.device)
        dv = torch.empty((bsz, seq, dim), dtype=v.dtype, device=h.device)
        n_blocks = triton.cdiv(n_tok, _BLOCK_T)
        dw_part = torch.zeros((max(n_blocks, 1), hc, dim), dtype=torch.float32, device=h.device)
        if n_tok:
            coef = torch.empty((n_tok, 3, hc), dtype=torch.float32, device=h.device)
            dg = dgates.float().contiguous() if dgates is not None else stats
            hc_p2 = triton.next_power_of_2(hc)
            _gate_bwd_scalars_kernel[(n_tok,)](
                dout, dg, v, stats, coef, v_tok, dim, ctx.clamp, dim**-0.5,  # type: ignore[attr-defined]
                HC=hc, HC_P2=hc_p2, HAS_DGATES=dgates is not None, BLOCK_D=_BLOCK_D,
            )  # fmt: skip
            _gate_bwd_elementwise_kernel[(n_blocks, triton.cdiv(dim, _BLOCK_D_BWD))](
                dout, h, key, w, stats, coef, dh, dk, dv, dw_part,
                n_tok, h_tok, k_tok, k_m, dim,
                HC=hc, HC_P2=hc_p2, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D_BWD,
            )  # fmt: skip
        dw = dw_part.sum(0).to(w.dtype)
        return dh, dk, dv, dw, None, None, None


def fused_gate(
    h: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dead: torch.Tensor | None = None,
    eps: float = 1e-6,
    clamp: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (B, T, hc, dim), key (B, T, hc, dim), v (B, T, dim), w (hc, dim), dead (B, T) bool or None ->
    (h + gates * v (B, T, hc, dim), gates (B, T, hc)), differentiable in h, key, v and w."""
    check_gate_inputs(h, key, v, w, dead)
    out, gates = FusedGate.apply(h, key, v, w, dead, eps, clamp)
    return out, gates
