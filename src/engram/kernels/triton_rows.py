"""Triton kernels of a device-indexed row cache: its lookup, and the masked row copy that fills it.

`cache_lookup`: each row's slot in a set-associative cache (its set's `ways` tags compared), the hits
touched (their stamp set to the call's, by atomic exchange, which also counts each cached row once)
in one pass, no host sync. `copy_rows`: dst[dst_idx[i]] = src[src_idx[i]] for every i with
dst_idx[i] >= 0; the positions that copy nothing cost one index load, so the bytes moved follow the
misses. `src` may be a CUDA view of pinned host memory (`engram.systems.uva`): the rows then cross
PCIe inside the kernel, no staging, no copy engine. Raw bytes, no dequantisation (that stays
`triton_lookup`'s). Both check shapes, not index values. Twins: `engram.kernels.reference.cache_lookup`
and `reference.copy_rows`. Design: docs/systems.md, docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["cache_lookup", "copy_rows"]

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


@triton.jit(do_not_specialize=["n", "t"])  # t changes every call: one compiled kernel for all
def _cache_lookup_kernel(
    rows_ptr,  # (n,) int64 row ids
    tags_ptr,  # (S * W + 1,) int64 row held by each slot, -1 empty
    stamps_ptr,  # (S * W + 1,) int64 call that last used each slot
    slot_ptr,  # (n,) int64 out: the row's slot, -1 when not cached
    counts_ptr,  # (>= 1,) int64: counts[0] += the distinct rows found
    n,
    sets,
    t,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = i < n
    r = tl.load(rows_ptr + i, mask=live, other=-1).to(tl.int64)
    h = (r ^ (r >> 29)) & 0x7FFFFFFF  # reference.set_of: the same 31-bit mix
    h = (h * 0x5BD1E995) & 0x7FFFFFFF
    base = ((h ^ (h >> 15)) % sets) * W
    w = tl.arange(0, BLOCK_W)
    tags = tl.load(tags_ptr + base[:, None] + w[None, :], mask=live[:, None] & (w < W)[None, :], other=-2)
    way = tl.max(tl.where(tags == r[:, None], w[None, :], -1), axis=1)  # a row sits in one way at most
    hit = live & (way >= 0)
    slot = tl.where(hit, base + way, -1)
    tl.store(slot_ptr + i, slot, mask=live)
    stamp = tl.full((BLOCK_N,), t, tl.int64)
    old = tl.atomic_xchg(stamps_ptr + slot, stamp, mask=hit)  # touch; the first toucher sees an older stamp
    tl.atomic_add(counts_ptr, tl.sum((hit & (old != stamp)).to(tl.int64), axis=0))


def cache_lookup(
    rows: torch.Tensor,
    tags: torch.Tensor,
    stamps: torch.Tensor,
    counts: torch.Tensor,
    sets: int,
    ways: int,
    t: int,
) -> torch.Tensor:
    """Slots (n,) int64 of rows (n,) int64 in a cache of `sets` x `ways` slots (-1: not cached); the hits'
    stamps set to `t` (which must exceed every stamp in `stamps`), counts[0] += the distinct rows found.
    tags / stamps (sets * ways + 1,) int64, all on one device. No sync."""
    for name, x in (("rows", rows), ("tags", tags), ("stamps", stamps), ("counts", counts)):
        if x.dtype != torch.int64 or not x.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int64 tensor, got {x.dtype}")
    if tags.shape != (sets * ways + 1,) or stamps.shape != tags.shape:
        raise ValueError(
            f"tags {tuple(tags.shape)} / stamps {tuple(stamps.shape)} must be ({sets * ways + 1},)"
        )
    n = rows.numel()
    slot = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n == 0:
        return slot
    block_n = 64
    _cache_lookup_kernel[(triton.cdiv(n, block_n),)](
        rows.reshape(-1),
        tags,
        stamps,
        slot,
        counts,
        n,
        sets,
        t,
        W=ways,
        BLOCK_N=block_n,
        BLOCK_W=triton.next_power_of_2(ways),
    )
    return slot


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
