"""Numba kernels for table lookups on the CPU: the fast path of `engram.storage.lookup.dequantize_gather` and
`engram.storage.lookup.gather_rows`.

`fp8_gather` fuses gather and ue8m0 dequantisation (staged rows, a dedup window, non-temporal
stores for large outputs), bit-exact to torch; `rows_gather` copies rows of a plain table (the integer formats' gather,
`cpu_lookup_int`, shares the streaming stores and the chunking below). Both
split the rows over threads and never depend on the thread count. Knows the FP8 row format's
bytes, nothing of tables or tiers. Compiles on first call (cached on disk). Design: docs/kernels.md.
"""

from __future__ import annotations

import math
from functools import cache

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from engram.kernels.threads import run_chunks

__all__ = [
    "BAD_ROW",
    "BAD_SCALE",
    "DEDUP_WINDOW",
    "OK",
    "STAGE_ROWS",
    "copy_row",
    "dedup_map",
    "fp8_gather",
    "gather_fp8_range",
    "gather_rows_range",
    "rows_gather",
    "run_decode_gather",
    "run_gather_chunks",
    "stage_batch",
    "store_fence",
    "stream_copy",
    "stream_out",
    "torch_nan_bits",
]

OK, BAD_ROW, BAD_SCALE = 0, 1, 2  # kernel return codes (with the first bad position)

# Rows staged per batch: their bytes are copied in a tight loop first, which lets the core overlap
# their cache (and TLB) misses, then decoded from L1 (measured on a 2 GB table: 1.9x a row-by-row
# decode, whose misses the long decode of each row serialises; software prefetch did not help).
STAGE_ROWS = 32
# Positions per dedup window: a repeat is copied from the output row of its first occurrence in the
# window (at most 1 MiB of fp32 output back) instead of being staged and decoded again. Measured on
# a 2 GB table, one thread: Zipf(1.2) ids (17% distinct) 4.1 -> 6.0 M rows/s with streaming stores,
# uniform ids (all distinct, pure overhead) 3.8 -> 3.4.
DEDUP_WINDOW = 1024
_DEDUP_SLOTS = 2 * DEDUP_WINDOW  # open-addressing map, at most half full
_FP16_CHUNK_ROWS = 16_384  # float16 output goes through a float32 scratch of this many rows (16 MiB)
# Outputs from this size on are written with non-temporal (streaming) stores, which skip reading each
# output line before writing it: 21 vs 8 GB/s here for a 200 MB output. A smaller output is left in
# the cache for its consumer.
STREAM_MIN_BYTES = 1 << 22

_jit = numba.njit(cache=True, nogil=True)
# The helpers both gathers share (the staged, deduped batches): inlined at numba's IR level into each
# kernel, so each compiles as if written there (no call or reference counts per row).
_jit_inline = numba.njit(cache=True, nogil=True, inline="always")


