"""The SSD row file (engram.storage.rowfile): layout, exact reads, page counts and refusals."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from engram.model.table import FP8Table
from engram.storage.rowfile import PAGE_BYTES, RowFile, RowFileHeader, split_layout_pages, write_row_file


def _table(rows: int, dim: int = 256, seed: int = 0) -> FP8Table:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    return FP8Table.from_float(w)


def _plain_offset(r: int, row_bytes: int, page: int = PAGE_BYTES) -> int:
    """Row r's offset written from the format's description, not from the module's arithmetic."""
    per_page = page // row_bytes
    return page + (r // per_page) * page + (r % per_page) * row_bytes


def test_geometry_264_byte_rows() -> None:
    h = RowFileHeader(100, 256)
    assert (h.row_bytes, h.rows_per_group, h.pages_per_group) == (264, 15, 1)
    assert h.file_bytes == PAGE_BYTES + 7 * PAGE_BYTES  # ceil(100 / 15) = 7 pages
    offs = h.offset_of(np.arange(100))
    assert all(int(offs[r]) == _plain_offset(r, 264) for r in range(100))
    assert ((offs % PAGE_BYTES) + 264 <= PAGE_BYTES).all()  # no row crosses a page
    big = RowFileHeader(3, 4096)  # 4224-byte rows: two whole pages each
    assert (big.rows_per_group, big.pages_per_group) == (1, 2)


@pytest.mark.parametrize("dim", [256, 64, 4096])
def test_every_row_round_trips(tmp_path, dim: int) -> None:
    t = _table(47, dim)
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale, layer_id=3, identity="abc", label="x")
    raw = path.read_bytes()
    rb = dim + dim // 32
    per_page = max(1, PAGE_BYTES // rb)
    # independent check of the on-disk bytes for a few rows
    for r in (0, 14, 15, 46):
        if rb <= PAGE_BYTES:
            off = _plain_offset(r, rb)
        else:
            off = PAGE_BYTES + r * (-(-rb // PAGE_BYTES)) * PAGE_BYTES
        assert raw[off : off + dim] == t.weight[r].view(torch.uint8).numpy().tobytes()
        assert raw[off + dim : off + rb] == t.scale[r].view(torch.uint8).numpy().tobytes()
    assert per_page >= 1
    f = RowFile(path, expect_rows=47, expect_dim=dim, expect_identity="abc", expect_layer_id=3)
    rows = torch.tensor([5, 0, 46, 5, 30, 31, 16])
    v, s = f.gather_bytes(rows)
    assert torch.equal(v.view(torch.uint8), t.weight[rows].view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), t.scale[rows].view(torch.uint8))
    allv, alls = f.gather_bytes(torch.arange(47))
    assert torch.equal(allv.view(torch.uint8), t.weight.view(torch.uint8))
    assert torch.equal(alls.view(torch.uint8), t.scale.view(torch.uint8))


def test_one_page_per_missed_row(tmp_path) -> None:
    t = _table(15 * 40)
    f = RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale))
    rows = np.arange(0, 600, 15)  # one row in each page
    v = np.empty((40, 256), np.uint8)
    s = np.empty((40, 8), np.uint8)
    f.read_rows(rows, v, s)
    assert f.stats()["pages_read"] == 40 and f.stats()["pages_per_row"] == 1.0
    assert f.stats()["reads"] == 1  # consecutive pages: one preadv
    f.reset_stats()
    f.read_rows(np.array([0, 1, 2, 300]), v[:4], s[:4])  # three rows share a page
    assert f.stats()["pages_read"] == 2 and f.stats()["reads"] == 2


def test_split_layout_pages() -> None:
    # values at offset 100 (not 256-aligned): row 15 spans bytes 3940..4195 -> pages 0 and 1
    per_row, distinct = split_layout_pages(100, 100 + 256 * 1000, 256, np.array([15]))
    assert per_row == 3 and distinct == 3
    per_row, _ = split_layout_pages(0, 256 * 1000, 256, np.array([0, 16]))
    assert per_row == 4  # aligned rows: 2 pages each


def test_direct_reads_match(tmp_path) -> None:
    t = _table(64)
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a filesystem without O_DIRECT falls back, with a warning
        f = RowFile(path, direct=True)
    v, _ = f.gather_bytes(torch.tensor([63, 1, 20]))
    assert torch.equal(v.view(torch.uint8), t.weight[[63, 1, 20]].view(torch.uint8))


def test_refusals(tmp_path) -> None:
    t = _table(40)
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale, identity="aaa", layer_id=1)
    with pytest.raises(ValueError, match=r"rows=40.*rows=41.*engram convert"):
        RowFile(path, expect_rows=41)
    with pytest.raises(ValueError, match=r"identity='aaa'.*identity='bbb'"):
        RowFile(path, expect_identity="bbb")
    with pytest.raises(ValueError, match=r"layer_id=1.*layer_id=14"):
        RowFile(path, expect_layer_id=14)
    f = RowFile(path)
    with pytest.raises(ValueError, match="row id 40 is out of range"):
        f.gather_bytes(torch.tensor([40]))
    # truncated after opening: a short read names the file
    with open(path, "r+b") as fh:
        fh.truncate(PAGE_BYTES + 100)
    with pytest.raises(ValueError, match="truncated"):
        f.gather_bytes(torch.tensor([39]))
    with pytest.raises(ValueError, match=r"truncated or damaged.*engram convert"):
        RowFile(path)
    bad = tmp_path / "bad.rows"
    bad.write_bytes(b"x" * 5000)
    with pytest.raises(ValueError, match="not an engram row file"):
        RowFile(bad)
    raw = bytearray(write_row_file(tmp_path / "c.rows", t.weight, t.scale).read_bytes())
    raw[20] ^= 1  # inside the header's fields
    (tmp_path / "c.rows").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        RowFile(tmp_path / "c.rows")
    with pytest.raises(FileNotFoundError):
        RowFile(tmp_path / "none.rows")
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    assert os.path.exists(path)


