"""Integer quantisation of Engram rows: INT8 (a scale per 32 values or per row) and 4-bit (a scale per 32).

`quantize_int_rows(x, fmt)` turns float rows [..., D] into (integers, bfloat16 scales) by the one rule
below; `dequantize_int_rows` / `dequantize_int_into` decode them. The kernels (`engram.kernels`) only
decode, so only the decode must agree with them bit for bit: value = float32(q) * float32(scale),
rounded once (the product of an 8-bit integer and an 8-bit mantissa is exact unless it underflows),
then once more to bf16 / fp16 output. The formats are `engram.rowformat.formats`'. Design: docs/storage.md.

The rule, per block of `fmt.block(D)` values of a row (computed from x in float32):
  amax = max |x|;  s = 1.0 if amax == 0, else the smallest bfloat16 >= amax / QMAX (QMAX 127 or 7),
  q = round_half_even(float64(x) / float64(s)), so |q| <= QMAX and |x - q s| <= s / 2.
"""

from __future__ import annotations

import math

import torch

from engram.rowformat.formats import RowFormat, check_int_scales, check_pair
from engram.rowformat.fp8 import BLOCK, check_dequant_dtype, prepare_out
from engram.storage.quant_input import check_float_rows, float32_chunks, row_name

__all__ = ["dequantize_int_into", "dequantize_int_rows", "pack_int4", "quantize_int_rows", "unpack_int4"]

_CHUNK_ELEMS = 1 << 21  # elements per internal chunk: temporaries are a few float64 copies of one (16 MiB)


def _int_format(fmt: RowFormat | str) -> RowFormat:
    fmt = RowFormat(fmt)
    if fmt is RowFormat.FP8:
        raise ValueError(
            "format fp8 is engram.storage.quant's (quantize_rows); this module is the integer formats'"
        )
    return fmt


def _row_name(flat_row: int, lead: tuple[int, ...]) -> str:
    """`row_name`, but the row of a 1-D x is "row 0" here."""
    return row_name(flat_row, lead or (1,))


