"""engram.checkpoint.shards: the row-range shard files (engram.checkpoint.shard_format) read back whole or
as any row range at any world size, and every file that does not belong to the checkpoint, or is
damaged, refused naming the file and both values. Pure file logic (no processes); the runs that write
these files are in tests/test_distributed.py and tests/test_distributed_hf_trainer.py."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engram.checkpoint.files import save_tensors
from engram.checkpoint.shard_format import (
    HEADER_KEY,
    SHARDS_FOLDER,
    ShardHeader,
    ShardIdentity,
    TableRange,
    shard_file,
    tensor_crc32,
)
from engram.checkpoint.shards import SHARDS_KEY, RowShards, read_checkpoint, shards_of_state, write_shard
from engram.checkpoint.v41 import LAYOUT_FINGERPRINT_KEY

ROWS, DIM, NAME = 10, 3, "engrams.1.table"
FIELDS = ("exp_avg", "exp_avg_sq_row", "step")
ID = ShardIdentity("run-a", 6, 2, "f" * 64, "SparseRowAdam")


def _full() -> dict[str, torch.Tensor]:
    """A table and its SparseRowAdam state, in the keys a shard file gives them."""
    g = torch.Generator().manual_seed(0)
    return {
        f"{NAME}.weight": torch.randn(ROWS, DIM, generator=g),
        f"{NAME}.optimizer.exp_avg": torch.randn(ROWS, DIM, generator=g, dtype=torch.float64),
        f"{NAME}.optimizer.exp_avg_sq_row": torch.rand(ROWS, generator=g),
        f"{NAME}.optimizer.step": torch.arange(ROWS, dtype=torch.int32),
    }


def _write(folder, bounds: list[int], full=None, identity: ShardIdentity | None = None) -> None:
    """Shard files of rank r holding rows [bounds[r], bounds[r + 1]) (none for an empty range)."""
    full = _full() if full is None else full
    identity = (
        ShardIdentity(ID.run, ID.step, len(bounds) - 1, ID.layout, ID.optimizer)
        if identity is None
        else identity
    )
    for r, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi > lo:
            t = TableRange(NAME, ROWS, DIM, lo, hi, 2, FIELDS)
            write_shard(folder, identity, r, [t], {k: v[lo:hi] for k, v in full.items()})


def _expect(world: int = 2, **changes) -> ShardIdentity:
    return ShardIdentity(**{**vars(ID), "world": world, **changes})


def _file(folder, rank: int):
    return folder / SHARDS_FOLDER / shard_file(rank)


def _forge(path, identity: ShardIdentity, rank: int, tables: list[TableRange], tensors: dict) -> None:
    """A shard file with any header (validly sealed): what write_shard would refuse to write."""
    crc = {k: tensor_crc32(v) for k, v in tensors.items()}
    save_tensors(path, tensors, ShardHeader(identity, rank, tuple(tables), crc).to_metadata())


@pytest.mark.parametrize("bounds", [[0, 4, 10], [0, 3, 6, 10], [0, 0, 7, 7, 10]], ids=["2", "3", "gaps"])
def test_read_whole_and_every_range(tmp_path, bounds):
    """Any [lo, hi), within one file or spanning several (and empty), reads back the table's rows."""
    full = _full()
    _write(tmp_path, bounds, full)
    shards = RowShards(tmp_path, _expect(len(bounds) - 1))
    for lo in range(ROWS + 1):
        for hi in range(lo, ROWS + 1):
            got = shards.read({NAME: (lo, hi)})[NAME]
            assert got.keys() == {"weight", *FIELDS}
            for field, key in [("weight", f"{NAME}.weight"), *((f, f"{NAME}.optimizer.{f}") for f in FIELDS)]:
                assert got[field].dtype == full[key].dtype and torch.equal(got[field], full[key][lo:hi])
    assert shards.read(optimizer=False)[NAME].keys() == {"weight"}
    assert shards.tables[NAME] == TableRange(NAME, ROWS, DIM, 0, ROWS, 2, FIELDS)


