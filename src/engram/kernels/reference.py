"""Plain torch twins of the Triton kernels of `engram.kernels`: what each kernel must equal, and the
eager path on devices without triton.

The hash (`hash_rows`), the FP8 gather (`fp8_gather`, no checks, so no device sync), the masked row
copy of a device-indexed cache's fill (`copy_rows`) and its lookup (`cache_lookup`, `set_of`), the V4.1
gate (`gate`, the eager path of `Engram` itself, so the fused kernel is tested against the
module's own code), plus the gate nonlinearity both Engram variants share; the passes of the
Sinkhorn-balanced table update (`sinkhorn_*`, twins of `cpu_sinkhorn`). Design: docs/kernels.md.
"""

from __future__ import annotations

import torch

from engram.rowformat.fp8 import scale_bytes_to_float

__all__ = [
    "cache_lookup",
    "check_gate_inputs",
    "copy_rows",
    "fp8_gather",
    "gate",
    "hash_rows",
    "set_of",
    "signed_sqrt_gate",
    "sinkhorn_blend",
    "sinkhorn_cols_rows",
    "sinkhorn_rows",
]


def hash_rows(
    xc: torch.Tensor,
    dead: torch.Tensor | None,
    window: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows (B, T, L, orders*K) int64 of compressed ids xc (B, T); see `triton_hash.hash_rows`."""
    b, t = xc.shape
    n_layers, n = multipliers.shape
    k = primes.shape[-1]
    xc = xc.long()
    vals = xc if dead is None else torch.where(dead, pad, xc)
    if window is None:
        window = torch.full((b, n - 1), pad, dtype=torch.long, device=xc.device)
    ext = torch.cat([window.long().flip(1), vals], dim=1)  # (B, n-1+T): ext[:, n-1+t] is position t
    cols = [vals]  # look-back i = 0 .. n-1, each (B, T)
    lead = torch.zeros_like(window, dtype=torch.bool)
    blocked = dead.clone() if dead is not None else torch.zeros_like(xc, dtype=torch.bool)
    ext_dead = None if dead is None else torch.cat([lead, dead], dim=1)
    ext_start = None if starts is None else torch.cat([lead, starts], dim=1)
    for i in range(1, n):
        col = ext[:, n - 1 - i : n - 1 - i + t]
        if ext_start is not None:  # a start at t-i+1 hides t-i and everything farther
            blocked |= ext_start[:, n - i : n - i + t]
        if ext_dead is not None:
            blocked |= ext_dead[:, n - 1 - i : n - 1 - i + t]  # sticky: once blocked, farther is too
        if ext_start is not None or ext_dead is not None:
            col = torch.where(blocked, pad, col)
        cols.append(col)
    out = torch.empty((b, t, n_layers, (n - 1) * k), dtype=torch.long, device=xc.device)
    for li in range(n_layers):
        mix = cols[0] * multipliers[li, 0]
        for i in range(1, n):
            mix = mix ^ (cols[i] * multipliers[li, i])  # exact: every product < 2^63
            dst = out[:, :, li, (i - 1) * k : i * k]
            torch.remainder(mix[..., None], primes[li, i - 1], out=dst)
            dst += offsets[li, i - 1]
    return out


def fp8_gather(
    values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(..., D) in `dtype`: fp8 values of the rows times their blocks' 2^(b - 127), in float32, then cast."""
    nb = scales.shape[1]
    v = values.view(torch.uint8)[rows].view(torch.float8_e4m3fn).float()  # (..., D)
    s = scale_bytes_to_float(scales.view(torch.uint8)[rows])  # (..., nb)
    return (v.unflatten(-1, (nb, -1)) * s[..., None]).flatten(-2).to(dtype)


def set_of(rows: torch.Tensor, sets: int) -> torch.Tensor:
    """The set (0..sets-1) of each row id (int64 >= 0) in a set-associative cache: a 31-bit mix of the id
    (no int64 overflow, so every device computes the same sets), modulo `sets`."""
    h = (rows ^ (rows >> 29)) & 0x7FFFFFFF
    h = (h * 0x5BD1E995) & 0x7FFFFFFF  # < 2^62: exact in int64
    return (h ^ (h >> 15)) % sets


def cache_lookup(
    rows: torch.Tensor,
    tags: torch.Tensor,
    stamps: torch.Tensor,
    counts: torch.Tensor,
    sets: int,
    ways: int,
    t: int,
) -> torch.Tensor:
    """`triton_rows.cache_lookup`'s twin: slots (n,) of rows (n,) (-1: not cached), hits stamped `t`,
    counts[0] += the distinct rows found (torch.unique: a sync on CUDA, which the kernel avoids)."""
    way = torch.arange(ways, device=rows.device)
    base = set_of(rows.reshape(-1), sets) * ways
    eq = tags[base[:, None] + way] == rows.reshape(-1)[:, None]  # (n, W)
    hit = eq.any(1)
    slot = torch.where(hit, base + (eq.long() * way).sum(1), -1)
    found = slot[hit]
    counts[0] += torch.unique(found).numel()
    stamps[found] = t
    return slot


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] <- src[src_idx[i]] where dst_idx[i] >= 0, in place (`triton_rows.copy_rows`'s twin;
    the boolean mask syncs on CUDA, which the kernel avoids)."""
    keep = dst_idx >= 0
    dst[dst_idx[keep].long()] = src[src_idx[keep].long().to(src.device)].to(dst.device)


def gate(
    h: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dead: torch.Tensor | None = None,
    eps: float = 1e-6,
    clamp: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (B, T, hc, dim), key (B, T, hc, dim), v (B, T, dim), w (hc, dim) -> (h + gates * v, gates)."""
    dim = h.shape[-1]
    dot = (h * w * key).sum(-1)  # (B, T, hc)
    dot = dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps)
    gates = signed_sqrt_gate(dot * dim**-0.5, clamp)  # (B, T, hc)
    if dead is not None:
        gates = gates.masked_fill(dead[..., None], 0.0)
    return h + gates[..., None] * v[:, :, None, :], gates


