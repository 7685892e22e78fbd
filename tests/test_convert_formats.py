"""`engram convert --format` and the V4.1 checkpoint reader with the integer row formats: a scaled V4.1
checkpoint converted to int8 / int8-row / int4 (with row files) loads as `MmapQuantTable` / `QuantTable`
holding exactly the requantised FP8 rows, its row files open checked against it, and the bad inputs are
refused naming the file and the fix: an unknown format name, a shard whose recorded format disagrees
with its tensors, NaN / zero scales, a 4-bit row file opened for an INT8 table."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.convert import convert_table, make_scaled_v41_checkpoint, open_row_file
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.checkpoint.v41 import TABLE_FORMAT_KEY, load_engram_modules, stored_tables
from engram.checkpoint.v41.format import CRC32_KEY, SEAL_KEY, seal_of, shard_metadata
from engram.cli import main
from engram.model.table import QuantTable, requantize_table
from engram.rowformat.formats import RowFormat
from engram.storage.rowfile import RowFile

BASE = 512  # ~12k rows a layer
INT_FORMATS = ["int8", "int8-row", "int4"]


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("v41")
    make_scaled_v41_checkpoint(d, base=BASE, hidden_size=32, hc_mult=4, seed=5)
    return d


@pytest.fixture(scope="module")
def converted(v41, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for fmt in INT_FORMATS:
        dst = tmp_path_factory.mktemp(fmt) / "ckpt"
        convert_table(v41, dst, to=fmt, row_file=True)
        out[fmt] = dst
    return out


def shard(d: Path) -> Path:
    (p,) = sorted(d.glob("*.safetensors"))
    return p


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_convert_writes_the_format_and_loads_it(v41, converted, fmt: str) -> None:
    rf = RowFormat(fmt)
    _, src = load_engram_modules(v41, mmap=False)
    for mmap in (True, False):
        config, mods = load_engram_modules(converted[fmt], mmap=mmap)
        for lid, m in mods.items():
            t = m.table
            assert isinstance(t, MmapQuantTable if mmap else QuantTable) and t.row_format is rf
            want_v, want_s = requantize_table(src[lid].table.weight, src[lid].table.scale, rf)
            assert torch.equal(t.weight, want_v) and torch.equal(t.scale, want_s)
            assert torch.equal(m.wkv.weight, src[lid].wkv.weight)  # the module weights are copied
            rows = torch.randint(0, t.num_rows, (2, 7, config.rows_per_token))
            h = torch.randn(2, 7, config.hc_mult, config.hidden_size)
            assert m(h, rows).shape == h.shape
    with safe_open(str(shard(converted[fmt])), "pt") as f:
        meta = f.metadata()
    assert meta[f"{TABLE_FORMAT_KEY}.1"] == fmt
    _, stored = stored_tables(converted[fmt])
    assert {s.row_format for s in stored.values()} == {rf}


def test_bytes_of_the_tables(v41, converted) -> None:
    """The 4-bit checkpoint's tables take 144 / 264 of the FP8 ones'."""
    _, fp8 = stored_tables(v41)
    _, q4 = stored_tables(converted["int4"])

    def table_bytes(s) -> int:
        return sum(
            math.prod(e.shape) * e.torch_dtype.itemsize for t in s.values() for e in (t.weight, t.scale)
        )

    assert table_bytes(q4) / table_bytes(fp8) == pytest.approx(144 / 264)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_row_files_open_checked_against_the_checkpoint(converted, fmt: str) -> None:
    _, mods = load_engram_modules(converted[fmt], mmap=False)
    for lid, m in mods.items():
        f = open_row_file(converted[fmt], lid)
        assert f.row_format is RowFormat(fmt)
        rows = torch.randint(0, m.table.num_rows, (64,))
        v, s = f.gather_bytes(rows)
        assert torch.equal(v, m.table.weight[rows]) and torch.equal(s, m.table.scale[rows])


def test_a_four_bit_row_file_beside_an_int8_table_is_refused(converted, tmp_path) -> None:
    d = tmp_path / "mixed"
    shutil.copytree(converted["int8"], d)
    shutil.copy(converted["int4"] / "engram_layer1.rows", d / "engram_layer1.rows")
    with pytest.raises(
        ValueError, match=r"engram_layer1\.rows: the row file holds int4 rows .* read as int8"
    ):
        open_row_file(d, 1)


def test_requantising_between_integer_formats(converted, tmp_path) -> None:
    """int4 -> int8 goes through float32 chunk by chunk: exactly quantise(dequantise(int4 rows))."""
    dst = tmp_path / "back"
    convert_table(converted["int4"], dst, to="int8")
    _, q4 = load_engram_modules(converted["int4"], mmap=False)
    _, q8 = load_engram_modules(dst, mmap=False)
    for lid in q4:
        want = QuantTable.from_float(q4[lid].table.to_float(), "int8")
        assert torch.equal(q8[lid].table.weight, want.weight) and torch.equal(q8[lid].table.scale, want.scale)


def test_the_command(v41, tmp_path, capsys) -> None:
    dst = tmp_path / "q4"
    assert main(["convert", str(v41), str(dst), "--format", "int4", "--row-file", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["to"] == "int4" and out["row_files"] == ["engram_layer1.rows", "engram_layer14.rows"]
    assert RowFile(dst / "engram_layer14.rows").row_format is RowFormat.INT4_BLOCK32
    with pytest.raises(SystemExit) as e:
        main(["convert", str(v41), str(tmp_path / "x"), "--format", "int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int3'" in err and "'int4'" in err


def _rewrite(path: Path, edit) -> None:
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        meta = f.metadata()
    edit(tensors, meta)
    save_file(tensors, str(path), meta)


def test_a_recorded_format_that_disagrees_with_the_tensors_is_refused(converted, tmp_path) -> None:
    d = tmp_path / "edited"
    shutil.copytree(converted["int8"], d)
    _rewrite(shard(d), lambda t, meta: meta.update({f"{TABLE_FORMAT_KEY}.14": "int4"}))
    # edited after the write: the seal says so, the one problem of the file (its entries are not trusted)
    with pytest.raises(ValueError, match=r"\(1 problem\(s\)\):\n  - .*does not match its seal"):
        load_engram_modules(d)
    # written so (the seal over the wrong entry): the entry is compared with the tensors
    _rewrite(shard(d), lambda t, meta: meta.update({SEAL_KEY: seal_of(meta)}))
    with pytest.raises(
        ValueError,
        match=r"layer 14's table is recorded as format 'int4' \(engram_table_format\.14\) but its tensors are int8 "
        r"\(layers\.14\.engram\.embed\.weight: I8 \[\d+, 256\]\).*engram convert SRC DST --format",
    ):
        load_engram_modules(d)


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_nan_or_zero_scales_in_a_checkpoint_are_refused(converted, tmp_path, bad: float) -> None:
    d = tmp_path / "damaged"
    shutil.copytree(converted["int4"], d)

    def edit(t, meta) -> None:
        s = t["layers.1.engram.embed.scale"].clone()
        s[40, 2] = bad
        t["layers.1.engram.embed.scale"] = s

    _rewrite(shard(d), edit)
    # the file's CRC32 of the scales no longer holds: refused for that first
    with pytest.raises(
        ValueError, match=r"tensor 'layers\.1\.engram\.embed\.scale': its bytes do not match the CRC32"
    ):
        load_engram_modules(d)

    def unsealed(t, meta) -> None:  # CRC32s and seal removed: an int4 file is written only with them
        for key in (CRC32_KEY, SEAL_KEY):
            meta.pop(key, None)

    _rewrite(shard(d), unsealed)
    with pytest.raises(ValueError, match=r"no engram_seal and no engram_crc32.*its seal was removed"):
        load_engram_modules(d)

    def resealed(t, meta) -> None:  # a writer that wrote the bad scales, with their CRC32s and a seal
        meta.clear()
        meta.update(shard_metadata(layout_fingerprint(Layout(stored_tables(converted["int4"])[0])), t))

    _rewrite(shard(d), resealed)
    with pytest.raises(
        ValueError,
        match=r"model-00001-of-00001\.safetensors: table 'layers\.1\.engram\.embed\.weight' .*1 of its \d+ scales "
        r"are not finite and positive .*row 40, column 2.*re-copy it",
    ):
        load_engram_modules(d)


def test_tensors_of_a_format_with_wrong_shapes_are_refused(converted, tmp_path) -> None:
    """4-bit values whose width is not dim / 2, and int8 scales in the wrong dtype: named tensor by tensor."""
    d = tmp_path / "shapes"
    shutil.copytree(converted["int4"], d)

    def edit(t, meta) -> None:
        t["layers.1.engram.embed.weight"] = t["layers.1.engram.embed.weight"][:, :100].contiguous()
        t["layers.14.engram.embed.scale"] = t["layers.14.engram.embed.scale"].float()

    _rewrite(shard(d), edit)
    with pytest.raises(ValueError) as e:
        load_engram_modules(d)
    msg = str(e.value)
    assert "layers.1.engram.embed.weight: shape [" in msg and ", 128] (layer 1's prime sum) (int4)" in msg
    assert "layers.14.engram.embed.scale: dtype F32, expected BF16 (the scales of a int4 table)" in msg
