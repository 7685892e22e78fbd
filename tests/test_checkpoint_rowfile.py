"""`engram convert --row-file`: row files written beside a V4.1 checkpoint, checked against it when opened."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.convert import (
    make_scaled_v41_checkpoint,
    open_row_file,
    row_file_path,
)
from engram.checkpoint.v41 import load_engram_modules, stored_tables
from engram.cli import main
from engram.systems.levels import LevelTable


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("rowfile")
    src, dst = root / "src", root / "dst"
    make_scaled_v41_checkpoint(src, base=512, hidden_size=32)
    assert main(["convert", str(src), str(dst), "--row-file"]) == 0
    return src, dst


def test_convert_writes_exact_row_files(converted, capsys) -> None:
    _, dst = converted
    config, modules = load_engram_modules(dst, mmap=True, dtype=None)
    for layer_id, module in modules.items():
        table = module.table
        f = open_row_file(dst, layer_id)
        assert f.header.identity == layout_fingerprint(Layout(config)) and f.header.label == config.name
        assert f.header.tables == stored_tables(dst)[1][layer_id].fingerprint and len(f.header.tables) == 64
        rows = torch.arange(table.num_rows)
        v, s = f.gather_bytes(rows)
        assert torch.equal(v.view(torch.uint8), table.weight.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), table.scale.view(torch.uint8))
        lt = LevelTable(f, device_rows=64, host_rows=256)
        ids = torch.randint(0, table.num_rows, (4, 48), generator=torch.Generator().manual_seed(layer_id))
        assert torch.equal(lt.gather(ids), table.gather(ids))
        assert lt.stats()["backing"]["pages_per_row"] <= 1.0


def test_convert_json_lists_row_files(converted, tmp_path, capsys) -> None:
    src, _ = converted
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "d"), "--row-file", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["row_files"]) == ["engram_layer1.rows", "engram_layer14.rows"]
    assert all(name.endswith(".safetensors") for name in out["shards"])


def test_row_file_of_another_layer_or_checkpoint_refused(converted, tmp_path) -> None:
    _, dst = converted
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    shutil.copy(row_file_path(dst, 14), row_file_path(bad, 1))  # layer 14's rows under layer 1's name
    with pytest.raises(ValueError, match=r"engram convert SRC DST --row-file"):
        open_row_file(bad, 1)
    other = tmp_path / "other"
    make_scaled_v41_checkpoint(other, base=600, hidden_size=32)
    shutil.copy(row_file_path(dst, 1), row_file_path(other, 1))  # another layout's rows
    with pytest.raises(ValueError, match=r"rows=|identity="):
        open_row_file(other, 1)
    with pytest.raises(FileNotFoundError, match="--row-file"):
        open_row_file(other, 14)
    with pytest.raises(ValueError, match="layer_id=3"):
        open_row_file(dst, 3)
    raw = row_file_path(bad, 14)
    with open(raw, "r+b") as f:
        f.truncate(raw.stat().st_size - 100)
    with pytest.raises(ValueError, match="truncated"):
        open_row_file(bad, 14)


def test_cli_refuses_row_file_for_float(converted, tmp_path, capsys) -> None:
    src, _ = converted
    code = main(["convert", str(src), str(tmp_path / "f"), "--to", "float", "--row-file"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and "Traceback" not in err
        and "--row-file needs --format fp8, int8, int8-row or int4" in err
    )


def test_row_file_of_another_checkpoint_of_the_same_layout_refused(converted, tmp_path) -> None:
    """Same layout, other weights: only the table fingerprint tells the files apart."""
    _, dst = converted
    other_src, other = tmp_path / "osrc", tmp_path / "other"
    make_scaled_v41_checkpoint(other_src, base=512, hidden_size=32, seed=1)  # same layout, other rows
    assert main(["convert", str(other_src), str(other), "--row-file"]) == 0
    mixed = tmp_path / "mixed"
    shutil.copytree(dst, mixed)
    shutil.copy(row_file_path(other, 1), row_file_path(mixed, 1))
    want, got = (stored_tables(c)[1][1].fingerprint for c in (dst, other))
    with pytest.raises(ValueError, match=rf"tables='{got}' but the table needs tables='{want}'.*--row-file"):
        open_row_file(mixed, 1)
    open_row_file(mixed, 14)  # its own


def test_row_file_one_row_longer_than_the_table_refused(converted, tmp_path) -> None:
    from engram.storage.rowfile import write_row_file

    _, dst = converted
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    good = open_row_file(dst, 1)
    h = good.header
    v, s = good.gather_bytes(torch.arange(h.rows))
    v = torch.cat([v.view(torch.uint8), v.view(torch.uint8)[:1]]).view(v.dtype)  # one row more
    s = torch.cat([s.view(torch.uint8), s.view(torch.uint8)[:1]]).view(s.dtype)
    write_row_file(row_file_path(bad, 1), v, s, layer_id=1, identity=h.identity, tables=h.tables)
    with pytest.raises(ValueError, match=rf"rows={h.rows + 1} but the table needs rows={h.rows}"):
        open_row_file(bad, 1)


def test_row_file_link_out_of_the_folder_or_fifo_refused(converted, tmp_path) -> None:
    import os

    _, dst = converted
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    outside = tmp_path / "elsewhere.rows"
    shutil.move(row_file_path(bad, 1), outside)
    row_file_path(bad, 1).symlink_to(outside)
    with pytest.raises(ValueError, match=r"a symlink to .*outside the checkpoint folder.*cp -L"):
        open_row_file(bad, 1)
    row_file_path(bad, 1).unlink()
    os.mkfifo(row_file_path(bad, 1))  # opening it would block for good
    with pytest.raises(ValueError, match="named pipe"):
        open_row_file(bad, 1)


def test_nan_bytes_in_a_row_file_refused(converted, tmp_path, monkeypatch) -> None:
    import numpy as np

    import engram.storage.integrity as integrity
    from engram.storage.rowfile import RowFileHeader

    _, dst = converted
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    path = row_file_path(bad, 14)
    h = open_row_file(bad, 14).header
    for row, col, byte in ((7, 3, 0x7F), (h.rows - 1, h.dim - 1, 0xFF)):  # e4m3's two NaN bytes
        off = int(RowFileHeader(h.rows, h.dim).offset_of(np.array([row]))[0]) + col
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(bytes([byte]))
    with pytest.raises(
        ValueError, match=r"2 of its \d+ values are the byte 0x7F / 0xFF.*row 7, column 3.*--row-file"
    ):
        open_row_file(bad, 14)
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 0)  # as if the file were over the limit
    with pytest.raises(ValueError, match="0x7F / 0xFF"):
        open_row_file(bad, 14, verify=True)  # --verify always scans
    with pytest.warns(integrity.UnscannedTableWarning, match="only with --verify"):
        open_row_file(bad, 14)


def test_row_files_beside_a_checkpoint_without_fingerprints(converted, tmp_path) -> None:
    """DeepSeek's files record no fingerprints: the table's bytes are hashed instead, on both sides."""
    from safetensors.torch import load_file, save_file

    from engram.checkpoint.convert import write_row_files

    src, dst = converted
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    for shard in plain.glob("*.safetensors"):
        save_file(load_file(str(shard)), str(shard))  # no metadata
    assert all(t.fingerprint is None for t in stored_tables(plain)[1].values())
    write_row_files(plain)
    f = open_row_file(plain, 1)
    assert f.header.tables == stored_tables(dst)[1][1].fingerprint  # the same bytes as dst's table
    other = tmp_path / "other"
    make_scaled_v41_checkpoint(other, base=512, hidden_size=32, seed=1)
    shutil.copy(row_file_path(plain, 1), row_file_path(other, 1))
    with pytest.raises(ValueError, match=r"tables='[0-9a-f]{64}' but the table needs tables='[0-9a-f]{64}'"):
        open_row_file(other, 1)
