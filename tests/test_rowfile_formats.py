"""Row files of every row format (engram.storage.rowfile): the header records the format (version 3; an
FP8 file stays version 2, byte for byte), no row crosses a 4 KiB page, rows read back exactly, and the
bad inputs are refused naming the file and the fix: a 4-bit file read as INT8, a header whose format
disagrees with the file's size, an unknown format code, NaN / zero scales."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from engram.rowformat.formats import RowFormat
from engram.storage import quant
from engram.storage.rowfile import (
    PAGE_BYTES,
    RowFile,
    RowFileHeader,
    create_row_file,
    write_row_file,
    write_row_range,
)

FORMATS = list(RowFormat)
_V3 = "<8sIIQIIIIIIIi64s64s128sI"


def table(
    fmt: RowFormat, rows: int = 100, dim: int = 256, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 0.02
    return quant.quantize(x, fmt)


def test_rows_per_page_at_v41_width() -> None:
    per = {f.value: RowFileHeader(10, 256, fmt=f).rows_per_group for f in RowFormat}
    assert per == {"fp8": 15, "int8": 15, "int8-row": 15, "int4": 28}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [32, 256, 8192])
def test_round_trip_and_the_page_rule(tmp_path, fmt: RowFormat, dim: int) -> None:
    values, scales = table(fmt, rows=70, dim=dim)
    path = write_row_file(tmp_path / "t.rows", values, scales, layer_id=3, identity="abc", fmt=fmt)
    f = RowFile(path, expect_format=fmt)
    h = f.header
    assert (f.row_format, h.row_bytes, h.dim) == (fmt, fmt.row_bytes(dim), dim)
    assert path.stat().st_size == h.file_bytes
    starts = h.offset_of(np.arange(70))
    ends = starts + h.row_bytes - 1
    if h.row_bytes <= PAGE_BYTES:
        assert (starts // PAGE_BYTES == ends // PAGE_BYTES).all()  # no row crosses a page
    else:
        assert (starts % PAGE_BYTES == 0).all()  # a row over a page starts one
    rows = torch.tensor([69, 0, 5, 5, 31])
    v, s = f.gather_bytes(rows)
    assert v.dtype == fmt.value_dtype and s.dtype == fmt.scale_dtype
    assert torch.equal(v.view(torch.uint8), values[rows].view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), scales[rows].contiguous().view(torch.uint8))
    assert f.stats()["pages_per_row"] <= (1 if h.row_bytes <= PAGE_BYTES else h.pages_per_group)
    version = struct.unpack("<I", path.read_bytes()[8:12])[0]
    assert version == (2 if fmt is RowFormat.FP8 else 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ranges_written_by_several_writers_equal_the_whole_file(tmp_path, fmt: RowFormat) -> None:
    values, scales = table(fmt, rows=50)
    whole = write_row_file(tmp_path / "whole.rows", values, scales)
    h = RowFileHeader(50, 256, fmt=fmt)
    part = tmp_path / "part.rows"
    create_row_file(part, h)
    for lo, hi in ((0, 7), (30, 50), (7, 30)):
        write_row_range(part, h, lo, values[lo:hi], scales[lo:hi])
    assert part.read_bytes() == whole.read_bytes()
    other = RowFormat.INT8_BLOCK32 if fmt is RowFormat.INT4_BLOCK32 else RowFormat.INT4_BLOCK32
    v2, s2 = table(other, rows=5)
    with pytest.raises(TypeError, match=rf"values has dtype torch\.\w+, expected {fmt.value_dtype}"):
        write_row_range(part, h, 0, v2, s2)


def test_a_four_bit_file_read_as_int8_is_refused(tmp_path) -> None:
    path = write_row_file(tmp_path / "t.rows", *table(RowFormat.INT4_BLOCK32))
    with pytest.raises(
        ValueError,
        match=r"t\.rows: the row file holds int4 rows \(144 B each\) but it is read as int8 \(272 B each\).*engram convert",
    ):
        RowFile(path, expect_format="int8")
    with pytest.raises(ValueError, match="expect_format='int5' is not a row format"):
        RowFile(path, expect_format="int5")


def _rewrite_header(path, **fields) -> None:
    """Edit header fields by name (version 3 layout) and recompute the checksum."""
    names = ["magic", "version", "header", "rows", "dim", "block", "row_bytes", "stride", "rpg", "ppg", "page",
             "layer", "identity", "tables", "label", "format"]  # fmt: skip
    raw = bytearray(path.read_bytes())
    n = struct.calcsize(_V3)
    vals = dict(zip(names, struct.unpack(_V3, raw[:n]), strict=True))
    vals.update(fields)
    raw[:n] = struct.pack(_V3, *(vals[k] for k in names))
    raw[n : n + 4] = struct.pack("<I", zlib.crc32(bytes(raw[:n])))
    path.write_bytes(bytes(raw))


def test_a_header_format_that_disagrees_with_the_size_is_refused(tmp_path) -> None:
    """An int8 file whose header (geometry included, checksum valid) says int4: the size names it."""
    values, scales = table(RowFormat.INT8_BLOCK32, rows=60)
    path = write_row_file(tmp_path / "t.rows", values, scales)
    h4 = RowFileHeader(60, 256, fmt="int4")
    _rewrite_header(
        path, format=3, block=32, row_bytes=h4.row_bytes, stride=h4.row_stride, rpg=h4.rows_per_group
    )
    with pytest.raises(
        ValueError,
        match=r"needs \d+ \(the size of a fp8 / int8 / int8-row file of these rows: the header's format disagrees with the data\)",
    ):
        RowFile(path)
    # the format code alone edited: the geometry no longer follows from it
    path = write_row_file(tmp_path / "u.rows", values, scales)
    _rewrite_header(path, format=3)
    with pytest.raises(ValueError, match=r"u\.rows: header geometry .* format int4: expected"):
        RowFile(path)


def test_an_unknown_format_code_is_refused(tmp_path) -> None:
    path = write_row_file(tmp_path / "t.rows", *table(RowFormat.INT8_ROW))
    _rewrite_header(path, format=17)
    with pytest.raises(
        ValueError, match=r"format code 17 is no row format this engram knows \(0 fp8, 1 int8"
    ):
        RowFile(path)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, float("inf"), -1.0])
@pytest.mark.parametrize("fmt", [RowFormat.INT8_BLOCK32, RowFormat.INT8_ROW, RowFormat.INT4_BLOCK32])
def test_bad_scales_refused_at_open(tmp_path, fmt: RowFormat, bad: float) -> None:
    values, scales = table(fmt, rows=40)
    scales[33, -1] = bad
    path = write_row_file(tmp_path / "t.rows", values, scales)
    with pytest.raises(
        ValueError, match=r"1 of its \d+ scales are not finite and positive .* row 33, block .*engram convert"
    ):
        RowFile(path)
