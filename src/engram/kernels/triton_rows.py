"""Triton kernel for a masked row copy: dst[dst_idx[i]] = src[src_idx[i]] for every i with dst_idx[i] >= 0.

What a device-indexed row cache needs to fill its slots without a host sync: the launch covers all n
positions (a size the host knows), and the positions that copy nothing (dst_idx -1) cost one index
load, so the bytes moved follow the misses, not n. `src` may be a CUDA view of pinned host memory
(`engram.systems.uva`): the rows then cross PCIe inside the kernel, no staging, no copy engine.
Raw bytes, no dequantisation (that stays `triton_lookup`'s). Checks shapes, not index values.
Twin: `engram.kernels.reference.copy_rows`. Design: docs/systems.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_rows"]

_BLOCK_N = 32  # rows per program


@triton.jit
def _copy_rows_kernel(
    src_ptr,  # (R, W) words
    src_idx_ptr,  # (n,) int64 / int32
    dst_ptr,  # (C, W) words
    dst_idx_ptr,  # (n,) int64 / int32, -1: copy nothing
    n,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.load(dst_idx_ptr + i, mask=i < n, other=-1).to(tl.int64)
    keep = (i < n) & (d >= 0)
    s = tl.load(src_idx_ptr + i, mask=keep, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    mask = keep[:, None] & (c < W)[None, :]
    x = tl.load(src_ptr + s[:, None] * W + c[None, :], mask=mask)
    tl.store(dst_ptr + d[:, None] * W + c[None, :], x, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A byte table (R, B) viewed in the widest words (8, 4, 2 or 1 bytes) its row width and address allow:
    wide loads matter most when the rows cross PCIe."""
    b = t.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.shape[1] % size == 0 and b.data_ptr() % size == 0:
            return b.view(dtype)
    return b


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[dst_idx[i]] <- src[src_idx[i]] for each i with dst_idx[i] >= 0 (raw bytes), in place.

    src (R, B) / dst (C, B): contiguous tables of one element size and row width, src readable by the
    device (a CUDA tensor, or a UVA view of pinned host memory); src_idx / dst_idx (n,) int64 or int32
    on dst's device. Index values are not checked (no sync): the caller's. Two positions writing one
    dst row is the caller's error (one of them wins)."""
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous table (rows, width), got shape {tuple(t.shape)}")
    if src.element_size() != dst.element_size() or src.shape[1] != dst.shape[1]:
        raise ValueError(
            f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} {tuple(dst.shape)} need one row width"
        )
    n = dst_idx.numel()
    if src_idx.shape != (n,) or dst_idx.shape != (n,):
        raise ValueError(f"src_idx {tuple(src_idx.shape)} and dst_idx {tuple(dst_idx.shape)} must be (n,)")
    for name, t in (("src_idx", src_idx), ("dst_idx", dst_idx)):
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
    if n == 0 or dst.numel() == 0:
        return
    s, d = _words(src), _words(dst)
    if s.dtype != d.dtype:  # one of them sits at an odd address: bytes for both
        s, d = src.view(torch.uint8), dst.view(torch.uint8)
    w = s.shape[1]
    _copy_rows_kernel[(triton.cdiv(n, _BLOCK_N),)](
        s,
        src_idx.contiguous(),
        d,
        dst_idx.contiguous(),
        n,
        W=w,
        BLOCK_N=_BLOCK_N,
        BLOCK_W=triton.next_power_of_2(w),
    )