def check_gate_inputs(
    h: torch.Tensor, key: torch.Tensor, v: torch.Tensor, w: torch.Tensor, dead: torch.Tensor | None
) -> None:
    """The shapes every gate kernel takes: h and key (B, T, hc, dim), v (B, T, dim), w (hc, dim), dead
    (B, T) bool or None; raises naming what does not fit."""
    bsz, seq, hc, dim = h.shape
    if key.shape != h.shape or v.shape != (bsz, seq, dim) or w.shape != (hc, dim):
        raise ValueError(
            f"shapes do not fit: h {tuple(h.shape)}, key {tuple(key.shape)} (expected h's), "
            f"v {tuple(v.shape)} (expected {(bsz, seq, dim)}), w {tuple(w.shape)} (expected {(hc, dim)})"
        )
    if dead is not None and (dead.dtype != torch.bool or dead.shape != (bsz, seq)):
        raise ValueError(f"dead must be bool {(bsz, seq)}, got {dead.dtype} {tuple(dead.shape)}")


def signed_sqrt_gate(dot: torch.Tensor, clamp: float = 1e-6) -> torch.Tensor:
    """sigmoid(sign(dot) * sqrt(max(|dot|, clamp))): keeps the sigmoid out of saturation."""
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp).sqrt(), dot))


# ------------------------------------------------------------------ the Sinkhorn-balanced update
# The plain torch twins of `cpu_sinkhorn`'s passes over a table's A active rows (SPEC §7b), and the
# path on devices without a compiled one. Shapes: mom, u (A, n) in the state dtype; gidx (A,) int64
# (row of grad, or -1); grad (R, n); rho (A,) float64; keep (A,) bool.


def sinkhorn_blend(
    mom: torch.Tensor, gidx: torch.Tensor, grad: torch.Tensor, beta: float, u: torch.Tensor, rho: torch.Tensor
) -> tuple[float, int]:
    """mom <- beta * mom + (1 - beta) * g; u <- beta * mom + (1 - beta) * g; rho <- row norms of u;
    returns (sum of rho, rows whose momentum is now zero)."""
    g = torch.zeros_like(mom)
    has = gidx >= 0
    g[has] = grad[gidx[has]]
    mom.mul_(beta).add_(g, alpha=1.0 - beta)
    torch.add(mom * beta, g, alpha=1.0 - beta, out=u)
    rho.copy_(torch.linalg.vector_norm(u.double(), dim=1))
    return float(rho.sum()), int((~mom.ne(0).any(dim=1)).sum())  # sync point


def sinkhorn_rows(
    u: torch.Tensor, rho: torch.Tensor, thresh: float, eps: float, keep: torch.Tensor
) -> torch.Tensor:
    """Rows with rho <= thresh set to 0 (keep False), the others divided by (rho + eps); the column
    sums of squares (n,) float64."""
    keep.copy_(rho > thresh)
    u.mul_(torch.where(keep, 1.0 / (rho + eps), 0.0).to(u.dtype)[:, None])
    return u.double().square().sum(dim=0)


def sinkhorn_cols_rows(
    u: torch.Tensor, colinv: torch.Tensor, keep: torch.Tensor, eps: float, want_colsq: bool
) -> torch.Tensor:
    """u_ij *= colinv_j, then each kept row divided by (its norm + eps); the new column sums of squares."""
    u.mul_(colinv.to(u.dtype)[None, :])
    norms = torch.linalg.vector_norm(u.double(), dim=1)
    u.mul_(torch.where(keep, 1.0 / (norms + eps), 0.0).to(u.dtype)[:, None])
    if not want_colsq:
        return torch.zeros(u.shape[1], dtype=torch.float64, device=u.device)
    return u.double().square().sum(dim=0)