def test_checkpoint_round_trip(tmp_path):
    """read_checkpoint merges the shard rows with the model and optimizer files under the unsharded keys
    (table.{index}.{field}); a checkpoint without the state.json entry is read as its files are."""
    full = _full()
    _write(tmp_path, [0, 6, 10], full)
    dense = {"head.weight": torch.ones(2, 2)}
    save_tensors(tmp_path / "model.safetensors", dense, {LAYOUT_FINGERPRINT_KEY: ID.layout})
    save_file({"dense.0.exp_avg": torch.zeros(2, 2)}, str(tmp_path / "optimizer.safetensors"))
    state = {"step": ID.step, SHARDS_KEY: {"run": ID.run, "world": 2, "optimizer": ID.optimizer}}
    assert shards_of_state(state) == state[SHARDS_KEY] and shards_of_state({}) is None
    model, opt = read_checkpoint(tmp_path, state, tables={NAME: (ROWS, DIM)})
    assert torch.equal(model[f"{NAME}.weight"], full[f"{NAME}.weight"]) and "head.weight" in model
    assert {k for k in opt if k.startswith("table.")} == {f"table.2.{f}" for f in FIELDS}
    model, opt = read_checkpoint(tmp_path, state, {NAME: (6, 8)}, optimizer=False)
    assert torch.equal(model[f"{NAME}.weight"], full[f"{NAME}.weight"][6:8]) and opt == {}
    assert read_checkpoint(tmp_path, {"step": 6})[0].keys() == {"head.weight"}
    # another run's state.json entry: the files are refused naming both runs
    with pytest.raises(ValueError, match=r"its run is 'run-a', the checkpoint's is 'run-b'"):
        read_checkpoint(tmp_path, {**state, SHARDS_KEY: {**state[SHARDS_KEY], "run": "run-b"}})
    with pytest.raises(ValueError, match=r"table_shards is \[\].*not read"):  # the old format's list
        read_checkpoint(tmp_path, {**state, SHARDS_KEY: []})


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("run", "run-b", "a file copied from another run"),
        ("step", 3, "a file of another step"),
        ("world", 3, "another world size"),
        ("layout", "0" * 64, "another Engram config"),
        ("optimizer", "SparseSinkhorn", "another table optimizer"),
    ],
)
def test_a_file_of_another_checkpoint_is_refused(tmp_path, field, value, why):
    """Item 1: rank 1's file from another run at the same step (or another step, world size, layout,
    optimizer): refused naming the file, the field and both values."""
    _write(tmp_path, [0, 4, 10])
    other = tmp_path / "other"
    _write(other, [0, 4, 10], identity=_expect(**{field: value}))
    shutil.copy(_file(other, 1), _file(tmp_path, 1))
    with pytest.raises(ValueError) as e:
        RowShards(tmp_path, _expect())
    msg = str(e.value)
    assert str(_file(tmp_path, 1)) in msg and why in msg
    assert f"its {field} is {value!r}, the checkpoint's is {getattr(_expect(), field)!r}" in msg


def test_edited_header_and_flipped_data_byte_are_caught(tmp_path):
    """A later step's file with its step edited to the checkpoint's fails its seal; a flipped data byte
    fails its tensor's CRC32 (recorded in the header) when the rows are read."""
    _write(tmp_path, [0, 4, 10])
    later = tmp_path / "later"
    _write(later, [0, 4, 10], identity=_expect(step=9))
    path = _file(tmp_path, 1)
    raw = _file(later, 1).read_bytes()
    edited = raw.replace(b'\\"step\\": 9', b'\\"step\\": 6')
    assert len(edited) == len(raw) and edited != raw
    path.write_bytes(edited)
    with pytest.raises(ValueError, match=r"rank-00001.safetensors: its shard header does not match its seal"):
        RowShards(tmp_path, _expect())
    _write(tmp_path, [0, 4, 10])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # in the last tensor's data
    path.write_bytes(bytes(raw))
    shards = RowShards(tmp_path, _expect())  # the headers are intact
    shards.read({NAME: (0, 4)})  # rank 0's rows only: rank 1's file is not read
    with pytest.raises(
        ValueError, match=r"rank-00001.safetensors: tensor .* has CRC32 [0-9a-f]{8}, its header records"
    ):
        shards.read({NAME: (3, 5)})


def test_truncated_or_foreign_file_names_it(tmp_path):
    """Item 3: a truncated file, a flipped header byte, a file that is not a shard: a ValueError naming it."""
    _write(tmp_path, [0, 4, 10])
    path = _file(tmp_path, 1)
    good = path.read_bytes()
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(
        ValueError, match=r"rank-00001\.safetensors: not a readable safetensors file .*truncated"
    ):
        RowShards(tmp_path, _expect())
    path.write_bytes(good[:7] + bytes([good[7] ^ 0x40]) + good[8:])  # the header length's top byte
    with pytest.raises(ValueError, match=r"rank-00001\.safetensors: not a readable safetensors file"):
        RowShards(tmp_path, _expect())
    n = int.from_bytes(good[:8], "little")
    at = good.index(b"F32")  # a dtype in the header JSON: flipped to another valid one
    assert at < 8 + n
    path.write_bytes(good[:at] + b"I32" + good[at + 3 :])
    with pytest.raises(ValueError, match=r"rank-00001\.safetensors"):
        RowShards(tmp_path, _expect())
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(
        ValueError, match=rf"rank-00001\.safetensors: not an Engram row shard \(no '{HEADER_KEY}'"
    ):
        RowShards(tmp_path, _expect())


