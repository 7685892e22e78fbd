"""Tables of every row format: `QuantTable` (model.table) and `MmapQuantTable` (checkpoint.mmap_table)
gather exactly what the format's dequantisation gives, keep their bytes under a parent's dtype change,
and refuse a file whose tensors are another format's (a 4-bit table read as INT8) or whose scales are
NaN / zero (`integrity.check_quant_table`), naming the file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engram.checkpoint.mmap_table import MmapFP8Table, MmapQuantTable
from engram.model.table import FP8Table, QuantTable
from engram.rowformat.formats import RowFormat
from engram.storage import quant
from engram.storage.integrity import check_quant_table

FORMATS = list(RowFormat)


def weight(rows: int = 300, dim: int = 256) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)) * 0.03


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_table_gathers_the_dequantised_rows(fmt: RowFormat) -> None:
    w = weight()
    t = QuantTable.from_float(w, fmt)
    assert (t.row_format, t.num_rows, t.dim) == (fmt, 300, 256)
    assert t.weight.dtype == fmt.value_dtype and t.scale.dtype == fmt.scale_dtype
    full = quant.dequantize(*quant.quantize(w, fmt))
    assert torch.equal(t.to_float(), full)
    rows = torch.tensor([[5, 299, 5], [0, 1, 2]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(t.gather(rows, dtype), full[rows].to(dtype))
    assert torch.equal(t.gather(rows, torch.float64), full[rows].double())
    assert f"format={fmt.value}" in repr(t)


def test_fp8_table_is_the_fp8_quant_table() -> None:
    w = weight()
    a, b = FP8Table.from_float(w), QuantTable.from_float(w, "fp8")
    assert isinstance(a, QuantTable) and a.row_format is RowFormat.FP8
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    with pytest.raises(ValueError, match=r"an FP8Table holds fp8 rows.*QuantTable\.from_float"):
        FP8Table.from_float(w, "int4")


@pytest.mark.parametrize("fmt", [RowFormat.INT8_BLOCK32, RowFormat.INT4_BLOCK32])
def test_a_parents_dtype_change_keeps_the_bytes(fmt: RowFormat) -> None:
    holder = torch.nn.Module()
    holder.t = QuantTable.from_float(weight(), fmt)
    before = holder.t.weight.clone(), holder.t.scale.clone()
    holder.half()
    assert holder.t.weight.dtype == fmt.value_dtype and holder.t.scale.dtype == torch.bfloat16
    assert torch.equal(holder.t.weight, before[0]) and torch.equal(holder.t.scale, before[1])
    assert set(holder.state_dict()) == {"t.weight", "t.scale"}


def test_quant_table_checks_its_pair() -> None:
    v, s = quant.quantize(weight(4, 64), "int4")
    with pytest.raises(
        TypeError, match=r"QuantTable\(int8\): values has dtype torch\.uint8.*these are int4 values"
    ):
        QuantTable(v, s, "int8")
    with pytest.raises(ValueError, match=r"QuantTable\(int4\): scales has shape \(4, 1\), expected \(4, 2\)"):
        QuantTable(v, s[:, :1], "int4")
    with pytest.raises(ValueError, match="not a row format"):
        QuantTable.from_float(weight(4, 64), "nf4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mmap_table_reads_the_file_in_place(tmp_path, fmt: RowFormat) -> None:
    t = QuantTable.from_float(weight(), fmt)
    path = tmp_path / "t.safetensors"
    save_file({"t.weight": t.weight, "t.scale": t.scale}, str(path))
    m = MmapQuantTable(path, "t.weight", "t.scale", fmt)
    assert (m.row_format, m.num_rows, m.dim) == (fmt, 300, 256)
    rows = torch.randint(0, 300, (50,))
    assert torch.equal(m.gather(rows, torch.bfloat16), t.gather(rows, torch.bfloat16))
    assert torch.equal(m.to_float(), t.to_float())
    if fmt is RowFormat.FP8:
        assert torch.equal(MmapFP8Table(path, "t.weight", "t.scale").gather(rows), t.gather(rows))


def test_a_four_bit_file_read_as_int8_is_refused_naming_the_file(tmp_path) -> None:
    t = QuantTable.from_float(weight(), "int4")
    path = tmp_path / "t4.safetensors"
    save_file({"t.weight": t.weight, "t.scale": t.scale}, str(path))
    with pytest.raises(ValueError, match=r"t4\.safetensors: tensor 't\.weight' has dtype U8, expected I8"):
        MmapQuantTable(path, "t.weight", "t.scale", "int8")
    with pytest.raises(
        ValueError, match=r"t4\.safetensors: tensor 't\.weight' has dtype U8, expected F8_E4M3"
    ):
        MmapFP8Table(path, "t.weight", "t.scale")
    t8 = QuantTable.from_float(weight(), "int8")
    save_file({"t.weight": t8.weight, "t.scale": t8.scale}, str(path))
    with pytest.raises(
        ValueError, match=r"t4\.safetensors: tensor 't\.scale' has shape \[300, 8\], expected \[300, 1\]"
    ):
        MmapQuantTable(path, "t.weight", "t.scale", "int8-row")


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_nan_or_zero_scales_in_a_stored_table_are_refused(bad: float) -> None:
    t = QuantTable.from_float(weight(), "int4")
    check_quant_table(t.weight, t.scale, t.row_format, "x.safetensors: table 't'")
    s = t.scale.clone()
    s[17, 3] = bad
    with pytest.raises(
        ValueError,
        match=r"x\.safetensors: table 't': 1 of its 2400 scales are not finite and positive .*row 17, column 3",
    ):
        check_quant_table(t.weight, s, t.row_format, "x.safetensors: table 't'")
