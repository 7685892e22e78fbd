"""Triton kernel for the n-gram hash (SPEC §4) on CUDA: compressed ids -> table rows, bit-exact to
`engram.addressing.hashing` (tested against `NgramHasher.hash_compressed` and `reference.hash_rows`).

Knows the layout's arrays and an optional carried look-back window; all int64 arithmetic. Imports
triton; `engram.kernels` imports it on first use only. Design: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["hash_rows"]

_BLOCK = 128  # tokens per program


@triton.jit
def _hash_kernel(
    xc_ptr,  # (B*T,) int64 compressed ids
    dead_ptr,  # (B*T,) uint8, read if HAS_DEAD
    starts_ptr,  # (B*T,) uint8, read if HAS_STARTS: a window restarts at this position
    win_ptr,  # (B, N_GRAM-1) int64 carried look-back (column 0 most recent), read if HAS_WINDOW
    mult_ptr,  # (L, N_GRAM) int64
    primes_ptr,  # (L*(N_GRAM-1)*K,) int64, (layer, order, head) order
    offsets_ptr,  # same
    out_ptr,  # (B*T, L*(N_GRAM-1)*K) int64 or int32
    n_tok,
    seq_len,
    pad,
    N_GRAM: tl.constexpr,
    N_LAYERS: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # flat token ids
    valid = f < n_tok
    b = f // seq_len
    t = f - b * seq_len
    head = tl.arange(0, K_P2)
    hmask = head < K
    width = N_LAYERS * (N_GRAM - 1) * K
    x0 = tl.load(xc_ptr + f, mask=valid, other=0)
    if HAS_DEAD:
        dead0 = tl.load(dead_ptr + f, mask=valid, other=0) != 0
    else:
        dead0 = f < 0  # all False
    look0 = tl.where(dead0, pad, x0)  # a dead token sees only pads
    for li in tl.static_range(N_LAYERS):
        mix = look0 * tl.load(mult_ptr + li * N_GRAM)
        blocked = dead0
        for i in tl.static_range(1, N_GRAM):
            s = t - i
            in_seq = s >= 0
            if HAS_STARTS:  # a start at s+1 hides s and everything farther (sticky)
                start_s = tl.load(starts_ptr + f - i + 1, mask=valid & (s >= -1), other=0) != 0
                blocked = blocked | start_s
            if HAS_DEAD:  # sticky: the first dead position pads this look-back and every farther one
                dead_s = tl.load(dead_ptr + f - i, mask=valid & in_seq, other=0) != 0
                blocked = blocked | (in_seq & dead_s)
            x_s = tl.load(xc_ptr + f - i, mask=valid & in_seq, other=pad)
            if HAS_WINDOW:  # carried values already carry their blocking
                x_w = tl.load(win_ptr + b * (N_GRAM - 1) + (i - t - 1), mask=valid & (s < 0), other=pad)
            else:
                x_w = tl.full([BLOCK], pad, tl.int64)
            look = tl.where(blocked, pad, tl.where(in_seq, x_s, x_w))
            mix = mix ^ (look * tl.load(mult_ptr + li * N_GRAM + i))  # exact: products < 2^63
            col = (li * (N_GRAM - 1) + (i - 1)) * K  # first column of this (layer, order)
            p = tl.load(primes_ptr + col + head, mask=hmask, other=1)
            off = tl.load(offsets_ptr + col + head, mask=hmask, other=0)
            rows = mix[:, None] % p[None, :] + off[None, :]  # (BLOCK, K_P2); mix >= 0: floor mod
            dst = out_ptr + f[:, None] * width + col + head[None, :]
            tl.store(dst, rows.to(out_ptr.dtype.element_ty), mask=valid[:, None] & hmask[None, :])


def hash_rows(
    xc: torch.Tensor,
    dead: torch.Tensor | None,
    window: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    out: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows (B, T, L, orders*K) of compressed ids xc (B, T) int64 on one device.

    dead (B, T) bool or None; starts (B, T) bool or None (True: a window restarts there); window (B, max_ngram-1) int64 or None (a sequence start);
    multipliers (L, max_ngram) int64; primes, offsets (L, orders, K) int64 (`NgramHasher`'s arrays as
    tensors); out (B, T, L, orders*K) int64 or int32, contiguous, or None for int64.
    """
    if xc.dim() != 2:
        raise ValueError(f"xc must be compressed ids [B, T], got shape {tuple(xc.shape)}")
    n_layers, n_gram = multipliers.shape
    k = primes.shape[-1]
    if tuple(primes.shape) != (n_layers, n_gram - 1, k) or primes.shape != offsets.shape:
        raise ValueError(
            f"primes {tuple(primes.shape)} and offsets {tuple(offsets.shape)} must both be "
            f"(layers, orders, K) = ({n_layers}, {n_gram - 1}, K) for multipliers {tuple(multipliers.shape)}"
        )
    bsz, seq = xc.shape
    shape = (bsz, seq, n_layers, (n_gram - 1) * k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=xc.device)
    elif tuple(out.shape) != shape or not out.is_contiguous() or out.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"out must be contiguous int64/int32 of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    if window is not None and tuple(window.shape) != (bsz, n_gram - 1):
        raise ValueError(f"window has shape {tuple(window.shape)}; expected {(bsz, n_gram - 1)}")
    if dead is not None and dead.shape != xc.shape:
        raise ValueError(f"dead has shape {tuple(dead.shape)} but xc has shape {tuple(xc.shape)}")
    if starts is not None and (starts.shape != xc.shape or starts.dtype != torch.bool):
        raise ValueError(
            f"starts must be bool of xc's shape {tuple(xc.shape)}, got {starts.dtype} {tuple(starts.shape)}"
        )
    n_tok = bsz * seq
    if n_tok == 0:
        return out
    xc1 = xc.to(torch.int64).contiguous()
    dead1 = xc1 if dead is None else dead.contiguous().view(torch.uint8)  # any pointer when unused
    win1 = xc1 if window is None else window.to(torch.int64).contiguous()
    starts1 = xc1 if starts is None else starts.contiguous().view(torch.uint8)
    _hash_kernel[(triton.cdiv(n_tok, _BLOCK),)](
        xc1,
        dead1,
        starts1,
        win1,
        multipliers.to(torch.int64).contiguous(),
        primes.to(torch.int64).contiguous().view(-1),
        offsets.to(torch.int64).contiguous().view(-1),
        out,
        n_tok,
        seq,
        int(pad),
        N_GRAM=n_gram,
        N_LAYERS=n_layers,
        K=k,
        K_P2=triton.next_power_of_2(k),
        HAS_DEAD=dead is not None,
        HAS_STARTS=starts is not None,
        HAS_WINDOW=window is not None,
        BLOCK=_BLOCK,
    )
    return out
