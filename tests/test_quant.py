"""Tests for engram.storage.quant: FP8 e4m3 values + ue8m0 block scales (DeepSeek-V4.1 table layout).

Exact checks compare against a plain per-block reference written here from the definition: the scale
exponent is the smallest e (>= -126) with amax <= 448 * 2**e, found by exact float64 comparisons; values
are rounded by torch's own fp8 cast; dequantisation is float(value) * 2.0**(b - 127) in float64.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram.rowformat.fp8 import BLOCK, FP8_MAX, fp8_row_bytes
from engram.storage import quant
from engram.storage.lookup import dequantize_gather
from engram.storage.quant import (
    dequantize_rows,
    quantize_rows,
    scale_bytes_to_float,
)

F32_MAX = float(np.finfo(np.float32).max)
# Every finite non-negative e4m3 value.
E4M3_POSITIVE = sorted(
    v for v in torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist() if v == v
)

# ------------------------------------------------------------------------------------------- reference


def ref_scale_byte(amax: float) -> int:
    """Scale byte from the definition: smallest e >= -126 with amax <= 448 * 2**e; zero block -> 127."""
    if amax == 0.0:
        return 127
    _, k = math.frexp(amax / 448.0)  # estimate only; corrected by exact comparisons below
    e = max(k - 2, -126)
    while amax > 448.0 * 2.0**e:  # float64: 448 * 2**e is exact for e in [-126, 127]
        e += 1
    while e > -126 and amax <= 448.0 * 2.0 ** (e - 1):
        e -= 1
    assert -126 <= e <= 127
    return e + 127


def ref_quantize(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [R, D] -> (fp8 bytes uint8 [R, D], scale bytes uint8 [R, D // block]), block by block."""
    rows, dim = x.shape
    vbytes = np.zeros((rows, dim), dtype=np.uint8)
    sbytes = np.zeros((rows, dim // block), dtype=np.uint8)
    for r in range(rows):
        for j in range(dim // block):
            blk = x[r, j * block : (j + 1) * block].astype(np.float64)
            b = ref_scale_byte(float(np.max(np.abs(blk))))
            sbytes[r, j] = b
            scaled = blk / 2.0 ** (b - 127)  # exact in float64
            q = torch.from_numpy(scaled).to(torch.float8_e4m3fn)
            # A value whose decode would pass float32's max (256 * 2**120 = 2**128) takes the largest
            # e4m3 magnitude that decodes finite instead.
            over = q.double().abs() * 2.0 ** (b - 127) > F32_MAX
            if bool(over.any()):
                finite_max = max(m for m in E4M3_POSITIVE if m * 2.0 ** (b - 127) <= F32_MAX)
                q = torch.where(over, torch.from_numpy(np.sign(scaled) * finite_max), q.double())
                q = q.to(torch.float8_e4m3fn)
            vbytes[r, j * block : (j + 1) * block] = q.view(torch.uint8).numpy()
    return vbytes, sbytes


def ref_dequantize(vbytes: np.ndarray, sbytes: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """float64 [R, D]: float(value) * 2.0**(b - 127); exact in float64."""
    vals = torch.from_numpy(vbytes).view(torch.float8_e4m3fn).double().numpy()
    scale = np.array([2.0 ** (int(b) - 127) for b in sbytes.reshape(-1)]).reshape(sbytes.shape)
    return vals * np.repeat(scale, block, axis=-1)


def as_fp8(vbytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(vbytes)).view(torch.float8_e4m3fn)


def as_e8m0(sbytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(sbytes)).view(torch.float8_e8m0fnu)


def u8(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def f32(v: float) -> float:
    return float(np.float32(v))


def next_up(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


# ----------------------------------------------------------------------------------------- strategies

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
pow2_f32 = st.builds(
    lambda k, neg: f32((-1.0 if neg else 1.0) * 2.0**k), st.integers(-149, 127), st.booleans()
)
# amax right at / next to the thresholds 448 * 2**j where the exponent steps.
threshold_f32 = st.builds(
    lambda j, d: [next_down, f32, next_up][d](448.0 * 2.0**j), st.integers(-140, 119), st.integers(0, 2)
)
element = st.one_of(finite_f32, pow2_f32, threshold_f32, st.just(0.0), st.just(-0.0))


@st.composite
def blocks(draw) -> list[float]:
    kind = draw(st.sampled_from(["mixed", "scaled", "zeros", "pow2", "threshold"]))
    if kind == "zeros":
        return [draw(st.sampled_from([0.0, -0.0])) for _ in range(BLOCK)]
    if kind == "scaled":  # one magnitude per block, random mantissas: relative error is meaningful
        k = draw(st.integers(-150, 127))
        ms = draw(st.lists(st.floats(-1.0, 1.0), min_size=BLOCK, max_size=BLOCK))
        return [f32(m * 2.0**k) for m in ms]
    pick = {"mixed": element, "pow2": pow2_f32, "threshold": st.one_of(threshold_f32, finite_f32)}[kind]
    return draw(st.lists(pick, min_size=BLOCK, max_size=BLOCK))


@st.composite
def tables(draw) -> np.ndarray:
    rows = draw(st.integers(1, 3))
    nb = draw(st.sampled_from([1, 2, 8]))
    data = [draw(blocks()) for _ in range(rows * nb)]
    return np.array(data, dtype=np.float32).reshape(rows, nb * BLOCK)


HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------- property tests


@HYP
@given(tables())
def test_quantize_matches_reference_and_bounds(x: np.ndarray) -> None:
    values, scales = quantize_rows(torch.from_numpy(x))
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert values.shape == x.shape and scales.shape == (x.shape[0], x.shape[1] // BLOCK)

    rv, rs = ref_quantize(x)
    np.testing.assert_array_equal(u8(scales), rs)
    np.testing.assert_array_equal(u8(values), rv)

    deq = dequantize_rows(values, scales).double().numpy()
    np.testing.assert_array_equal(deq, ref_dequantize(rv, rs))  # exact in fp32

    xd = x.astype(np.float64)
    s = np.repeat(2.0 ** (rs.astype(np.float64) - 127), BLOCK, axis=-1)
    # e4m3: 3 mantissa bits, so a normal scaled value is off by <= half an ulp <= |y| * 2**-4;
    # below the normal range (|y| < 2**-6) the spacing is 2**-9, so the error is <= 2**-10 (times s).
    bound = np.maximum(np.abs(xd) * 2.0**-4, s * 2.0**-10)
    assert np.all(np.abs(xd - deq) <= bound)

    amax = np.abs(xd).reshape(x.shape[0], -1, BLOCK).max(-1)
    scale = 2.0 ** (rs.astype(np.float64) - 127)
    nz = amax > 0
    assert np.all(amax[nz] / scale[nz] <= FP8_MAX)  # never saturates
    minimal = nz & (rs > 1)  # byte 1 is the clamp: half that scale is not allowed
    assert np.all(amax[minimal] / (scale[minimal] / 2) > FP8_MAX)  # half the scale would overflow
    assert np.all(rs[~nz] == 127)  # zero block -> scale 1.0
    assert np.all((rs >= 1) & (rs <= 254))


@HYP
@given(
    st.lists(st.integers(0, 255).filter(lambda b: b & 0x7F != 0x7F), min_size=64, max_size=64),
    st.lists(st.integers(0, 254), min_size=2, max_size=2),
)
def test_dequantize_exact_any_bytes(vb: list[int], sb: list[int]) -> None:
    vbytes = np.array(vb, dtype=np.uint8).reshape(1, 64)
    sbytes = np.array(sb, dtype=np.uint8).reshape(1, 2)
    got = dequantize_rows(as_fp8(vbytes), as_e8m0(sbytes))
    with np.errstate(over="ignore"):
        want = ref_dequantize(vbytes, sbytes).astype(np.float32)  # exact, or inf past float32's range
    np.testing.assert_array_equal(got.numpy(), want)
    # bf16 / fp16 are the exact fp32 result rounded once.
    for dt in (torch.bfloat16, torch.float16):
        low = dequantize_rows(as_fp8(vbytes), as_e8m0(sbytes), dtype=dt)
        assert low.dtype == dt
        assert torch.equal(low.view(torch.int16), got.to(dt).view(torch.int16))


def test_scale_bytes_to_float_all_bytes() -> None:
    b = torch.arange(256, dtype=torch.uint8)
    got = scale_bytes_to_float(b.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)] + [math.nan], dtype=torch.float64).float()
    assert torch.equal(got[:255], want[:255]) and torch.isnan(got[255])
    assert got[0].item() == 2.0**-127  # subnormal, exact
    # torch's own e8m0 conversion agrees.
    assert torch.equal(got[:255], b.view(torch.float8_e8m0fnu).float()[:255])
    raw = scale_bytes_to_float(b)  # raw uint8 bytes are accepted too
    assert torch.equal(raw[:255], got[:255]) and torch.isnan(raw[255])


# ------------------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize(
    ("amax", "byte"),
    [
        (448.0, 127),
        (next_up(448.0), 128),
        (next_down(448.0), 127),
        (224.0, 126),
        (next_up(224.0), 127),
        (1.0, 119),  # 448 * 2**-8 = 1.75 >= 1 > 0.875
        (2.0**-120, 1),  # would need 2**-128: clamped to 2**-126
        (F32_MAX, 247),
        (2.0**127, 246),
        (448.0 * 2.0**-126, 1),
        (next_up(448.0 * 2.0**-126), 2),
        (1e-45, 1),  # smallest subnormal: clamped to 2**-126
        (1e-38, 1),
        (0.0, 127),
    ],
)
def test_scale_byte_edges(amax: float, byte: int) -> None:
    x = torch.zeros(1, 64)
    x[0, 5] = -amax
    x[0, 40] = 1.0
    _, scales = quantize_rows(x)
    assert int(u8(scales)[0, 0]) == byte == ref_scale_byte(f32(amax))
    assert int(u8(scales)[0, 1]) == 119


def test_block_near_float32_max_decodes_finite() -> None:
    # 3.2964854e38 / 2**120 = 248 would round (ties to even) to 256, and 256 * 2**120 = 2**128 = inf.
    x = torch.tensor([[3.2964854e38, -F32_MAX, 2.0**127, 1.0] + [0.0] * 28])
    values, scales = quantize_rows(x)
    assert int(u8(scales)[0, 0]) == 247
    assert values.float()[0, :3].tolist() == [240.0, -240.0, 128.0]
    deq = dequantize_rows(values, scales)
    assert torch.isfinite(deq).all()
    assert torch.isfinite(dequantize_rows(values, scales, dtype=torch.bfloat16)).all()
    assert ((x - deq).abs() <= (x.abs() / 16).clamp(min=2.0**120 * 2.0**-10)).all()  # e4m3 half-ulp bound


def test_leading_dims_noncontiguous_and_input_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g) * torch.logspace(-30, 30, 64)
    v, s = quantize_rows(x)
    assert v.shape == (2, 3, 64) and s.shape == (2, 3, 2)
    v2, s2 = quantize_rows(x.reshape(6, 64))
    assert np.array_equal(u8(v).reshape(6, 64), u8(v2))
    assert np.array_equal(u8(s).reshape(6, 2), u8(s2))
    # non-contiguous input
    xt = x.reshape(6, 64).t().contiguous().t()
    assert not xt.is_contiguous()
    v3, s3 = quantize_rows(xt)
    assert np.array_equal(u8(v3), u8(v2)) and np.array_equal(u8(s3), u8(s2))
    # 1-D row
    v4, s4 = quantize_rows(x[1, 2])
    assert v4.shape == (64,) and s4.shape == (2,)
    assert np.array_equal(u8(v4), u8(v2)[5])
    # bf16 / fp16 / fp64 input = the same as their float32 value
    y = torch.randn(4, 96, generator=g) * 100
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        yd = y.to(dt)
        va, sa = quantize_rows(yd)
        vb, sb = quantize_rows(yd.float())
        assert np.array_equal(u8(va), u8(vb)) and np.array_equal(u8(sa), u8(sb))
    # dequantize keeps leading dims
    d = dequantize_rows(v, s)
    assert d.shape == (2, 3, 64)
    assert torch.equal(d.reshape(6, 64), dequantize_rows(v2, s2))


def test_chunked_paths_match(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)
    v, s = quantize_rows(x)
    d = dequantize_rows(v, s, dtype=torch.bfloat16)
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 100)  # 1 row per chunk
    vc, sc = quantize_rows(x)
    assert np.array_equal(u8(vc), u8(v)) and np.array_equal(u8(sc), u8(s))
    assert torch.equal(dequantize_rows(vc, sc, dtype=torch.bfloat16), d)
    x[30, 17] = math.inf
    with pytest.raises(ValueError, match=r"row 30, column 17"):
        quantize_rows(x)


def test_row_bytes() -> None:
    assert fp8_row_bytes(256) == 264
    assert fp8_row_bytes(64) == 66
    v, s = quantize_rows(torch.randn(5, 256))
    assert (v.nbytes + s.nbytes) / 5 == 264 == v.element_size() * 256 + s.element_size() * 8
    with pytest.raises(ValueError, match="D=100"):
        fp8_row_bytes(100)


# --------------------------------------------------------------------------------------------- tables


def _table(n: int = 50, dim: int = 64, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.logspace(-20, 20, n).unsqueeze(1)
    return quantize_rows(x)


def test_dequantize_rows_out() -> None:
    values, scales = _table(n=4)
    out = torch.empty(4, 64, dtype=torch.float16)
    assert dequantize_rows(values, scales, dtype=torch.float16, out=out) is out
    assert torch.equal(out, dequantize_rows(values, scales).to(torch.float16))


# -------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_rejects_non_finite(bad: float) -> None:
    x = torch.ones(2, 3, 64)
    x[1, 2, 33] = bad
    with pytest.raises(ValueError, match=r"row \(1, 2\) \(flat row 5\), column 33.*must be finite"):
        quantize_rows(x)
    x1 = torch.ones(4, 64, dtype=torch.bfloat16)
    x1[3, 0] = bad
    with pytest.raises(ValueError, match=r"row 3, column 0"):
        quantize_rows(x1)


def test_quantize_rejects_fp64_beyond_fp32() -> None:
    x = torch.ones(2, 32, dtype=torch.float64)
    x[1, 4] = 1e300
    with pytest.raises(ValueError, match=r"row 1, column 4.*overflows float32"):
        quantize_rows(x)


def test_quantize_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"D=48.*block=32"):
        quantize_rows(torch.ones(2, 48))
    with pytest.raises(TypeError, match=r"torch\.int64"):
        quantize_rows(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="block"):
        quantize_rows(torch.ones(2, 32), block=0)
    v, s = quantize_rows(torch.ones(2, 48), block=16)  # other block widths work
    assert s.shape == (2, 3)
    assert torch.equal(dequantize_rows(v, s, block=16), torch.ones(2, 48))


def test_dequantize_bad_inputs() -> None:
    values, scales = _table(n=4)
    with pytest.raises(TypeError, match=r"torch\.float32.*float8_e4m3fn"):
        dequantize_rows(values.float(), scales)
    with pytest.raises(TypeError, match=r"torch\.uint8.*float8_e8m0fnu"):
        dequantize_rows(values, scales.view(torch.uint8))
    with pytest.raises(TypeError, match=r"torch\.float64"):
        dequantize_rows(values, scales, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"D // block"):
        dequantize_rows(values, scales[:, :1])
    with pytest.raises(ValueError, match=r"D=48"):
        dequantize_rows(values[:, :48], scales)
    with pytest.raises(ValueError, match="leading dims"):
        dequantize_rows(values, scales[:3])
    with pytest.raises(ValueError, match=r"out has shape \(4, 32\)"):
        dequantize_rows(values, scales, out=torch.empty(4, 32))
    with pytest.raises(TypeError, match="out has dtype"):
        dequantize_rows(values, scales, out=torch.empty(4, 64, dtype=torch.bfloat16))


def test_nan_scale_byte() -> None:
    values, scales = _table(n=6)
    sb = u8(scales).copy()
    sb[4, 1] = 255
    bad = as_e8m0(sb)
    with pytest.raises(ValueError, match=r"NaN scale.*row 4, block 1 \(columns 32\.\.63\)"):
        dequantize_rows(values, bad)


# ---------------------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip(tmp_path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    values, scales = _table(n=8, dim=256)
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file({"values": values, "scales": scales}, str(path))
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    assert header["values"]["dtype"] == "F8_E4M3" and header["scales"]["dtype"] == "F8_E8M0"
    loaded = safetensors_torch.load_file(str(path))
    assert loaded["values"].dtype == torch.float8_e4m3fn and loaded["scales"].dtype == torch.float8_e8m0fnu
    assert np.array_equal(u8(loaded["values"]), u8(values)) and np.array_equal(
        u8(loaded["scales"]), u8(scales)
    )
    rows = torch.tensor([7, 0, 7])
    assert torch.equal(
        dequantize_gather(loaded["values"], loaded["scales"], rows), dequantize_gather(values, scales, rows)
    )
