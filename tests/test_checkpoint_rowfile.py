"""`engram convert --row-file`: row files written beside a V4.1 checkpoint, checked against it when opened."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engram.checkpoint.convert import (
    make_scaled_v41_checkpoint,
    open_row_file,
    row_file_identity,
    row_file_path,
)
from engram.checkpoint.v41 import load_engram_modules
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
        assert f.header.identity == row_file_identity(config, layer_id) and f.header.label == config.name
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
    assert code == 2 and "Traceback" not in err and "--row-file needs --to fp8" in err
