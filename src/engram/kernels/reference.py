"""Plain torch twins of the Triton kernels of `engram.kernels`: what each kernel must equal, and the
eager path on devices without triton.

The hash (`hash_rows`) and the decode step on the packed stream state (`stream_hash`,
`stream_commit`), the FP8 and integer-format gathers (`fp8_gather`, `int_gather`: no checks, so no
device sync), the masked row copy of a device-indexed cache's fill (`copy_rows`) and its lookup
(`cache_lookup`, `set_of`), the V4.1
gate (`gate`, the eager path of `Engram` itself, so the fused kernel is tested against the
module's own code), plus the gate nonlinearity both Engram variants share; the passes of the
Sinkhorn-balanced table update (`sinkhorn_*`, twins of `cpu_sinkhorn`). Design: docs/kernels.md.
"""

from __future__ import annotations

import torch

from engram.kernels.stream_state import StreamLayout
from engram.rowformat.fp8 import scale_bytes_to_float

__all__ = [
    "cache_lookup",
    "check_gate_inputs",
    "copy_rows",
    "fp8_gather",
    "gate",
    "hash_rows",
    "int_gather",
    "set_of",
    "signed_sqrt_gate",
    "sinkhorn_blend",
    "sinkhorn_cols_rows",
    "sinkhorn_rows",
    "stream_commit",
    "stream_hash",
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


def _advance(
    win: torch.Tensor, x: torch.Tensor, start: torch.Tensor, clear: torch.Tensor, pad: int
) -> torch.Tensor:
    """The (n, W) windows after tokens x (n,): x most recent, older pad after a start, all pad if clear."""
    new = torch.cat([x[:, None], win[:, :-1]], dim=1)
    new[:, 1:] = torch.where(start[:, None], pad, new[:, 1:])
    return torch.where(clear[:, None], pad, new)


def stream_hash(
    ids: torch.Tensor,
    dead: torch.Tensor | None,
    starts: torch.Tensor | None,
    seqs: torch.Tensor | None,
    state: torch.Tensor,
    layout: StreamLayout,
    lut: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    restart_id: int | None,
    out: torch.Tensor,
    *,
    draft: bool = False,
) -> torch.Tensor:
    """The twin of `triton_hash.stream_hash`: rows (n, T, L, orders*K) into `out`, `state` updated in place."""
    n, t = ids.shape
    w, c = layout.window, layout.max_draft
    sb = torch.arange(n, device=ids.device) if seqs is None else seqs.long()
    st = state[sb]  # (n, F) copy
    pos, nd, err = st[:, layout.position], st[:, layout.n_draft], st[:, layout.err : layout.err + 4]
    x_all = ids.long()
    bad = (x_all < 0) | (x_all >= lut.shape[0])  # (n, T)
    has_bad = bad.any(dim=1)
    first_bad = torch.where(has_bad, bad.int().argmax(dim=1), -1).long()
    bad_id = x_all.gather(1, first_bad.clamp_min(0)[:, None])[:, 0]
    code = torch.where(has_bad, 1, 0)
    if draft:
        code = torch.where((code == 0) & (nd + t > c), 3, code)
        tok_pos = pos + nd + first_bad
    else:
        code = torch.where((code == 0) & (nd != 0), 2, code)
        tok_pos = pos + first_bad
    ok = code == 0
    record = (code != 0) & (err[:, 0] == 0)
    new_err = torch.stack(
        [
            code,
            torch.where(code == 1, tok_pos, pos),
            torch.where(code == 1, bad_id, nd),
            torch.where(code == 1, first_bad, t),
        ],
        dim=1,
    )
    err[record] = new_err[record]
    win = st[:, :w].clone()
    prev_end = torch.zeros(n, dtype=torch.bool, device=ids.device)
    if draft:
        for d in range(c):
            act = ok & (d < nd)
            v = st[:, layout.vals + d]
            fl = st[:, layout.flags + d]
            ended = (fl & 4) != 0
            stepped = _advance(win, v, (fl & 2) != 0, ((fl & 1) != 0) | ended, pad)
            win = torch.where(act[:, None], stepped, win)
            prev_end = torch.where(act, ended, prev_end)
    n_layers, n_gram = multipliers.shape
    k = primes.shape[-1]
    rows = out.view(n, t, n_layers, (n_gram - 1) * k)
    for j in range(t):
        tok = x_all[:, j]
        x = lut[tok.clamp(0, lut.shape[0] - 1)]
        dead_j = ~ok if dead is None else dead[:, j] | ~ok
        start = torch.zeros_like(ok) if starts is None else starts[:, j].clone()
        start |= prev_end
        end = torch.zeros_like(ok) if restart_id is None else tok == restart_id
        prev_end = end
        x = torch.where(dead_j, pad, x)
        look = torch.where((dead_j | start)[:, None], pad, win)  # (n, W)
        rows[:, j] = hash_rows(x[:, None], None, look, multipliers, primes, offsets, pad)[:, 0].to(out.dtype)
        if draft:
            slot = (nd + j).clamp_max(c - 1)[:, None]
            flags = dead_j.long() | (start.long() << 1) | (end.long() << 2)
            vals_c = st[:, layout.vals : layout.vals + c]
            flags_c = st[:, layout.flags : layout.flags + c]
            vals_c.scatter_(1, slot, torch.where(ok, x, vals_c.gather(1, slot)[:, 0])[:, None])
            flags_c.scatter_(1, slot, torch.where(ok, flags, flags_c.gather(1, slot)[:, 0])[:, None])
        win = torch.where(ok[:, None], _advance(win, x, start, dead_j | end, pad), win)
    if draft:
        st[:, layout.n_draft] = torch.where(ok, nd + t, nd)
    else:
        st[:, :w] = torch.where(ok[:, None], win, st[:, :w])
        st[:, layout.position] = torch.where(ok, pos + t, pos)
    st[:, layout.err : layout.err + 4] = err
    state[sb] = st
    return out


def stream_commit(n_accepted: torch.Tensor, state: torch.Tensor, layout: StreamLayout, pad: int) -> None:
    """The twin of `triton_hash.stream_commit`: keep n_accepted[b] drafts of each sequence (-1: none touched)."""
    w = layout.window
    k = n_accepted.long()
    pos, nd = state[:, layout.position].clone(), state[:, layout.n_draft].clone()
    err = state[:, layout.err : layout.err + 4]
    act = k >= 0
    bad = act & (k > nd)
    record = bad & (err[:, 0] == 0)
    err[record] = torch.stack([torch.full_like(k, 4), pos, k, nd], dim=1)[record]
    ok = act & ~bad
    win = state[:, :w].clone()
    for d in range(layout.max_draft):
        a = ok & (d < k)
        v = state[:, layout.vals + d]
        fl = state[:, layout.flags + d]
        win = torch.where(a[:, None], _advance(win, v, (fl & 2) != 0, (fl & 5) != 0, pad), win)
    state[:, :w] = win
    state[:, layout.position] = torch.where(ok, pos + k, pos)
    state[:, layout.n_draft] = torch.where(ok, 0, nd)


def fp8_gather(
    values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(..., D) in `dtype`: fp8 values of the rows times their blocks' 2^(b - 127), in float32, then cast."""
    nb = scales.shape[1]
    v = values.view(torch.uint8)[rows].view(torch.float8_e4m3fn).float()  # (..., D)
    s = scale_bytes_to_float(scales.view(torch.uint8)[rows])  # (..., nb)
    return (v.unflatten(-1, (nb, -1)) * s[..., None]).flatten(-2).to(dtype)


def int_gather(
    values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(..., D) in `dtype`: the integers of the rows (int8 values, or uint8 bytes of two 4-bit ints: byte j
    of a block holds its value j in the low nibble, value j + block / 2 in the high one) times their
    blocks' bfloat16 scales, in float32, then cast."""
    nb = scales.shape[1]
    b = values[rows].to(torch.int32)  # (..., W)
    if values.dtype == torch.uint8:
        b = b.unflatten(-1, (nb, -1))  # (..., nb, block / 2)
        b = torch.stack((b & 0xF, b >> 4), dim=-2).flatten(-3)  # (..., D) nibbles, block by block
        b = b - ((b & 8) << 1)  # 4-bit two's complement
    s = scales[rows].float()  # (..., nb)
    return (b.float().unflatten(-1, (nb, -1)) * s[..., None]).flatten(-2).to(dtype)


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
