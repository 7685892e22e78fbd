"""Triton kernels for the lookups on CUDA: rows of an FP8 e4m3 table with one ue8m0 scale per block of
values (`fp8_gather`), or of an integer-format table (`int_gather`: int8 or two 4-bit ints a byte, one
bfloat16 scale per block or row) -> dequantised rows in bfloat16, float32 or float16, in one pass.

A program takes BLOCK_N rows whole, as a (rows, blocks, values per block) tile: a row's bytes load as
wide contiguous vectors, its scale bytes once per block (not once per value), and the rows are stored
contiguously. Bit-exact to `engram.storage.lookup.dequantize_gather` for every finite value: the fp8
values decode exactly, the product with a power-of-two scale is exact in float32 (subnormals kept),
and bfloat16 is rounded to nearest even; with `hw_convert` (compiled on sm_89+) by the GPU's own
conversions (e4m3x2 -> f16x2, f32 -> bf16x2), else by integer bit manipulation (older GPUs, the
interpreter, whose fp8 and bf16 casts are not the GPU's). `order` (a permutation of the positions, e.g. the ids
sorted, `dedup_order`) walks repeated rows together so each is read from memory once; no host sync.
Checks nothing, so never syncs: row ids are the caller's to validate (`engram.rowformat.fp8.check_rows`),
a 255 scale byte gives NaN rows. Design: docs/kernels.md.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["dedup_order", "fp8_gather", "int_gather"]

_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# rows per program and warps; benchmarks/bench_lookup.py sweeps them on the GPU (`run_cuda`)
BLOCK_N = 16
NUM_WARPS = 4


@triton.jit
def _fp8_gather_kernel(
    v_ptr,  # (R, D) uint8 e4m3 bytes
    s_ptr,  # (R, NB) uint8 ue8m0 bytes
    rows_ptr,  # (n,) int64 / int32 table rows, in the order the programs take them
    dest_ptr,  # (n,) int64 output position of each, read if HAS_DEST (else position i is row i)
    out_ptr,  # (n, D) float32 / int16 (bfloat16 bits) / float16
    n,
    D: tl.constexpr,
    NB: tl.constexpr,  # scale blocks per row
    NB_P2: tl.constexpr,
    BLK: tl.constexpr,  # values per block (D // NB)
    BLK_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_KIND: tl.constexpr,
    HAS_DEST: tl.constexpr,
    HW_CVT: tl.constexpr,  # the GPU's e4m3 and bf16 conversions (sm_89+, compiled only)
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = i < n
    r = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
    if HAS_DEST:
        p = tl.load(dest_ptr + i, mask=live, other=0).to(tl.int64)
    else:
        p = i
    blk = tl.arange(0, NB_P2)
    e = tl.arange(0, BLK_P2)
    col = blk[None, :, None] * BLK + e[None, None, :]  # (1, NB_P2, BLK_P2) column in the row
    if NB_P2 == NB and BLK_P2 == BLK:  # V4.1's 8 x 32: rows whole, masked by row only
        mask = live[:, None, None]
        smask = live[:, None, None]
    else:
        mask = live[:, None, None] & (blk < NB)[None, :, None] & (e < BLK)[None, None, :]
        smask = live[:, None, None] & (blk < NB)[None, :, None]
    byte = tl.load(v_ptr + r[:, None, None] * D + col, mask=mask, other=0)  # (BLOCK_N, NB_P2, BLK_P2) uint8
    sb = tl.load(s_ptr + r[:, None, None] * NB + blk[None, :, None], mask=smask, other=127).to(tl.int32)
    sbits = tl.where(sb == 0, 1 << 22, sb << 23)  # 2^(b - 127); byte 0 is the subnormal 2^-127
    scale = tl.where(sb == 255, 0x7FC00000, sbits).to(tl.float32, bitcast=True)  # (BLOCK_N, NB_P2, 1)
    if HW_CVT:
        v = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # exact: every e4m3 value is an fp16
    else:
        b = byte.to(tl.int32)
        sign = (b & 0x80) << 24
        em = b & 0x7F
        normal = sign | ((em << 20) + (120 << 23))
        subnormal = (em.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign  # mmm * 2^-9, exact
        bits = tl.where(em >= 8, normal, subnormal)
        bits = tl.where(em == 0x7F, sign | 0x7FF00000, bits)  # NaN, with torch's CPU bits
        v = bits.to(tl.float32, bitcast=True)
    x = v * scale  # exact: a power of two (unless the product is subnormal, where it rounds as torch's)
    dst = out_ptr + p[:, None, None] * D + col
    if OUT_KIND == 0:
        tl.store(dst, x, mask=mask)
    elif OUT_KIND == 1 and HW_CVT:  # cvt.rn.bf16x2.f32: round to nearest even, subnormals kept
        tl.store(dst, x.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
    elif OUT_KIND == 1:  # bfloat16 bits, round to nearest even; NaN -> quiet NaN of the same sign
        u = x.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        quiet = (u >> 16) | 0x40
        tl.store(dst, tl.where(x != x, quiet, rounded).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dst, x.to(tl.float16), mask=mask)


@functools.cache
def _hw_convert(device: torch.device) -> bool:
    """Whether the kernel may use the GPU's e4m3 and bf16 conversions: compiled on sm_89 or later."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _out_kind(dtype: torch.dtype) -> int:
    """The kernels' OUT_KIND for an output dtype; TypeError for one they do not write."""
    if dtype not in _OUT_KINDS:
        raise TypeError(f"dtype {dtype} is not one of {', '.join(str(d) for d in _OUT_KINDS)}")
    return _OUT_KINDS[dtype]


