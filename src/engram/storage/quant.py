"""FP8 quantisation of Engram rows, bit-exact to the layout DeepSeek-V4.1 stores (SPEC §5).

`quantize_rows` turns float rows [..., D] into (e4m3 values, ue8m0 scales per 32 values);
`dequantize_rows` / `dequantize_into` decode them, exact in float32. `quantize` / `dequantize` take any
row format (`engram.rowformat.formats.RowFormat`), the integer ones through `engram.storage.quant_int`. The format's constants and checks
are `engram.rowformat.fp8`'s, gathering rows of a whole table `engram.storage.lookup`'s. The rounding
decisions (scale clamp, the 240 cap near float32's max, zero blocks) are in docs/storage.md.
"""

from __future__ import annotations

import math

import torch

from engram.rowformat.formats import RowFormat, as_row_format, format_of
from engram.rowformat.fp8 import (
    BLOCK,
    SCALE_DTYPE,
    VALUE_DTYPE,
    check_block,
    check_dequant_dtype,
    check_fp8_pair,
    check_scale_bytes,
    check_value_bytes,
    exp2_bits,
    prepare_out,
    scale_bytes_to_float,
)
from engram.storage.quant_input import check_float_rows, float32_chunks, row_name
from engram.storage.quant_int import dequantize_int_rows, quantize_int_rows

__all__ = [
    "dequantize",
    "dequantize_into",
    "dequantize_rows",
    "quantize",
    "quantize_rows",
    "scale_bytes_to_float",
]


# Scale exponent range the quantiser emits: byte = exponent + 127 lies in [1, 254] (see docs/storage.md).
_MIN_EXP = -126
_MAX_EXP = 127
_ZERO_BLOCK_BYTE = 127  # scale 1.0 for an all-zero block
# Largest exponent finite float32 input can need (amax < 2**128 <= 448 * 2**120); in that block e4m3
# values are capped at 240 so that value * 2**120 stays below float32's max (256 * 2**120 = 2**128).
_TOP_EXP = 120
_TOP_LIMIT = 240.0

# Elements per internal chunk: temporaries are a few float32 copies of one chunk (~16 MiB each), so a huge
# input never needs more than a constant factor of that beyond its inputs and outputs.
_CHUNK_ELEMS = 1 << 22


# ---------------------------------------------------------------------------------------------- helpers