# ----------------------------------------------------------------------------------------- intrinsics
@intrinsic
def stream_copy(typingctx, dst, dst_off, src, src_off, n_vec):
    """dst[dst_off:] = src[src_off:], n_vec blocks of 64 bytes, with non-temporal stores (1-D arrays,
    element offsets). dst + dst_off must be 64-byte aligned; src needs only its element alignment."""
    sig = types.void(dst, dst_off, src, src_off, n_vec)

    def codegen(context, builder, signature, args):
        dty, _, sty, _, _ = signature.args
        dary = context.make_array(dty)(context, builder, args[0])
        sary = context.make_array(sty)(context, builder, args[2])
        dptr = cgutils.get_item_pointer(context, builder, dty, dary, [args[1]], wraparound=False)
        sptr = cgutils.get_item_pointer(context, builder, sty, sary, [args[3]], wraparound=False)
        vec = ir.VectorType(ir.IntType(32), 16).as_pointer()  # 64 bytes, one cache line
        dv = builder.bitcast(dptr, vec)
        sv = builder.bitcast(sptr, vec)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, args[4]) as loop:
            line = builder.load(builder.gep(sv, [loop.index]), align=sty.dtype.bitwidth // 8)
            store = builder.store(line, builder.gep(dv, [loop.index]), align=64)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """A full fence: orders the weakly ordered non-temporal stores before whatever follows."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------------------------------- fp8 decode
@_jit
def _e4m3_bits(byte):
    """float32 bits of a non-NaN e4m3fn byte s.eeee.mmm: (-1)^s 1.mmm 2^(eeee-7), or (-1)^s mmm 2^-9."""
    b = np.uint32(byte)
    sign = np.uint32((b & np.uint32(0x80)) << np.uint32(24))
    em = np.uint32(b & np.uint32(0x7F))  # exponent and mantissa
    # normal: exponent field eeee + 120 (bias 127 - 7), mantissa in the top 3 of 23 bits
    normal = np.uint32(sign | np.uint32((em << np.uint32(20)) + np.uint32(120 << 23)))
    sub = np.float32(np.float32(np.int32(em)) * np.float32(2.0**-9))  # em < 8: mmm * 2^-9, exact
    # both computed, then selected: a .view inside a branch stops LLVM vectorising the loop (4x slower)
    subnormal = np.uint32(sign | np.uint32(sub.view(np.uint32)))
    return normal if em >= np.uint32(8) else subnormal


@_jit
def _scale(byte):
    """float32 2^(byte - 127) built from its bits (byte 0: the subnormal 2^-127; 255: NaN, rejected)."""
    b = np.uint32(byte)
    return np.uint32(b << np.uint32(23) if b != np.uint32(0) else np.uint32(1 << 22)).view(np.float32)


def _decode(byte, scale, nan_pos, nan_neg, bf16_nan, kind):  # pragma: no cover - see the overload
    raise NotImplementedError


@overload(_decode, jit_options={"cache": True, "nogil": True})
def _decode_impl(byte, scale, nan_pos, nan_neg, bf16_nan, kind):
    """e4m3(byte) * scale as the output dtype `kind` (the out array's dtype): float32, or uint16 holding
    bfloat16 bits rounded to nearest even. The product is NaN exactly when the byte is (scales are never
    NaN), so bfloat16 tests NaN on the byte and stays in integer lanes.

    Scalars in, a value out, compiled as its own function that LLVM then inlines into the loop (it is
    small): a helper that takes the out array costs a reference count per call and stops the loop
    vectorising (measured 3x slower), and inlining at numba's IR level trips its SSA checks.
    """
    if kind.dtype == types.float32:

        def impl(byte, scale, nan_pos, nan_neg, bf16_nan, kind):
            b = np.uint32(byte)
            nan = nan_neg if b & np.uint32(0x80) else nan_pos
            bits = np.uint32(nan if (b & np.uint32(0x7F)) == np.uint32(0x7F) else _e4m3_bits(byte))
            return np.float32(bits.view(np.float32) * scale)

        return impl

    def impl_bf16(byte, scale, nan_pos, nan_neg, bf16_nan, kind):
        bits = np.uint32(_e4m3_bits(byte))
        u = np.uint32(np.float32(bits.view(np.float32) * scale).view(np.uint32))
        odd = np.uint32((u >> np.uint32(16)) & np.uint32(1))
        rounded = np.uint16(np.uint32(np.uint32(u + np.uint32(0x7FFF)) + odd) >> np.uint32(16))
        return bf16_nan if (byte & np.uint8(0x7F)) == np.uint8(0x7F) else rounded

    return impl_bf16


# ------------------------------------------------------------------------------- staged, deduped batches
@_jit_inline
def dedup_map():
    """An empty dedup map (keys, where, stamp) of _DEDUP_SLOTS slots, slot -> (id, position); `stamp` holds
    the window each slot was filled in (-1: none), so a new window needs no clearing."""
    keys = np.empty(_DEDUP_SLOTS, dtype=np.int64)
    where = np.empty(_DEDUP_SLOTS, dtype=np.int64)
    stamp = np.full(_DEDUP_SLOTS, -1, dtype=np.int64)
    return keys, where, stamp


@_jit_inline
def stage_batch(
    v1, s1, width, nb, ids, n_table, dedup, start, i0, i1, stage_v, stage_s, src, keys, where, stamp
):
    """Step (1) of a batch of the gather kernels: check ids[i0:i1], look each up in the dedup window
    (with `dedup`), and copy the bytes of each row to decode (`width` values and `nb` scales a row of the
    flat v1, s1) into stage_v, stage_s at its place k = i - i0; src[k] = -1 (decode staged row k) or the
    position of the id's first occurrence in the window (copy that output row).

    Returns -1, or the first position whose id is outside [0, n_table) (src, stage_* partly written).
    """
    mask = np.uint64(_DEDUP_SLOTS - 1)
    for i in range(i0, i1):
        r = ids[i]
        if r < 0 or r >= n_table:
            return i
        k = np.uint64(i - i0)
        first = -1
        if dedup:
            window = (i - start) // DEDUP_WINDOW  # slots stamped with an older window read as empty
            slot = ((np.uint64(r) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & mask  # Fibonacci
            while stamp[slot] == window:
                if keys[slot] == r:
                    first = where[slot]
                    break
                slot = (slot + np.uint64(1)) & mask
            if first < 0:
                stamp[slot] = window
                keys[slot] = r
                where[slot] = i
        src[k] = first
        if first < 0:
            ur = np.uint64(r)
            for c in range(width):
                stage_v[k * width + c] = v1[ur * width + c]
            for c in range(nb):
                stage_s[k * nb + c] = s1[ur * nb + c]
    return -1


@_jit_inline
def copy_row(o1, dst, src, width, lines, stream):
    """o1[dst : dst + width] = o1[src : src + width] (element offsets): a repeat's output row from its
    first occurrence; `stream`: as `lines` 64-byte lines with non-temporal stores."""
    if stream:
        stream_copy(o1, np.int64(dst), o1, np.int64(src), lines)
    else:
        for c in range(width):
            o1[dst + c] = o1[src + c]


@_jit
def gather_fp8_range(values, scales, ids, out, nan_pos, nan_neg, bf16_nan, dedup, stream, start, end):
    """Dequantise rows ids[start:end] into out[start:end]; return (code, first bad position or -1).

    values (R, D) uint8, scales (R, nb) uint8, ids (n,) int64/int32, out (n, D) float32 or uint16
    (bfloat16 bits), all C-contiguous. `stream`: write out with non-temporal stores (out 64-byte
    aligned, rows a multiple of 64 bytes). Stops at the first id outside [0, R) (BAD_ROW) or the
    first row with a 255 scale byte (BAD_SCALE); out is then partly written.

    Works in batches of STAGE_ROWS positions: (1) check the ids, look each up in the dedup window and
    copy the bytes of the rows to decode into a small staging buffer; (2) decode the staged rows, or
    copy a repeat's output row from its first occurrence (earlier, so already written).
    """
    n_table, dim = values.shape
    n_blocks = scales.shape[1]
    nb = np.uint64(n_blocks)
    udim = np.uint64(dim)
    blk = udim // nb
    v1 = values.reshape(-1)
    s1 = scales.reshape(-1)
    o1 = out.reshape(-1)
    kind = o1.dtype  # selects _decode's float32 or bfloat16 version at compile time
    lines = np.int64(dim * out.itemsize // 64)  # 64-byte lines per output row when streaming
    row = np.empty(dim, dtype=out.dtype)  # (D,) one decoded row on its way to a streaming store
    stage_v = np.empty(STAGE_ROWS * dim, dtype=np.uint8)  # (STAGE_ROWS, D) bytes, stays in L1
    stage_s = np.empty(STAGE_ROWS * n_blocks, dtype=np.uint8)  # (STAGE_ROWS, nb)
    src = np.empty(STAGE_ROWS, dtype=np.int64)  # -1: decode the staged row, else copy out[src]
    keys, where, stamp = dedup_map()
    code, bad_at = OK, -1
    for i0 in range(start, end, STAGE_ROWS):
        i1 = min(i0 + STAGE_ROWS, end)
        bad_at = stage_batch(
            v1, s1, udim, nb, ids, n_table, dedup, start, i0, i1, stage_v, stage_s, src, keys, where, stamp
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
            # Two copies of the decode loop rather than a destination picked at run time: an array
            # chosen by a branch takes a reference count, which stops the loop vectorising.
            if stream:
                for j in range(nb):
                    sbyte = stage_s[k * nb + j]
                    bad |= sbyte == np.uint8(255)
                    s = _scale(sbyte)
                    base = j * blk
                    for c in range(blk):  # vectorises: 8-16 values per instruction
                        row[base + c] = _decode(
                            stage_v[k * udim + base + c], s, nan_pos, nan_neg, bf16_nan, kind
                        )
                stream_copy(o1, np.int64(ob), row, np.int64(0), lines)
            else:
                for j in range(nb):
                    sbyte = stage_s[k * nb + j]
                    bad |= sbyte == np.uint8(255)
                    s = _scale(sbyte)
                    base = j * blk
                    for c in range(blk):
                        o1[ob + base + c] = _decode(
                            stage_v[k * udim + base + c], s, nan_pos, nan_neg, bf16_nan, kind
                        )
            if bad:
                code, bad_at = BAD_SCALE, i
                break
        if code != OK:
            break
    if stream:
        store_fence()
    return code, bad_at


@_jit
def gather_rows_range(table, ids, out, stream, start, end):
    """Copy rows ids[start:end] of table (R, W) into out[start:end] (n, W), both uint8, C-contiguous;
    `stream`: with non-temporal stores (out 64-byte aligned, W a multiple of 64).

    Returns (OK, -1), or (BAD_ROW, position) at the first id outside [0, R).
    """
    n_table, width = table.shape
    uw = np.uint64(width)
    lines = np.int64(width // 64)
    t1 = table.reshape(-1)
    o1 = out.reshape(-1)
    code, bad_at = OK, -1
    for i in range(start, end):
        r = ids[i]
        if r < 0 or r >= n_table:
            code, bad_at = BAD_ROW, i
            break
        src = np.uint64(r) * uw
        dst = np.uint64(i) * uw
        if stream:
            stream_copy(o1, np.int64(dst), t1, np.int64(src), lines)
        else:
            for c in range(uw):
                o1[dst + c] = t1[src + c]
    if stream:
        store_fence()
    return code, bad_at


def stream_out(out: torch.Tensor) -> bool:
    """Whether to write `out` (n, D) with non-temporal stores: large, 64-byte aligned rows and base."""
    row_bytes = out.shape[1] * out.element_size()
    return out.nbytes >= STREAM_MIN_BYTES and row_bytes % 64 == 0 and out.data_ptr() % 64 == 0


# ------------------------------------------------------------------------------------------ threading
def run_gather_chunks(kernel, args: tuple, threads: int) -> tuple[int, int]:
    """Run kernel(*args, start, end) over the ids args[2] in `threads` contiguous chunks; the first error
    (lowest position) wins."""
    results = run_chunks(kernel, args, args[2].shape[0], threads)
    for code, pos in results:  # chunks are in position order: the first failing one has the first error
        if code != OK:
            return int(code), int(pos)
    return OK, -1


@cache
def torch_nan_bits() -> tuple[int, int, int]:
    """What the torch path writes for NaN: the float32 bits of the e4m3 NaN bytes 0x7F and 0xFF, and the
    bfloat16 bits a vector-wide float32 -> bfloat16 copy gives a NaN (0xFFFF on x86, where torch's scalar
    conversion would give 0x7FC0). The kernels take them as parameters to stay bit-identical to it."""
    f = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    bits = f.view(torch.int32)
    bf = torch.full((256,), math.nan).to(torch.bfloat16).view(torch.int16)
    return int(bits[0x7F]) & 0xFFFFFFFF, int(bits[0xFF]) & 0xFFFFFFFF, int(bf[0]) & 0xFFFF


def fp8_gather(
    values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int
) -> bool:
    """Dequantise rows `ids` of an FP8 table into `out`; False if a row id is outside the table or a
    requested row has a 255 (NaN) scale byte (out is then partly written).

    values (R, D) float8_e4m3fn, scales (R, D // block) float8_e8m0fnu, both contiguous CPU tensors (a
    memory-mapped table is read in place); ids (n,) int64/int32; out (n, D) contiguous float32,
    bfloat16 or float16 (float16: float32 rows in bounded chunks, then torch's own rounding).
    """
    v = values.view(torch.uint8).numpy()  # (R, D) bytes, no copy
    s = scales.view(torch.uint8).numpy()  # (R, nb)
    nan_pos, nan_neg, bf16_nan = (np.uint32(x) for x in torch_nan_bits())
    return run_decode_gather(
        gather_fp8_range, v, s, ids, out, (nan_pos, nan_neg, np.uint16(bf16_nan)), threads
    )


def run_decode_gather(
    kernel,
    values: np.ndarray,
    scales: np.ndarray,
    ids: torch.Tensor,
    out: torch.Tensor,
    extra: tuple,
    threads: int,
) -> bool:
    """Run a decoding gather kernel(values, scales, ids, o, *extra, dedup, stream, start, end) into `out`
    (n, D) float32, bfloat16 (as uint16 bits) or float16 (float32 rows in bounded chunks, then torch's
    own rounding), deduped, over `threads`; False at the first error (out then partly written)."""
    idx = ids.contiguous().numpy()  # (n,)
    if out.dtype != torch.float16:
        o = out.numpy() if out.dtype == torch.float32 else out.view(torch.uint16).numpy()
        return (
            run_gather_chunks(kernel, (values, scales, idx, o, *extra, True, stream_out(out)), threads)[0]
            == OK
        )
    n, dim = out.shape
    step = min(n, _FP16_CHUNK_ROWS)
    scratch = torch.empty((step, dim), dtype=torch.float32)  # (step, D), bounded whatever n is
    for start in range(0, n, step):
        stop = min(start + step, n)
        tmp = scratch[: stop - start]
        args = (values, scales, idx[start:stop], tmp.numpy(), *extra, True, False)
        if run_gather_chunks(kernel, args, threads)[0] != OK:
            return False
        out[start:stop].copy_(tmp)
    return True


def rows_gather(weight: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, threads: int) -> bool:
    """Copy rows `ids` of a contiguous CPU table `weight` (R, D) into `out` (n, D), same dtype, as bytes
    (one kernel for every dtype); False if a row id is outside [0, R) (out then partly written)."""
    out_bytes = out.view(torch.uint8)
    args = (
        weight.view(torch.uint8).numpy(),
        ids.contiguous().numpy(),
        out_bytes.numpy(),
        stream_out(out_bytes),
    )
    return run_gather_chunks(gather_rows_range, args, threads)[0] == OK