def _rows_out(
    out: torch.Tensor | None, rows: torch.Tensor, dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The output (*rows.shape, dim) of a gather: `out` checked contiguous of that shape and dtype, or a
    new tensor on `device`."""
    shape = (*rows.shape, dim)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    return out


def dedup_order(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows sorted (n,), their positions (n,) int64): `fp8_gather(..., order=...)` then walks repeated
    rows together, so each distinct row is read from memory once. A sort on the device: no host sync
    (unlike torch.unique, whose output size the host must learn)."""
    flat = rows.reshape(-1)
    return torch.sort(flat)


def fp8_gather(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    *,
    order: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    hw_convert: bool | None = None,
) -> torch.Tensor:
    """Dequantised rows (..., D) in `dtype` of the table values (R, D) / scales (R, D // block) for row
    ids `rows` (...) int64/int32, all on one device (CUDA, or CPU under TRITON_INTERPRET=1). No
    checks of the ids or scale bytes (see docs/kernels.md); no device sync.

    `order`: `dedup_order(rows)` (or any (sorted rows, positions) pair of that form), to read
    repeated rows once. `block_n`, `num_warps`: rows per program and warps (default `BLOCK_N`,
    `NUM_WARPS`); `hw_convert`: the GPU's e4m3 and bf16 conversions (default: on sm_89+ when
    compiled); for benchmarks and tests."""
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(
            f"values/scales must be float8_e4m3fn/float8_e8m0fnu, got {values.dtype}/{scales.dtype}"
        )
    kind = _out_kind(dtype)
    n_table, dim = values.shape
    nb = scales.shape[1]
    if scales.shape[0] != n_table or nb == 0 or dim % nb:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit values {tuple(values.shape)}")
    out = _rows_out(out, rows, dim, dtype, values.device)
    n = rows.numel()
    if n == 0:
        return out
    if order is None:
        ids, dest = rows.reshape(-1), None
    else:
        ids, dest = order
        if ids.shape != (n,) or dest.shape != (n,):
            raise ValueError(
                f"order must be two ({n},) tensors (sorted rows, positions), as dedup_order gives"
            )
    blk = dim // nb
    bn = BLOCK_N if block_n is None else block_n
    _fp8_gather_kernel[(triton.cdiv(n, bn),)](
        values.contiguous().view(torch.uint8),
        scales.contiguous().view(torch.uint8),
        ids.contiguous(),
        ids if dest is None else dest.contiguous(),  # any pointer when unused
        out.view(torch.int16) if dtype == torch.bfloat16 else out,
        n,
        D=dim,
        NB=nb,
        NB_P2=triton.next_power_of_2(nb),
        BLK=blk,
        BLK_P2=triton.next_power_of_2(blk),
        BLOCK_N=bn,
        OUT_KIND=kind,
        HAS_DEST=dest is not None,
        HW_CVT=_hw_convert(values.device) if hw_convert is None else hw_convert,
        num_warps=NUM_WARPS if num_warps is None else num_warps,
    )
    return out


INT_BLOCK_N = 16  # rows per program of the integer-format gather


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
    kind = _out_kind(dtype)
    four = values.dtype == torch.uint8
    n_table, width = values.shape
    dim = 2 * width if four else width
    nb = scales.shape[1]
    if scales.shape[0] != n_table or nb == 0 or dim % nb or (four and (dim // nb) % 2):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit values {tuple(values.shape)}")
    out = _rows_out(out, rows, dim, dtype, values.device)
    n = rows.numel()
    if n == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n, INT_BLOCK_N), triton.cdiv(dim, block_d))
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
        BLOCK_N=INT_BLOCK_N,
        BLOCK_D=block_d,
        OUT_KIND=kind,
    )
    return out
