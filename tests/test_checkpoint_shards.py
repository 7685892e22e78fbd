"""engram.checkpoint.shards: a table's rows split over per-rank files, read back whole or as any row
range, and every malformed layout refused naming the file, the table and the fix. Pure file logic
(no processes); the distributed runs that write these files are in tests/test_distributed.py."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram.checkpoint.shards import (
    SHARDS_KEY,
    TableShards,
    read_checkpoint,
    read_table_rows,
    save_shard,
    shard_file,
    tables_of_state,
)

ROWS, DIM, NAME = 10, 3, "engrams.1.table"


def _full() -> dict[str, torch.Tensor]:
    """A table and its SparseRowAdam state, in the keys a shard file gives them."""
    g = torch.Generator().manual_seed(0)
    return {
        f"{NAME}.weight": torch.randn(ROWS, DIM, generator=g),
        f"{NAME}.optimizer.exp_avg": torch.randn(ROWS, DIM, generator=g, dtype=torch.float64),
        f"{NAME}.optimizer.exp_avg_sq_row": torch.rand(ROWS, generator=g),
        f"{NAME}.optimizer.step": torch.arange(ROWS, dtype=torch.int32),
    }


def _write(folder, bounds: list[int], full: dict[str, torch.Tensor] | None = None) -> TableShards:
    """Shard files of rank r holding rows [bounds[r], bounds[r + 1]) (none for an empty range)."""
    full = _full() if full is None else full
    files = []
    for r, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi > lo:
            save_shard(folder, r, {k: v[lo:hi] for k, v in full.items()})
            files.append((shard_file(r), lo, hi))
    return TableShards(NAME, ROWS, DIM, files, 2, ("exp_avg", "exp_avg_sq_row", "step"))


def _rows(full: dict[str, torch.Tensor], lo: int, hi: int) -> tuple[dict, dict]:
    """What read_table_rows must give for rows [lo, hi): unsharded-format keys."""
    model = {f"{NAME}.weight": full[f"{NAME}.weight"][lo:hi]}
    opt = {
        f"table.2.{f}": full[f"{NAME}.optimizer.{f}"][lo:hi] for f in ("exp_avg", "exp_avg_sq_row", "step")
    }
    return model, opt


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("bounds", [[0, 4, 10], [0, 3, 6, 10], [0, 0, 7, 7, 10]], ids=["2", "3", "gaps"])
def test_read_whole_and_every_range(tmp_path, bounds):
    """Any [lo, hi), within one file or spanning several (and empty), reads back the table's rows."""
    full = _full()
    layout = _write(tmp_path, bounds, full)
    assert [f for f, _, _ in layout.files] == [
        shard_file(r) for r in range(len(bounds) - 1) if bounds[r + 1] > bounds[r]
    ]
    for lo in range(ROWS + 1):
        for hi in range(lo, ROWS + 1):
            model, opt = read_table_rows(tmp_path, [layout], {NAME: (lo, hi)})
            want_model, want_opt = _rows(full, lo, hi)
            _same(model, want_model)
            _same(opt, want_opt)
    model, opt = read_table_rows(tmp_path, [layout])  # default: the whole table
    _same(model, _rows(full, 0, ROWS)[0])
    _same(opt, _rows(full, 0, ROWS)[1])
    model, opt = read_table_rows(tmp_path, [layout], optimizer=False)
    assert opt == {} and model.keys() == {f"{NAME}.weight"}


def test_three_files_read_as_two_ranks(tmp_path):
    """Written by 3 owners, resumed by 2: each reads its half from the files overlapping it."""
    full = _full()
    layout = _write(tmp_path, [0, 3, 6, 10], full)
    halves = [read_table_rows(tmp_path, [layout], {NAME: r})[0][f"{NAME}.weight"] for r in ((0, 5), (5, 10))]
    assert torch.equal(torch.cat(halves), full[f"{NAME}.weight"])


def test_layout_json_round_trip_and_read_checkpoint(tmp_path):
    """state.json's entry round-trips; read_checkpoint merges the shard rows with the other two files,
    and leaves an unsharded checkpoint (no entry) as its files are."""
    full = _full()
    layout = _write(tmp_path, [0, 6, 10], full)
    state = json.loads(json.dumps({SHARDS_KEY: [layout.to_json()]}))
    assert tables_of_state(state) == [layout] and tables_of_state({}) is None
    dense = {"head.weight": torch.ones(2, 2)}
    save_file(dense, str(tmp_path / "model.safetensors"))
    save_file({"dense.0.exp_avg": torch.zeros(2, 2)}, str(tmp_path / "optimizer.safetensors"))
    model, opt = read_checkpoint(tmp_path, state)
    want_model, want_opt = _rows(full, 0, ROWS)
    _same(model, {**dense, **want_model})
    _same(opt, {"dense.0.exp_avg": torch.zeros(2, 2), **want_opt})
    model, opt = read_checkpoint(tmp_path, state, {NAME: (6, 8)}, optimizer=False)
    _same(model, {**dense, f"{NAME}.weight": full[f"{NAME}.weight"][6:8]})
    assert opt == {}
    model, _ = read_checkpoint(tmp_path, {})
    _same(model, dense)
    # each file holds only its rows
    assert load_file(str(tmp_path / shard_file(1)))[f"{NAME}.weight"].shape == (4, DIM)