def test_ranges_must_tile_the_table(tmp_path):
    """Item 3: a missing file, and a file whose (sealed) range claims every row: ValueErrors naming the
    file and the range, never a torch size mismatch."""
    full = _full()
    _write(tmp_path, [0, 4, 10], full)
    os.remove(_file(tmp_path, 1))
    with pytest.raises(
        ValueError,
        match=r"rows \[4, 10\) of table 'engrams.1.table' are in no shard file .*a rank's file is missing",
    ):
        RowShards(tmp_path, _expect())
    # rank 1's file claiming every row, its tensors as large
    _forge(_file(tmp_path, 1), _expect(), 1, [TableRange(NAME, ROWS, DIM, 0, ROWS, 2, FIELDS)], full)
    with pytest.raises(
        ValueError,
        match=r"rank-00001.safetensors claims rows \[0, 10\) of table 'engrams.1.table', but rows \[0, 4\) are also in .*rank-00000",
    ):
        RowShards(tmp_path, _expect())
    # ... or claiming every row with only its own 6 rows of tensors
    part = {k: v[4:] for k, v in full.items()}
    _forge(_file(tmp_path, 1), _expect(), 1, [TableRange(NAME, ROWS, DIM, 0, ROWS, 2, FIELDS)], part)
    with pytest.raises(
        ValueError,
        match=r"rank-00001.safetensors: tensor 'engrams.1.table.weight' has shape \(6, 3\), but the header's row range \[0, 10\)",
    ):
        RowShards(tmp_path, _expect())
    _forge(_file(tmp_path, 1), _expect(), 1, [TableRange(NAME, ROWS, DIM, 4, 11, 2, FIELDS)], part)
    with pytest.raises(ValueError, match=r"row range \[4, 11\) is not inside its 10 rows"):
        RowShards(tmp_path, _expect())
    _forge(_file(tmp_path, 0), _expect(), 1, [TableRange(NAME, ROWS, DIM, 0, 4, 2, FIELDS)], part)
    with pytest.raises(
        ValueError,
        match=r"rank-00000.safetensors holds the rows of rank 1 \(of 2\), but its name is rank 0's",
    ):
        RowShards(tmp_path, _expect())


def test_tables_of_another_model_and_mixed_files(tmp_path):
    full = _full()
    _write(tmp_path, [0, 4, 10], full)
    with pytest.raises(
        ValueError, match=r"rank-00000.safetensors: table 'engrams.1.table' is 10 x 3 there, 12 x 3"
    ):
        RowShards(tmp_path, _expect(), {NAME: (12, DIM)})
    with pytest.raises(
        ValueError, match=r"holds tables \['engrams.1.table'\], this model has \['engrams.0.table'"
    ):
        RowShards(tmp_path, _expect(), {"engrams.0.table": (ROWS, DIM), NAME: (ROWS, DIM)})
    # rank 1's rows in another dtype than rank 0's
    mixed = {**{k: v[4:] for k, v in full.items()}, f"{NAME}.weight": full[f"{NAME}.weight"][4:].double()}
    _forge(_file(tmp_path, 1), _expect(), 1, [TableRange(NAME, ROWS, DIM, 4, 10, 2, FIELDS)], mixed)
    with pytest.raises(
        ValueError,
        match=r"rank-00001.safetensors: tensor 'engrams.1.table.weight' is F64 \[3\] per row, but F32 \[3\] in .*rank-00000",
    ):
        RowShards(tmp_path, _expect())
    # an I32 table where the model's is F32: refused (a float loads into a float)
    _write(tmp_path, [0, 4, 10], {**full, f"{NAME}.weight": full[f"{NAME}.weight"].view(torch.int32)})
    with pytest.raises(
        ValueError, match=r"tensor 'engrams.1.table.weight' has dtype I32, but the model's table is F32"
    ):
        RowShards(tmp_path, _expect()).read(dtypes={NAME: torch.float32})


