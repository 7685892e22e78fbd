"""The integer row formats (engram.rowformat.formats, engram.storage.quant_int): bytes per row, the
quantisation rule (scale = the smallest bfloat16 >= amax / QMAX, round half to even), the round-trip
bound |x - q s| <= s / 2, the 4-bit packing, and the refusals (unknown names, bad scales, non-finite input)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engram.rowformat.formats import RowFormat, as_row_format, check_pair, format_of
from engram.storage import quant
from engram.storage.quant_int import dequantize_int_rows, pack_int4, quantize_int_rows, unpack_int4

INT_FORMATS = [RowFormat.INT8_BLOCK32, RowFormat.INT8_ROW, RowFormat.INT4_BLOCK32]


def unpacked(values: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    return unpack_int4(values) if fmt is RowFormat.INT4_BLOCK32 else values.to(torch.int32)


# ------------------------------------------------------------------------------------------- geometry
def test_bytes_per_row_at_v41_width() -> None:
    """V4.1's 256-wide rows: 264 B in FP8; the 4-bit format is at most 0.55x of it."""
    got = {f.value: f.row_bytes(256) for f in RowFormat}
    assert got == {"fp8": 264, "int8": 272, "int8-row": 258, "int4": 144}
    assert RowFormat.INT4_BLOCK32.row_bytes(256) / RowFormat.FP8.row_bytes(256) <= 0.55
    for f in RowFormat:
        v, s = quant.quantize(torch.zeros(3, 256), f)
        assert v[0].numel() * v.element_size() + s[0].numel() * s.element_size() == f.row_bytes(256)


def test_codes_are_stable_and_round_trip() -> None:
    assert [f.code for f in RowFormat] == [0, 1, 2, 3]
    assert all(RowFormat.from_code(f.code) is f for f in RowFormat)
    assert RowFormat.from_code(9) is None


def test_unknown_format_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"format='int3' is not a row format.*fp8, int8, int8-row, int4"):
        as_row_format("int3")
    with pytest.raises(ValueError, match="int3"):
        quant.quantize(torch.zeros(1, 32), "int3")


def test_format_of_reads_the_dtypes() -> None:
    x = torch.randn(2, 64)
    for f in RowFormat:
        assert format_of(*quant.quantize(x, f)) is f
    # one block a row: int8 and int8-row are the same bytes
    assert format_of(*quant.quantize(torch.randn(2, 32), "int8-row")) is RowFormat.INT8_BLOCK32
    with pytest.raises(TypeError, match="no row format"):
        format_of(torch.zeros(2, 32), torch.zeros(2, 1))


def test_check_pair_names_a_four_bit_table_read_as_int8() -> None:
    v, s = quant.quantize(torch.randn(4, 64), "int4")
    with pytest.raises(TypeError, match=r"expected torch.int8 for format int8 \(these are int4 values"):
        check_pair(RowFormat.INT8_BLOCK32, v, s)
    v8, s8 = quant.quantize(torch.randn(4, 64), "int8")
    with pytest.raises(ValueError, match=r"scales has shape \(4, 2\), expected \(4, 1\)"):
        check_pair(RowFormat.INT8_ROW, v8, s8)


