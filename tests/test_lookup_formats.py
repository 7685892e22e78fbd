"""The integer formats' gathers: the numba kernel (engram.kernels.cpu_lookup_int) against the torch
backend of `lookup.dequantize_gather` and the plain twin `engram.kernels.reference.int_gather`, bit for
bit, for every value byte under scales from bfloat16 subnormals to huge ones, float32 / bfloat16 /
float16 output, any id shape, thread count, repeats (dedup) and streaming stores; and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engram.kernels import reference
from engram.rowformat.formats import RowFormat
from engram.storage import quant
from engram.storage.lookup import dequantize_gather

pytest.importorskip("numba")
cpu_lookup_int = pytest.importorskip("engram.kernels.cpu_lookup_int")

INT_FORMATS = [RowFormat.INT8_BLOCK32, RowFormat.INT8_ROW, RowFormat.INT4_BLOCK32]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def every_byte_table(fmt: RowFormat, n_scales: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r holds all 256 byte values (as int8, or as 512 nibbles) under positive bfloat16 scales spread
    over the whole range: subnormals, normals, up to 2^120."""
    g = torch.Generator().manual_seed(0)
    dim = 256 * fmt.values_per_byte
    byte_row = torch.randperm(256, generator=g).to(torch.uint8)
    values = byte_row.repeat(n_scales, 1)
    if fmt is not RowFormat.INT4_BLOCK32:
        values = values.view(torch.int8)
    exps = torch.randint(-133, 121, (n_scales, fmt.scales_per_row(dim)), generator=g).double()
    mant = 1 + torch.randint(0, 128, exps.shape, generator=g).double() / 128
    scales = (mant * 2.0**exps).to(torch.bfloat16)
    assert (scales.float() > 0).all()
    return values, scales


def exact(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The definition in float64: q * s, each product rounded once to float32."""
    fmt = RowFormat.INT4_BLOCK32 if values.dtype == torch.uint8 else RowFormat.INT8_BLOCK32
    dim = fmt.dim_of(values.shape[1])
    nb = scales.shape[1]
    q = values.to(torch.int32)
    if (
        values.dtype == torch.uint8
    ):  # column c: block c // blk, byte j % half of it, high nibble for j >= half
        blk = dim // nb
        c = torch.arange(dim)
        j = c % blk
        byte = q[:, (c // blk) * (blk // 2) + j % (blk // 2)]
        nib = (byte >> (4 * (j >= blk // 2)).to(torch.int32)) & 15
        q = torch.where(nib >= 8, nib - 16, nib)
    x = q.double().view(-1, nb, dim // nb) * scales.double().unsqueeze(-1)
    return x.view(-1, dim).float()[rows]


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_byte_under_every_scale_range(fmt: RowFormat, dtype: torch.dtype) -> None:
    values, scales = every_byte_table(fmt)
    rows = torch.randperm(values.shape[0], generator=torch.Generator().manual_seed(1))
    fast = dequantize_gather(values, scales, rows, dtype, backend="numba")
    ref = dequantize_gather(values, scales, rows, dtype, backend="torch")
    twin = reference.int_gather(values, scales, rows, dtype)
    assert torch.equal(bits(fast), bits(ref))
    assert torch.equal(bits(twin), bits(ref))
    assert torch.equal(bits(ref), bits(exact(values, scales, rows).to(dtype)))


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("threads", [1, 3])
def test_ids_shapes_dtypes_threads_and_repeats(fmt: RowFormat, threads: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 96, generator=g) * 0.05
    values, scales = quant.quantize(x, fmt)
    for rows in (
        torch.randint(0, 300, (7, 5, 11), generator=g),  # any shape
        torch.randint(0, 300, (4000,), generator=g).to(torch.int32),  # int32, repeats across windows
        torch.randint(0, 3, (2500,), generator=g),  # mostly repeats
        torch.zeros(0, 4, dtype=torch.long),
    ):
        for dtype in OUT_DTYPES:
            fast = dequantize_gather(values, scales, rows, dtype, backend="numba", threads=threads)
            ref = dequantize_gather(values, scales, rows, dtype, backend="torch")
            assert fast.shape == (*rows.shape, 96)
            assert torch.equal(bits(fast), bits(ref))
            if rows.numel():
                assert torch.equal(bits(ref), bits(reference.int_gather(values, scales, rows, dtype)))


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_streaming_stores_and_no_dedup(fmt: RowFormat) -> None:
    """Outputs from 4 MiB on are written with non-temporal stores; the kernel without dedup is the same."""
    g = torch.Generator().manual_seed(3)
    values, scales = quant.quantize(torch.randn(512, 256, generator=g), fmt)
    rows = torch.randint(0, 512, (1 << 13,), generator=g)
    out = torch.empty((rows.numel(), 256))
    assert cpu_lookup_int.stream_out(out)
    fast = dequantize_gather(values, scales, rows, torch.float32, out, backend="numba", threads=2)
    ref = dequantize_gather(values, scales, rows, torch.float32, backend="torch")
    assert torch.equal(fast, ref)
    o = torch.empty_like(ref)
    four = fmt is RowFormat.INT4_BLOCK32
    v_u8, s_u16 = values.view(torch.uint8).numpy(), scales.view(torch.uint16).numpy()
    code, _ = cpu_lookup_int.gather_int_range(
        v_u8, s_u16, rows.numpy(), o.numpy(), four, False, False, 0, rows.numel()
    )
    assert code == cpu_lookup_int.OK and torch.equal(o, ref)


def test_format_is_inferred_or_checked() -> None:
    values, scales = quant.quantize(torch.randn(10, 64), "int4")
    rows = torch.tensor([3, 1])
    assert torch.equal(
        dequantize_gather(values, scales, rows, fmt="int4"), quant.dequantize(values, scales)[rows]
    )
    with pytest.raises(TypeError, match=r"expected torch.int8 for format int8 \(these are int4 values"):
        dequantize_gather(values, scales, rows, fmt="int8")
    with pytest.raises(ValueError, match="not a row format"):
        dequantize_gather(values, scales, rows, fmt="q4_0")


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_errors_are_the_references(backend: str, fmt: RowFormat) -> None:
    values, scales = quant.quantize(torch.randn(20, 64), fmt)
    with pytest.raises(ValueError, match=r"row id 20 at position \(1,\) is out of range \[0, 20\)"):
        dequantize_gather(values, scales, torch.tensor([0, 20]), backend=backend)
    for bad in (math.nan, 0.0, -2.0, math.inf):
        s = scales.clone()
        s[7, -1] = bad
        with pytest.raises(ValueError, match=r"at table row 7, block .*finite and positive"):
            dequantize_gather(values, s, torch.tensor([1, 7, 7]), backend=backend)
        dequantize_gather(values, s, torch.tensor([1, 6]), backend=backend)  # rows not asked for: fine


def test_kernel_scale_check_agrees_with_the_reference_on_every_bfloat16() -> None:
    """The kernel's one-compare scale test against `check_int_scales`' rule, over all 65536 bit patterns."""
    pattern = torch.arange(65536, dtype=torch.int32).to(torch.uint16)
    s = pattern.view(torch.bfloat16)
    want = ~((s > 0) & ~torch.isinf(s))
    check = cpu_lookup_int._bad_scale
    got = torch.tensor([bool(check(np.uint16(b))) for b in range(65536)])
    assert torch.equal(got, want)
