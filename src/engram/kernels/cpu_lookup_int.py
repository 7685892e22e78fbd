"""Numba kernel for the integer row formats on the CPU: the fast path of
`engram.storage.lookup.dequantize_gather` for INT8 (a bfloat16 scale per block or per row) and 4-bit
rows (two values a byte, a bfloat16 scale per block).

`int_gather` fuses gather and decode as `cpu_lookup.fp8_gather` does (the same staged batches, dedup
window and streaming stores, which `cpu_lookup` provides): value = float32(q) * float32(scale), then
bfloat16 rounded to nearest even, bit-exact to `engram.storage.quant_int`. Knows the formats' bytes,
nothing of tables or tiers. Compiles on first call (cached on disk). Design: docs/kernels.md.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from engram.kernels.cpu_lookup import (
    BAD_ROW,
    BAD_SCALE,
    OK,
    STAGE_ROWS,
    copy_row,
    dedup_map,
    run_decode_gather,
    stage_batch,
    store_fence,
    stream_copy,
    stream_out,
)

__all__ = ["OK", "gather_int_range", "int_gather", "stream_out"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _bf16(bits):
    """float32 value of bfloat16 bits (uint16): the bits in the top half, exact."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@_jit
def _bad_scale(bits):
    """Whether bfloat16 bits are not a finite positive number: 0 (zero), >= 0x7F80 (inf, NaN, negative):
    one unsigned compare, the valid bits 1..0x7F7F being those with bits - 1 below 0x7F7F."""
    return np.uint16(bits - np.uint16(1)) >= np.uint16(0x7F7F)


def _out(x, kind):  # pragma: no cover - see the overload
    raise NotImplementedError


@overload(_out, jit_options={"cache": True, "nogil": True})
def _out_impl(x, kind):
    """A float32 value as the output dtype `kind` (the out array's dtype): float32 as is, or uint16
    bfloat16 bits rounded to nearest even (no NaN: the scales were checked finite)."""
    if kind.dtype == types.float32:

        def impl(x, kind):
            return x

        return impl

    def impl_bf16(x, kind):
        u = np.uint32(np.float32(x).view(np.uint32))
        odd = np.uint32((u >> np.uint32(16)) & np.uint32(1))
        return np.uint16(np.uint32(np.uint32(u + np.uint32(0x7FFF)) + odd) >> np.uint32(16))

    return impl_bf16


@_jit
def _int8(byte):
    """The int8 a uint8 byte holds (two's complement), as int32."""
    b = np.int32(byte)
    return np.int32(b - ((b & np.int32(0x80)) << np.int32(1)))


@_jit
def _nibble(n):
    """The 4-bit two's complement integer of n in 0..15, as int32."""
    return np.int32(n - ((n & np.int32(8)) << np.int32(1)))