def _rows_per_chunk(dim: int) -> int:
    return max(1, _CHUNK_ELEMS // max(dim, 1))


def dequantize_into(v_u8: torch.Tensor, s_u8: torch.Tensor, block: int, out2d: torch.Tensor) -> None:
    """Dequantise uint8 bytes v_u8 [R, D] (fp8 e4m3) with scale bytes s_u8 [R, D // block] into out2d [R, D].

    Works chunk by chunk so the float32 temporaries are bounded by one chunk.
    """
    n_rows, dim = v_u8.shape
    nb = dim // block
    step = _rows_per_chunk(dim)
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        r = stop - start
        vals = v_u8[start:stop].view(VALUE_DTYPE).float().view(r, nb, block)  # exact: fp8 ⊂ fp32
        scale = exp2_bits(s_u8[start:stop]).unsqueeze(-1)  # [r, nb, 1], exact powers of two
        dst = out2d[start:stop].view(r, nb, block)
        if out2d.dtype == torch.float32:
            torch.mul(vals, scale, out=dst)  # exact product
        else:
            dst.copy_(vals.mul_(scale))  # exact fp32 product, then one rounding to bf16/fp16


# ------------------------------------------------------------------------------------------- public API


def quantize_rows(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise float rows ``x [..., D]`` to (values ``float8_e4m3fn [..., D]``, scales ``float8_e8m0fnu
    [..., D // block]``).

    Per block of ``block`` consecutive values of a row, the scale is the smallest power of two ``s`` with
    ``amax / s <= 448`` (exponent clamped to [-126, 127]; an all-zero block gets 1.0), and the values are
    ``x / s`` rounded to nearest e4m3 (never saturating; only in blocks with scale 2**120, i.e. amax near
    float32's max, are values capped at 240 so that they decode finite).  The computation is in float32.

    Raises ValueError if D is not a multiple of ``block`` or if ``x`` holds NaN/inf (or, for float64,
    values beyond float32's range); TypeError for a non-float dtype.
    """
    check_block(block)
    check_float_rows(x)
    if x.shape[-1] % block:
        raise ValueError(f"row width D={x.shape[-1]} is not divisible by block={block}")
    dim = x.shape[-1]
    lead = tuple(x.shape[:-1])
    nb = dim // block

    n_rows = math.prod(lead)
    x2 = x.reshape(n_rows, dim)  # [R, D]; a view for contiguous x
    values = torch.empty((n_rows, dim), dtype=VALUE_DTYPE, device=x.device)
    scale_bytes = torch.empty((n_rows, nb), dtype=torch.uint8, device=x.device)

    for start, stop, xf in float32_chunks(
        x2, _rows_per_chunk(dim), "quantize_rows", lambda r: row_name(r, lead)
    ):
        r = stop - start
        xb = xf.view(r, nb, block)
        amax = xb.abs().amax(dim=-1)  # [r, nb], exact
        # Smallest e with amax <= 448 * 2**e, exactly: amax = m * 2**k with m in [0.5, 1) and
        # 448 = 0.875 * 2**9, so e = k - 9 when m <= 0.875 (and k - 10 fails as m > 0.4375), else k - 8.
        # Exact powers of two (m = 0.5) and amax just above 448 * 2**j (m just above 0.875) both land right.
        mant, expo = torch.frexp(amax)  # handles float32 subnormals; amax = 0 gives (0, 0)
        e = expo - 9 + (mant > 0.875).to(torch.int32)
        e = e.clamp_(_MIN_EXP, _MAX_EXP)
        b = torch.where(amax == 0, torch.full_like(e, _ZERO_BLOCK_BYTE), e + 127)  # [r, nb] in 1..254
        scale = exp2_bits(b).unsqueeze(-1)  # [r, nb, 1], exact 2**e, always a normal float32
        # x / 2**e is exact unless it lands below 2**-126, where e4m3 rounds it to zero anyway, so the
        # only rounding is the single round-to-nearest-even into e4m3; |x / s| <= 448 so nothing saturates.
        y = xb / scale  # [r, nb, block]
        top = e == _TOP_EXP
        if bool(top.any()):
            # amax close to float32's max: |y| in [248, 256) would round to 256 and 256 * 2**120 = 2**128
            # decodes to inf, so those blocks saturate at 240 (largest e4m3 below 256; still within the
            # e4m3 half-ulp bound 16 <= |y| / 16).  Finite float32 input never needs e > 120.
            y = torch.where(top.unsqueeze(-1), y.clamp(-_TOP_LIMIT, _TOP_LIMIT), y)
        values[start:stop].view(r, nb, block).copy_(y)
        scale_bytes[start:stop] = b.to(torch.uint8)

    return values.view(*lead, dim), scale_bytes.view(SCALE_DTYPE).view(*lead, nb)


def dequantize_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """Dequantise ``values float8_e4m3fn [..., D]`` with ``scales float8_e8m0fnu [..., D // block]`` to
    ``[..., D]`` in ``dtype`` (float32, bfloat16 or float16): ``value * 2**(b - 127)`` per block.

    Exact in float32; bf16/fp16 are the float32 result rounded once.  Written into ``out`` if given (same
    shape and dtype, contiguous).  Raises TypeError for wrong dtypes, ValueError for mismatched shapes or a
    NaN byte: a scale byte 255 or a value byte 0x7F / 0xFF (one rule: no stored byte dequantises to NaN).
    """
    dim, nb = check_fp8_pair(values, scales, block)
    check_dequant_dtype(dtype)
    lead = tuple(values.shape[:-1])
    result = prepare_out(out, (*lead, dim), dtype, values.device)
    n_rows = math.prod(lead)
    v_u8 = values.view(torch.uint8).reshape(n_rows, dim)  # [R, D]; same-size dtype view, no conversion
    s_u8 = scales.view(torch.uint8).reshape(n_rows, nb)  # [R, nb]
    check_scale_bytes(s_u8, lambda r: row_name(r, lead), block)
    check_value_bytes(v_u8, lambda r: row_name(r, lead))
    dequantize_into(v_u8, s_u8, block, result.view(n_rows, dim))
    return result


def quantize(x: torch.Tensor, fmt: RowFormat | str = RowFormat.FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows ``x [..., D]`` -> (values, scales) in row format ``fmt`` (``quantize_rows`` for fp8,
    ``quant_int.quantize_int_rows`` for int8 / int8-row / int4); an unknown name raises, listing them."""
    fmt = as_row_format(fmt)
    return quantize_rows(x) if fmt is RowFormat.FP8 else quantize_int_rows(x, fmt)


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    fmt: RowFormat | str | None = None,
) -> torch.Tensor:
    """Rows of any row format -> ``[..., D]`` in ``dtype``; ``fmt`` None: the format the pair's dtypes
    say (`format_of`), else checked against them."""
    fmt = format_of(values, scales) if fmt is None else as_row_format(fmt)
    if fmt is RowFormat.FP8:
        return dequantize_rows(values, scales, dtype, out)
    return dequantize_int_rows(values, scales, fmt, dtype, out)
