"""Triton kernels for the lookups on CUDA: rows of an FP8 e4m3 table with one ue8m0 scale per block of
values (`fp8_gather`), or of an integer-format table (`int_gather`: int8 or two 4-bit ints a byte, one
bfloat16 scale per block or row) -> dequantised rows in bfloat16, float32 or float16, in one pass.

Bit-exact to `engram.storage.lookup.dequantize_gather` for every finite value, by integer bit
manipulation (no reliance on the GPU's fp8 support). Checks nothing, so never syncs: row ids are
the caller's to validate (`engram.rowformat.fp8.check_rows`), a 255 scale byte gives NaN rows.
Design: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_gather", "int_gather"]

_BLOCK_N = 16  # rows per program
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _fp8_gather_kernel(
    v_ptr,  # (R, D) uint8 e4m3 bytes
    s_ptr,  # (R, NB) uint8 ue8m0 bytes
    rows_ptr,  # (n,) int64 / int32
    out_ptr,  # (n, D) float32 / int16 (bfloat16 bits) / float16
    n,
    D: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (i < n)[:, None] & (c < D)[None, :]
    r = tl.load(rows_ptr + i, mask=i < n, other=0).to(tl.int64)
    byte = tl.load(v_ptr + r[:, None] * D + c[None, :], mask=mask, other=0).to(tl.int32)
    sbyte = tl.load(s_ptr + r[:, None] * NB + (c // (D // NB))[None, :], mask=mask, other=127).to(tl.int32)
    sign = (byte & 0x80) << 24
    em = byte & 0x7F
    normal = sign | ((em << 20) + (120 << 23))
    subnormal = (em.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign  # mmm * 2^-9, exact
    bits = tl.where(em >= 8, normal, subnormal)
    bits = tl.where(em == 0x7F, sign | 0x7FF00000, bits)  # NaN, with torch's CPU bits
    sbits = tl.where(sbyte == 0, 1 << 22, sbyte << 23)
    sbits = tl.where(sbyte == 255, 0x7FC00000, sbits)
    x = bits.to(tl.float32, bitcast=True) * sbits.to(tl.float32, bitcast=True)  # exact unless subnormal
    dst = out_ptr + i[:, None] * D + c[None, :]
    if OUT_KIND == 0:
        tl.store(dst, x, mask=mask)
    elif OUT_KIND == 1:  # bfloat16 bits, round to nearest even; NaN -> quiet NaN of the same sign
        u = x.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        quiet = (u >> 16) | 0x40
        tl.store(dst, tl.where(x != x, quiet, rounded).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dst, x.to(tl.float16), mask=mask)


def fp8_gather(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantised rows (..., D) in `dtype` of the table values (R, D) / scales (R, D // block) for row
    ids `rows` (...) int64/int32, all on one device (CUDA, or CPU under TRITON_INTERPRET=1). No
    checks of the ids or scale bytes (see docs/kernels.md); no device sync."""
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(
            f"values/scales must be float8_e4m3fn/float8_e8m0fnu, got {values.dtype}/{scales.dtype}"
        )
    if dtype not in _OUT_KINDS:
        raise TypeError(f"dtype {dtype} is not one of {', '.join(str(d) for d in _OUT_KINDS)}")
    n_table, dim = values.shape
    nb = scales.shape[1]
    if scales.shape[0] != n_table or nb == 0 or dim % nb:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit values {tuple(values.shape)}")
    shape = (*rows.shape, dim)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=values.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    n = rows.numel()
    if n == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(dim, block_d))
    _fp8_gather_kernel[grid](
        values.contiguous().view(torch.uint8),
        scales.contiguous().view(torch.uint8),
        rows.reshape(-1).contiguous(),
        out.view(torch.int16) if dtype == torch.bfloat16 else out,
        n,
        D=dim,
        NB=nb,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        OUT_KIND=_OUT_KINDS[dtype],
    )
    return out


@triton.jit
def _int_gather_kernel(
    v_ptr,  # (R, W) uint8: int8 bytes (W = D), or two 4-bit ints a byte (W = D / 2, FOUR; docs/storage.md)
    s_ptr,  # (R, NB) int16 bfloat16 bits
    rows_ptr,  # (n,) int64 / int32
    out_ptr,  # (n, D) float32 / int16 (bfloat16 bits) / float16
    n,
    D: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    FOUR: tl.constexpr,
    HALF: tl.constexpr,  # values a block / 2 (4-bit)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (i < n)[:, None] & (c < D)[None, :]
    r = tl.load(rows_ptr + i, mask=i < n, other=0).to(tl.int64)
    if FOUR:  # value j of a block: byte j % HALF of its HALF bytes, low nibble for j < HALF, else high
        j = c % (2 * HALF)
        at = (c // (2 * HALF)) * HALF + j % HALF
        byte = tl.load(v_ptr + r[:, None] * W + at[None, :], mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((j // HALF) * 4)[None, :]) & 0xF
        q = nib - ((nib & 8) << 1)
    else:
        byte = tl.load(v_ptr + r[:, None] * W + c[None, :], mask=mask, other=0).to(tl.int32)
        q = byte - ((byte & 0x80) << 1)  # the int8 of the byte
    sbits = tl.load(s_ptr + r[:, None] * NB + (c // (D // NB))[None, :], mask=mask, other=0x3F80)
    scale = ((sbits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # exact
    x = q.to(tl.float32) * scale  # exact unless it underflows (16 significant bits at most)
    dst = out_ptr + i[:, None] * D + c[None, :]
    if OUT_KIND == 0:
        tl.store(dst, x, mask=mask)
    elif OUT_KIND == 1:  # bfloat16 bits, round to nearest even; NaN (a bad scale) -> quiet NaN
        u = x.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        quiet = (u >> 16) | 0x40
        tl.store(dst, tl.where(x != x, quiet, rounded).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dst, x.to(tl.float16), mask=mask)


def int_gather(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantised rows (..., D) in `dtype` of an integer-format table: values (R, D) int8, or (R, D / 2)
    uint8 of two 4-bit ints; scales (R, NB) bfloat16, one per block of D // NB values; row ids `rows`
    (...) int64/int32, all on one device (CUDA, or CPU under TRITON_INTERPRET=1). No checks of the ids or
    scales (see docs/kernels.md); no device sync."""
    if values.dtype not in (torch.int8, torch.uint8) or scales.dtype != torch.bfloat16:
        raise TypeError(f"values/scales must be int8 or uint8/bfloat16, got {values.dtype}/{scales.dtype}")
    if dtype not in _OUT_KINDS:
        raise TypeError(f"dtype {dtype} is not one of {', '.join(str(d) for d in _OUT_KINDS)}")
    four = values.dtype == torch.uint8
    n_table, width = values.shape
    dim = 2 * width if four else width
    nb = scales.shape[1]
    if scales.shape[0] != n_table or nb == 0 or dim % nb or (four and (dim // nb) % 2):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit values {tuple(values.shape)}")
    shape = (*rows.shape, dim)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=values.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    n = rows.numel()
    if n == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(dim, block_d))
    _int_gather_kernel[grid](
        values.contiguous().view(torch.uint8),
        scales.contiguous().view(torch.int16),
        rows.reshape(-1).contiguous(),
        out.view(torch.int16) if dtype == torch.bfloat16 else out,
        n,
        D=dim,
        W=width,
        NB=nb,
        FOUR=four,
        HALF=dim // nb // 2,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        OUT_KIND=_OUT_KINDS[dtype],
    )
    return out