@_jit
def gather_int_range(values, scales, ids, out, four, dedup, stream, start, end):
    """Decode rows ids[start:end] into out[start:end]; return (code, first bad position or -1).

    values (R, W) uint8 (int8 bytes, W = D; or two 4-bit ints a byte, W = D / 2, with `four`), scales
    (R, nb) uint16 bfloat16 bits, ids (n,) int64/int32, out (n, D) float32 or uint16 (bfloat16 bits),
    all C-contiguous. `stream`: non-temporal stores (out 64-byte aligned, rows a multiple of 64 bytes).
    Stops at the first id outside [0, R) (BAD_ROW) or the first row with a scale that is not finite and
    positive (BAD_SCALE); out is then partly written. The batches of `cpu_lookup.gather_fp8_range`:
    (1) check the ids, dedup them in a window, copy the bytes of rows to decode into a staging buffer;
    (2) decode the staged rows, or copy a repeat's output row from its first occurrence.
    """
    n_table, width = values.shape
    dim = out.shape[1]
    n_blocks = scales.shape[1]
    nb = np.uint64(n_blocks)
    uw = np.uint64(width)
    udim = np.uint64(dim)
    blk = udim // nb
    v1 = values.reshape(-1)
    s1 = scales.reshape(-1)
    o1 = out.reshape(-1)
    kind = o1.dtype  # selects _out's float32 or bfloat16 version at compile time
    lines = np.int64(dim * out.itemsize // 64)
    row = np.empty(dim, dtype=out.dtype)  # (D,) one decoded row on its way to a streaming store
    stage_v = np.empty(STAGE_ROWS * width, dtype=np.uint8)  # (STAGE_ROWS, W), stays in L1
    stage_s = np.empty(STAGE_ROWS * n_blocks, dtype=np.uint16)  # (STAGE_ROWS, nb)
    src = np.empty(STAGE_ROWS, dtype=np.int64)  # -1: decode the staged row, else copy out[src]
    keys, where, stamp = dedup_map()
    code, bad_at = OK, -1
    for i0 in range(start, end, STAGE_ROWS):
        i1 = min(i0 + STAGE_ROWS, end)
        bad_at = stage_batch(
            v1, s1, uw, nb, ids, n_table, dedup, start, i0, i1, stage_v, stage_s, src, keys, where, stamp
        )
        if bad_at >= 0:
            code = BAD_ROW
            break
        for i in range(i0, i1):  # (2) decode or copy, in order
            k = np.uint64(i - i0)
            ob = np.uint64(i) * udim
            if src[k] >= 0:
                copy_row(o1, ob, np.uint64(src[k]) * udim, udim, lines, stream)
                continue
            bad = False
            vb = k * uw
            # Four copies of the decode loop (int8 / 4-bit, streamed or not) rather than a destination
            # or a decoder picked at run time inside the loop, which would stop it vectorising.
            for j in range(nb):
                sbits = stage_s[k * nb + j]
                bad |= _bad_scale(sbits)
                s = _bf16(sbits)
                base = j * blk
                if four:  # byte c of the block: value c in the low nibble, value c + blk / 2 in the high one
                    hb = blk // np.uint64(2)
                    vh = vb + base // np.uint64(2)
                    if stream:
                        for c in range(hb):
                            b = np.int32(stage_v[vh + c])
                            row[base + c] = _out(np.float32(_nibble(b & np.int32(15))) * s, kind)
                            row[base + hb + c] = _out(np.float32(_nibble(b >> np.int32(4))) * s, kind)
                    else:
                        for c in range(hb):
                            b = np.int32(stage_v[vh + c])
                            o1[ob + base + c] = _out(np.float32(_nibble(b & np.int32(15))) * s, kind)
                            o1[ob + base + hb + c] = _out(np.float32(_nibble(b >> np.int32(4))) * s, kind)
                elif stream:
                    for c in range(blk):
                        row[base + c] = _out(np.float32(_int8(stage_v[vb + base + c])) * s, kind)
                else:
                    for c in range(blk):
                        o1[ob + base + c] = _out(np.float32(_int8(stage_v[vb + base + c])) * s, kind)
            if stream:
                stream_copy(o1, np.int64(ob), row, np.int64(0), lines)
            if bad:
                code, bad_at = BAD_SCALE, i
                break
        if code != OK:
            break
    if stream:
        store_fence()
    return code, bad_at


def int_gather(
    values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, four: bool, threads: int
) -> bool:
    """Decode rows `ids` of an integer-format table into `out`; False if a row id is outside the table
    or a requested row has a scale that is not finite and positive (out is then partly written).

    values (R, W) int8 (W = D) or uint8 (`four`: two 4-bit ints a byte, W = D / 2), scales (R, nb)
    bfloat16, both contiguous CPU tensors (a memory-mapped table is read in place); ids (n,) int64/int32;
    out (n, D) contiguous float32, bfloat16 or float16 (float16: float32 rows in bounded chunks, then
    torch's own rounding).
    """
    v = values.view(torch.uint8).numpy()  # (R, W) bytes, no copy
    s = scales.view(torch.uint16).numpy()  # (R, nb) bfloat16 bits
    return run_decode_gather(gather_int_range, v, s, ids, out, (bool(four),), threads)