def pack_int4(q: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Integers in [-8, 7] [..., D] -> uint8 [..., D / 2], block by block: byte j of a block's
    `block / 2` holds its value j in the low nibble and value j + block / 2 in the high one, each a 4-bit
    two's complement (so a decoder writes both halves of a block with contiguous stores)."""
    half = block // 2
    nib = (q.to(torch.int32) & 0xF).unflatten(-1, (-1, 2, half))  # [..., D / block, 2, half]
    return (nib[..., 0, :] | (nib[..., 1, :] << 4)).flatten(-2).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """uint8 [..., W] -> int32 [..., 2 W] in [-8, 7]: `pack_int4`'s inverse."""
    b = packed.to(torch.int32).unflatten(-1, (-1, block // 2))  # [..., D / block, half]
    out = torch.stack((b & 0xF, b >> 4), dim=-2).flatten(-3)  # [..., D]
    return out - ((out & 8) << 1)  # sign-extend the nibble


def _scales(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """float32 amax [...] -> float32 scales [...]: 1.0 where amax is 0, else the smallest bfloat16 value
    >= amax / qmax (the exact quotient: its float64 rounding has the same bfloat16 ceiling, as amax has
    24 significant bits and a bfloat16 times qmax at most 15, so the quotient never sits within float64's
    rounding of a bfloat16 it is not equal to)."""
    t = amax.double() / qmax
    f = t.float()  # nearest float32, then up to the float32 ceiling
    f = torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)
    bits = (f.view(torch.int32) + 0xFFFF) & ~0xFFFF  # up to the bfloat16 ceiling (positive floats)
    s = bits.view(torch.float32)
    return torch.where(amax == 0, torch.ones_like(s), s)


def quantize_int_rows(x: torch.Tensor, fmt: RowFormat | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise float rows ``x [..., D]`` (fp32 / bf16 / fp16 / fp64, computed in float32) to format
    ``fmt`` (int8, int8-row, int4) by the module's rule: (values ``[..., fmt.value_width(D)]`` int8, or
    uint8 holding two 4-bit ints; scales bfloat16 ``[..., fmt.scales_per_row(D)]``).

    Raises ValueError for NaN / inf (or float64 beyond float32's range), for a block whose amax is
    within 1% of float32's max (QMAX times its scale would overflow), or a D that is not a positive
    multiple of 32; TypeError for a non-float dtype.
    """
    fmt = _int_format(fmt)
    check_float_rows(x)
    dim = int(x.shape[-1])
    blk = fmt.block(dim)  # raises for a D that is not a positive multiple of 32
    nb, qmax = dim // blk, fmt.qmax
    lead = tuple(x.shape[:-1])
    n_rows = math.prod(lead)
    x2 = x.reshape(n_rows, dim)  # [R, D]
    values = torch.empty((n_rows, fmt.value_width(dim)), dtype=fmt.value_dtype, device=x.device)
    scales = torch.empty((n_rows, nb), dtype=fmt.scale_dtype, device=x.device)
    step = max(1, _CHUNK_ELEMS // dim)
    for start, stop, xf in float32_chunks(x2, step, "quantize_int_rows", lambda r: _row_name(r, lead)):
        r = stop - start
        xb = xf.view(r, nb, blk)
        s = _scales(xb.abs().amax(dim=-1), qmax)  # [r, nb] float32, exactly bfloat16 values
        over = torch.isinf(s * qmax)
        if bool(over.any()):
            i, j = (int(v) for v in over.nonzero()[0])
            raise ValueError(
                f"quantize_int_rows: block {j} of {_row_name(start + i, lead)} has |x| up to "
                f"{float(xb[i, j].abs().max())}, within 1% of float32's max: {qmax} x its scale would not be "
                f"finite in format {fmt.value}; scale the table down, or store it as fp8"
            )
        q = torch.round(xb.double() / s.double().unsqueeze(-1)).view(r, dim)  # half to even; |q| <= qmax
        if fmt is RowFormat.INT4_BLOCK32:
            values[start:stop] = pack_int4(q.to(torch.int32))
        else:
            values[start:stop] = q.to(torch.int8)
        scales[start:stop] = s.to(torch.bfloat16)  # exact: s is a bfloat16 value
    return values.view(*lead, -1), scales.view(*lead, nb)


def dequantize_int_into(
    values: torch.Tensor, scales: torch.Tensor, fmt: RowFormat, out2d: torch.Tensor
) -> None:
    """Decode rows values [R, W] (int8, or uint8 of 4-bit pairs) / bfloat16 scales [R, S] of format `fmt`
    into out2d [R, D] (float32, bf16 or fp16): float32(q) * float32(s), then one rounding to out's dtype.
    Scales are not checked here."""
    n_rows, dim = out2d.shape
    nb = scales.shape[1]
    step = max(1, _CHUNK_ELEMS // max(dim, 1))
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        r = stop - start
        v = values[start:stop]
        q = unpack_int4(v) if fmt is RowFormat.INT4_BLOCK32 else v.to(torch.int32)
        x = q.float().view(r, nb, dim // nb) * scales[start:stop].float().unsqueeze(-1)  # [r, nb, blk]
        out2d[start:stop].view(r, nb, dim // nb).copy_(x)  # exact for float32; one rounding otherwise


def dequantize_int_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    fmt: RowFormat | str,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode rows ``values [..., W]`` / ``scales [..., S]`` of format ``fmt`` to ``[..., D]`` in ``dtype``
    (float32, bfloat16, float16), into ``out`` if given. Raises TypeError / ValueError for a pair that is
    not of the format, and ValueError for a scale that is NaN, infinite, zero or negative."""
    fmt = _int_format(fmt)
    dim, nb = check_pair(fmt, values, scales)
    check_dequant_dtype(dtype)
    lead = tuple(values.shape[:-1])
    result = prepare_out(out, (*lead, dim), dtype, values.device)
    n_rows = math.prod(lead)
    s2 = scales.reshape(n_rows, nb)
    check_int_scales(s2, lambda r: _row_name(r, lead), dim // nb)
    dequantize_int_into(values.reshape(n_rows, -1), s2, fmt, result.view(n_rows, dim))
    return result