def _layout(files, fields=("exp_avg", "exp_avg_sq_row", "step")) -> TableShards:
    return TableShards(NAME, ROWS, DIM, files, 2, fields)


def test_missing_file(tmp_path):
    layout = _write(tmp_path, [0, 4, 10])
    (tmp_path / shard_file(1)).unlink()
    with pytest.raises(
        ValueError, match=r"table 'engrams.1.table'.*tables-rank-1.safetensors.*is missing.*copy"
    ):
        read_table_rows(tmp_path, [layout])


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ([(shard_file(0), 0, 4), (shard_file(1), 5, 10)], r"rows \[4, 5\) are in no shard file"),
        (
            [(shard_file(0), 0, 4), (shard_file(1), 3, 10)],
            r"rows \[3, 4\) are in both tables-rank-0.*tables-rank-1",
        ),
        (
            [(shard_file(0), 0, 4), (shard_file(1), 4, 9)],
            r"cover rows \[0, 9\) of 10; rows \[9, 10\) are missing",
        ),
        ([(shard_file(1), 1, 10)], r"rows \[0, 1\) are in no shard file"),
        ([(shard_file(0), 0, 4), (shard_file(1), 4, 4), (shard_file(2), 4, 10)], r"empty row range"),
    ],
    ids=["gap", "overlap", "short", "no-start", "empty"],
)
def test_ranges_must_cover_the_table_exactly(tmp_path, files, match):
    _write(tmp_path, [0, 4, 10])
    with pytest.raises(ValueError, match=match) as e:
        read_table_rows(tmp_path, [_layout(files)])
    msg = str(e.value)
    assert "table 'engrams.1.table'" in msg and ("another checkpoint" in msg or "remove" in msg)


def test_wrong_shape_dtype_or_tensor(tmp_path):
    full = _full()
    layout = _write(tmp_path, [0, 4, 10], full)
    # a file whose row count disagrees with its range
    save_shard(tmp_path, 1, {k: v[4:9] for k, v in full.items()})
    with pytest.raises(
        ValueError,
        match=r"tables-rank-1.safetensors holds 'engrams.1.table.weight' of shape \(5, 3\), expected \(6, 3\)",
    ):
        read_table_rows(tmp_path, [layout])
    # rows of another width
    save_shard(
        tmp_path, 1, {**{k: v[4:] for k, v in full.items()}, f"{NAME}.weight": torch.zeros(6, DIM + 1)}
    )
    with pytest.raises(ValueError, match=r"of shape \(6, 4\), expected \(6, 3\)"):
        read_table_rows(tmp_path, [layout])
    # another dtype than the other file's
    save_shard(
        tmp_path, 1, {**{k: v[4:] for k, v in full.items()}, f"{NAME}.weight": torch.zeros(6, DIM).double()}
    )
    with pytest.raises(
        ValueError,
        match=r"'engrams.1.table.weight' is F64 \[3\] per row in tables-rank-1.*F32 \[3\] in tables-rank-0",
    ):
        read_table_rows(tmp_path, [layout])
    # an optimizer state of another row shape
    bad = {
        **{k: v[4:] for k, v in full.items()},
        f"{NAME}.optimizer.step": torch.zeros(6, 2, dtype=torch.int32),
    }
    save_shard(tmp_path, 1, bad)
    with pytest.raises(ValueError, match=r"'engrams.1.table.optimizer.step' is I32 \[2\] per row"):
        read_table_rows(tmp_path, [layout])
    # a tensor the layout names is not in the file
    save_shard(tmp_path, 1, {f"{NAME}.weight": full[f"{NAME}.weight"][4:]})
    with pytest.raises(
        ValueError, match=r"tables-rank-1.safetensors has no tensor 'engrams.1.table.optimizer.exp_avg'"
    ):
        read_table_rows(tmp_path, [layout])
    assert read_table_rows(tmp_path, [_layout(layout.files, ())])[0][f"{NAME}.weight"].shape == (ROWS, DIM)