def test_parallel_reads_match(tmp_path) -> None:
    t = _table(15 * 300)
    f = RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale), io_threads=4)
    rows = torch.randperm(15 * 300, generator=torch.Generator().manual_seed(0))[:700]
    v, s = f.gather_bytes(rows)
    assert torch.equal(v.view(torch.uint8), t.weight[rows].view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), t.scale[rows].view(torch.uint8))
    assert f.stats()["reads"] > 16  # enough runs to be split over the threads
    with pytest.raises(ValueError, match="io_threads=0"):
        RowFile(tmp_path / "t.rows", io_threads=0)
    f.close()


def test_copies_reopen_the_file(tmp_path) -> None:
    import copy
    import pickle

    t = _table(30)
    f = RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale, identity="x"), io_threads=2)
    for g in (copy.deepcopy(f), pickle.loads(pickle.dumps(f))):
        assert g is not f and g.io_threads == 2 and g.header.identity == "x"
        v, _ = g.gather_bytes(torch.tensor([29, 0]))
        assert torch.equal(v.view(torch.uint8), t.weight[[29, 0]].view(torch.uint8))
    write_row_file(tmp_path / "t.rows", t.weight, t.scale, identity="y")  # replaced under the same name
    with pytest.raises(ValueError, match="identity='y'"):
        copy.deepcopy(f)


def test_direct_refused_falls_back_with_a_warning(tmp_path, monkeypatch) -> None:
    t = _table(20)
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale)
    real_open = os.open

    def no_direct(p, flags, *a):  # a filesystem that refuses O_DIRECT (tmpfs does)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.warns(UserWarning, match="refuses O_DIRECT.*page cache"):
        f = RowFile(path, direct=True)
    assert not f.direct
    v, _ = f.gather_bytes(torch.tensor([19]))
    assert torch.equal(v.view(torch.uint8), t.weight[[19]].view(torch.uint8))


def test_nan_scale_byte_and_tables_field(tmp_path) -> None:
    import copy

    from engram.storage.integrity import table_fingerprint

    t = _table(40, 64)
    fp = table_fingerprint(t.weight, t.scale)  # what a part records: the row file's bytes are checked by it
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale, identity="a", tables=fp)
    f = RowFile(path, expect_tables=fp)
    assert f.header.tables == fp and copy.deepcopy(f).header.tables == fp
    with pytest.raises(ValueError, match=r"tables='[0-9a-f]+' but the table needs tables='c'.*other weights"):
        RowFile(path, expect_tables="c")
    off = int(RowFileHeader(40, 64).offset_of(np.array([5]))[0]) + 64 + 1  # row 5's second scale
    with open(path, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\xff")
    with pytest.raises(ValueError, match=r"1 of its 80 scales are the byte 255.*row 5, column 1"):
        RowFile(path)


@pytest.mark.parametrize("version", [0, 1, 4, 2**32 - 1])
def test_other_header_versions_refused_with_a_valid_checksum(tmp_path, version) -> None:
    """Versions 2 (the table fingerprint in the header; what an FP8 file is written as) and VERSION (3:
    the row format joined it) are read; another version is refused by number before its fields are
    parsed, even with the checksum recomputed over the edited header."""
    import struct
    import zlib

    from engram.storage.rowfile import VERSION

    assert VERSION == 3
    t = _table(40)
    raw = bytearray(write_row_file(tmp_path / "t.rows", t.weight, t.scale).read_bytes())
    assert struct.unpack("<I", raw[8:12]) == (2,)
    raw[8:12] = struct.pack("<I", version)
    fixed = struct.calcsize("<8sIIQIIIIIIIi64s64s128s")  # docs/storage.md's fields; then their crc32
    raw[fixed : fixed + 4] = struct.pack("<I", zlib.crc32(bytes(raw[:fixed])))
    (tmp_path / "v.rows").write_bytes(bytes(raw))
    with pytest.raises(
        ValueError, match=f"row file version {version}, this engram reads versions 2 and 3; rewrite"
    ):
        RowFile(tmp_path / "v.rows")


def test_a_byte_damaged_in_a_row_is_refused_by_the_tables_fingerprint(tmp_path) -> None:
    """A value byte flipped in a row file (not a NaN byte: the scan lets it pass) no longer matches the
    fingerprint of the table it was copied from, which the header records: refused at open (by size,
    always with verify), naming the file and the fix; a header without a fingerprint is not checked."""
    from engram.storage.integrity import table_fingerprint

    t = _table(40, 64)
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale, tables=table_fingerprint(t.weight, t.scale))
    RowFile(path, verify=True)
    off = int(RowFileHeader(40, 64).offset_of(np.array([7]))[0]) + 3  # row 7's fourth value
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ 0x01]))  # 0x7F / 0xFF untouched: a plain value, another one
    with pytest.raises(
        ValueError, match=r"t.rows: its rows do not match the fingerprint of the table they were copied from"
    ):
        RowFile(path)
    plain = write_row_file(tmp_path / "p.rows", t.weight, t.scale)  # no fingerprint recorded: unchecked
    RowFile(plain)