@pytest.mark.parametrize("kind", ["fifo", "link-out", "link-in", "folder"])
def test_fifo_symlink_and_folder_rank_files(tmp_path, kind, mkfifo):
    """Item 2: a rank file that is a FIFO is refused without opening it (never hangs: the mkfifo fixture
    unblocks a reader after 20 s and fails the test), a symlink out of
    the checkpoint's shard folder is refused (one inside it is read), a folder in a rank file's place is refused."""
    ckpt = tmp_path / "ckpt"
    _write(ckpt, [0, 4, 10])
    path = _file(ckpt, 1)
    outside = tmp_path / "outside.safetensors"
    shutil.move(path, outside)
    if kind == "fifo":
        mkfifo(path)
    elif kind == "link-out":
        path.symlink_to(outside)
    elif kind == "link-in":
        shutil.copy(outside, path.parent / "copy.safetensors")  # not a shard's name: only read via the link
        path.symlink_to("copy.safetensors")
    else:
        path.mkdir()
    if kind == "link-in":
        assert RowShards(ckpt, _expect()).read()[NAME]["weight"].shape == (ROWS, DIM)
        return
    with pytest.raises(ValueError) as e:
        RowShards(ckpt, _expect())
    msg = str(e.value)
    assert "rank-00001.safetensors" in msg
    why = {"fifo": "a named pipe (FIFO)", "link-out": "a symlink to", "folder": "a folder"}[kind]
    assert why in msg


def test_shards_folder_missing_empty_or_linked_out(tmp_path):
    with pytest.raises(
        ValueError, match=r"has no engram-shards folder, but the checkpoint's tables are sharded"
    ):
        RowShards(tmp_path, _expect())
    (tmp_path / SHARDS_FOLDER).mkdir()
    with pytest.raises(ValueError, match=r"engram-shards holds no shard files"):
        RowShards(tmp_path, _expect())
    (tmp_path / SHARDS_FOLDER).rmdir()
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    _write(elsewhere, [0, 4, 10])
    (tmp_path / SHARDS_FOLDER).symlink_to(elsewhere / SHARDS_FOLDER)
    with pytest.raises(ValueError, match=r"'engram-shards', a symlink to .*outside the checkpoint folder"):
        RowShards(tmp_path, _expect())


def test_nan_rows_are_refused_naming_file_and_table(tmp_path, monkeypatch):
    """Item 3: NaN rows written into a file (its CRC32s valid) are refused when read, naming the file
    and the table; a table over the scan limit only with verify (as row files are scanned)."""
    from engram.storage import integrity

    full = _full()
    full[f"{NAME}.weight"][7, 1] = float("nan")
    _write(tmp_path, [0, 4, 10], full)
    shards = RowShards(tmp_path, _expect())
    shards.read({NAME: (0, 4)})
    with pytest.raises(
        ValueError,
        match=r"rank-00001.safetensors: table 'engrams.1.table', tensor 'engrams.1.table.weight', rows \[4, 10\) "
        r"\(positions from row 4\): 1 of its 18 values are NaN or Inf \(the first, nan, at row 3, column 1\)",
    ):
        shards.read()
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 16)
    with pytest.warns(integrity.UnscannedTableWarning):
        RowShards(tmp_path, _expect()).read()
    with pytest.raises(ValueError, match="NaN"):
        RowShards(tmp_path, _expect()).read(verify=True)


def test_header_json_is_what_the_docs_say(tmp_path):
    """The header's fields (docs/checkpoint.md), and write_shard's own refusals."""
    _write(tmp_path, [0, 4, 10])
    from safetensors import safe_open

    with safe_open(str(_file(tmp_path, 1)), "pt") as f:
        meta = f.metadata()
    header = json.loads(meta[HEADER_KEY])
    assert sorted(header) == sorted(
        ["format", "run", "step", "world", "layout", "optimizer", "rank", "tables", "crc32", "seal"]
    )
    assert header["tables"] == [
        {"name": NAME, "num_rows": ROWS, "dim": DIM, "lo": 4, "hi": 10, "index": 2, "fields": list(FIELDS)}
    ]
    assert meta[LAYOUT_FINGERPRINT_KEY] == ID.layout
    t = TableRange(NAME, ROWS, DIM, 4, 10, 2, FIELDS)
    with pytest.raises(ValueError, match=r"lacks tensor 'engrams\.1\.table\.optimizer\.exp_avg'"):
        write_shard(tmp_path, ID, 1, [t], {f"{NAME}.weight": torch.zeros(6, DIM)})
    with pytest.raises(ValueError, match="only per-row state can be written sharded"):
        write_shard(
            tmp_path, ID, 1, [TableRange(NAME, ROWS, DIM, 4, 10)], {f"{NAME}.weight": torch.zeros(5, DIM)}
        )