def test_damaged_shard_file(tmp_path):
    """A truncated or foreign shard file is refused naming it (safetensors' own error never surfaces)."""
    layout = _write(tmp_path, [0, 4, 10])
    path = tmp_path / shard_file(1)
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(
        ValueError, match=r"tables-rank-1\.safetensors: not a readable safetensors file .*truncated"
    ):
        read_table_rows(tmp_path, [layout])
    path.write_text("not tensors")
    with pytest.raises(
        ValueError, match=r"tables-rank-1\.safetensors: not a readable .*re-copy or re-convert it"
    ):
        read_table_rows(tmp_path, [layout])


def test_range_outside_the_table(tmp_path):
    layout = _write(tmp_path, [0, 4, 10])
    with pytest.raises(
        ValueError, match=r"rows \[8, 11\) of table 'engrams.1.table' are outside its 10 rows"
    ):
        read_table_rows(tmp_path, [layout], {NAME: (8, 11)})


def _sharded_checkpoint(folder, full=None) -> dict:
    """A whole sharded checkpoint folder (the table's rows in two files); its state.json entries."""
    layout = _write(folder, [0, 6, 10], full)
    save_file({"head.weight": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    save_file({"dense.0.exp_avg": torch.zeros(2, 2)}, str(folder / "optimizer.safetensors"))
    return json.loads(json.dumps({SHARDS_KEY: [layout.to_json()]}))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs", "link", "fifo"])
def test_shard_names_outside_the_folder_or_not_files_are_refused(tmp_path, name, mkfifo):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = _sharded_checkpoint(ckpt)
    (tmp_path / "outside.safetensors").write_bytes((ckpt / shard_file(1)).read_bytes())
    if name == "/abs":
        name = str(tmp_path / "outside.safetensors")
    elif name == "link":
        (ckpt / "link").symlink_to(tmp_path / "outside.safetensors")
    elif name == "fifo":
        mkfifo(ckpt / "fifo")
    (ckpt / shard_file(1)).unlink()
    state[SHARDS_KEY][0]["files"][1]["file"] = name
    with pytest.raises(ValueError) as e:
        read_checkpoint(ckpt, state)
    msg = str(e.value)
    assert f"state.json: table_shards of table {NAME!r} names the file {name!r}" in msg
    why = {"link": "a symlink to", "fifo": "a named pipe (FIFO)"}.get(name, "not a plain file name")
    assert why in msg


def test_damaged_state_entry_is_a_value_error(tmp_path):
    state = _sharded_checkpoint(tmp_path)
    del state[SHARDS_KEY][0]["files"][0]["lo"]
    with pytest.raises(ValueError, match=r"table_shards entry .* is not a table layout \(KeyError"):
        read_checkpoint(tmp_path, state)
    with pytest.raises(ValueError, match="table_shards is a dict, expected a list"):
        read_checkpoint(tmp_path, {SHARDS_KEY: {}})


def test_dtypes_the_model_expects_and_nan_are_checked(tmp_path, monkeypatch):
    from engram.checkpoint import integrity

    state = _sharded_checkpoint(tmp_path)
    dtypes = {"head.weight": torch.float32, f"{NAME}.weight": torch.float32}
    read_checkpoint(tmp_path, state, dtypes=dtypes)
    # the same bytes under another dtype name: an I32 where the model has F32
    save_file({"head.weight": torch.ones(2, 2).view(torch.int32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"model.safetensors: tensor 'head.weight' has dtype I32, but the model expects F32"
    ):
        read_checkpoint(tmp_path, state, dtypes=dtypes)
    full = _full()
    full[f"{NAME}.weight"] = full[f"{NAME}.weight"].view(torch.int32)
    _sharded_checkpoint(tmp_path, full)
    with pytest.raises(
        ValueError, match=r"tables-rank-0.safetensors: tensor 'engrams.1.table.weight' has dtype I32"
    ):
        read_checkpoint(tmp_path, state, dtypes=dtypes)
    # NaN: in a dense tensor always, in a table's rows up to the scan limit (then only with verify)
    full = _full()
    full[f"{NAME}.weight"][7, 1] = float("nan")
    _sharded_checkpoint(tmp_path, full)
    with pytest.raises(ValueError, match=r"tensor 'engrams.1.table.weight': 1 of its 30 values are NaN"):
        read_checkpoint(tmp_path, state, dtypes=dtypes)
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 16)
    with pytest.warns(integrity.UnscannedTableWarning):
        read_checkpoint(tmp_path, state, dtypes=dtypes)
    with pytest.raises(ValueError, match="NaN"):
        read_checkpoint(tmp_path, state, dtypes=dtypes, verify=True)
    save_file({"head.weight": torch.full((2, 2), float("inf"))}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'head.weight': 4 of its 4 values"):
        read_checkpoint(tmp_path, state, dtypes=dtypes)  # dense: scanned whatever its size