# ------------------------------------------------------------------------------------------ the rule
def bf16_ceil(q: float) -> float:
    """The smallest bfloat16 >= q, by search over the float32 bit patterns (independent of the code)."""
    f = np.float32(q)
    if float(f) < q:
        f = np.nextafter(f, np.float32(np.inf))
    b = int(np.array(f, dtype=np.float32).view(np.uint32))
    if b & 0xFFFF:
        b = (b | 0xFFFF) + 1
    return float(np.array(b, dtype=np.uint32).view(np.float32))


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_rule_against_a_direct_implementation(fmt: RowFormat) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-30, 30, 6)[:, None]
    x[2, :32] = 0.0  # a zero block
    v, s = quantize_int_rows(x, fmt)
    q = unpacked(v, fmt)
    blk = fmt.block(64)
    for r in range(6):
        for j in range(64 // blk):
            xb = x[r, j * blk : (j + 1) * blk].double()
            amax = float(xb.abs().max())
            want_s = 1.0 if amax == 0 else bf16_ceil(amax / fmt.qmax)
            assert float(s[r, j]) == want_s, (r, j)
            want_q = torch.round(xb / want_s).to(torch.int32)
            assert torch.equal(q[r, j * blk : (j + 1) * blk], want_q), (r, j)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_scale_is_tight_and_the_largest_value_reaches_near_qmax(fmt: RowFormat) -> None:
    x = torch.randn(50, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    v, s = quantize_int_rows(x, fmt)
    q = unpacked(v, fmt).view(50, -1, fmt.block(256))
    amax = x.view(50, -1, fmt.block(256)).abs().amax(-1)
    sf = s.float()
    assert (sf * fmt.qmax >= amax).all()  # nothing clips
    assert (sf * fmt.qmax <= amax * (1 + 2**-7)).all()  # the bfloat16 ceiling is within one ulp
    assert q.abs().amax(-1).ge(fmt.qmax - 1).all() and q.abs().max() <= fmt.qmax


def test_zero_rows_get_scale_one() -> None:
    for fmt in INT_FORMATS:
        v, s = quantize_int_rows(torch.zeros(2, 64), fmt)
        assert (s.float() == 1.0).all() and (unpacked(v, fmt) == 0).all()


def test_tiny_blocks_get_a_positive_scale() -> None:
    """A block of float32 subnormals still gets a positive (bfloat16 subnormal) scale."""
    x = torch.full((1, 32), 1e-45)
    for fmt in INT_FORMATS:
        _, s = quantize_int_rows(x, fmt)
        assert float(s[0, 0]) == 2.0**-133


def test_pack_layout() -> None:
    """Byte j of a block holds value j (low nibble) and value j + 16 (high nibble), two's complement."""
    q = torch.arange(64, dtype=torch.int32) % 16 - 8  # -8..7 twice a block
    p = pack_int4(q)
    assert p.shape == (32,)
    assert int(p[0]) == (q[0] & 0xF) | ((q[16] & 0xF) << 4)
    assert int(p[17]) == (q[33] & 0xF) | ((q[49] & 0xF) << 4)
    assert torch.equal(unpack_int4(p), q)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(INT_FORMATS),
    rows=st.integers(1, 4),
    blocks=st.integers(1, 4),
    exp=st.integers(-140, 120),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_round_trip_error_within_half_a_scale(fmt, rows, blocks, exp, seed, dtype) -> None:
    """|x - dequantise(quantise(x))| <= s / 2 per value (plus float64's and float32's last-bit roundings,
    and float32 underflow), in every format, for magnitudes from subnormals to 2^120."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 32 * blocks, generator=g, dtype=torch.float64) * 2.0**exp).to(dtype)
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0
    assume(bool(x.float().isfinite().all()))  # float16 overflows from 2^16
    v, s = quantize_int_rows(x, fmt)
    y = dequantize_int_rows(v, s, fmt)
    xf = x.float().double()
    blk = fmt.block(x.shape[-1])
    half = (s.double() / 2).repeat_interleave(blk, dim=-1)
    err = (xf - y.double()).abs()
    assert (err <= half * (1 + 2**-30) + 2.0**-149).all()
    assert y.isfinite().all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_the_float32_result_rounded_once(out_dtype) -> None:
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(3))
    for fmt in INT_FORMATS:
        v, s = quantize_int_rows(x, fmt)
        want = dequantize_int_rows(v, s, fmt).to(out_dtype)
        assert torch.equal(dequantize_int_rows(v, s, fmt, out_dtype), want)


# ------------------------------------------------------------------------------------------ refusals
def test_non_finite_input_is_refused_naming_the_position() -> None:
    x = torch.zeros(3, 64)
    x[1, 40] = math.nan
    with pytest.raises(ValueError, match="row 1, column 40 is nan"):
        quantize_int_rows(x, "int4")
    with pytest.raises(ValueError, match="overflows float32"):
        quantize_int_rows(torch.full((1, 32), 1e300, dtype=torch.float64), "int8")


def test_a_block_near_float32_max_is_refused() -> None:
    x = torch.zeros(2, 64)
    x[1, 33] = torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match=r"block 1 of row 1 .* within 1% of float32's max"):
        quantize_int_rows(x, "int8")
    quantize_int_rows(torch.full((1, 32), 3.0e38), "int8")  # 1% below still fits


def test_bad_width_and_dtype() -> None:
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quantize_int_rows(torch.zeros(2, 48), "int8")
    with pytest.raises(TypeError, match=r"dtype torch\.int64"):
        quantize_int_rows(torch.zeros(2, 32, dtype=torch.int64), "int8")
    with pytest.raises(ValueError, match="quantize_rows"):
        quantize_int_rows(torch.zeros(2, 32), "fp8")


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf])
def test_nan_zero_negative_infinite_scales_are_refused(bad: float) -> None:
    v, s = quantize_int_rows(torch.randn(4, 64), "int4")
    s[2, 1] = bad
    with pytest.raises(
        ValueError, match=r"at row 2, block 1 \(columns 32..63\); a stored table's scales are finite"
    ):
        dequantize_int_rows(v, s, "int4")
