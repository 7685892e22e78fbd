"""Row-range shard files (`engram.checkpoint.shard_format`): `write_shard` writes one rank's rows,
`RowShards` reads a checkpoint's set back at any world size, and `read_checkpoint` reads a training
run's checkpoint, whole tables or sharded, under the unsharded format's keys. One reader for
`engram train --distributed` and the HF Trainer's checkpoints.

Every file goes through `engram.checkpoint.files.member_file` (a FIFO, a folder or a symlink out of
the checkpoint is refused before it is opened); its header must belong to the checkpoint (run, step,
world size, layout, table optimizer, tables: the error names the file and both values) and the
ranges of all files must tile each table exactly; the files a reader reads are checked against
their CRC32s and scanned for NaN / Inf, all before any row is handed out. Rows are read by position
(os.preadv, `engram.checkpoint.files`) into fresh tensors or straight into the caller's (a model's
table): no file is mapped, a check holds one block. Plain file logic: no torch.distributed. Design:
docs/checkpoint.md.

One concept past 500 lines: the writer and the reader of one file format, kept together so a
field written is a field checked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engram.checkpoint.files import (
    READ_CHUNK_BYTES,
    TensorEntry,
    TensorFile,
    dtype_name,
    member_file,
    member_folder,
    open_tensors,
    save_tensors,
)
from engram.checkpoint.shard_format import (
    SHARDS_FOLDER,
    ShardHeader,
    ShardIdentity,
    TableRange,
    shard_file,
    shard_rank,
    tensor_crc32,
)
from engram.checkpoint.v41 import LAYOUT_FINGERPRINT_KEY
from engram.storage.integrity import check_finite, scan_table

__all__ = [
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "SHARDS_KEY",
    "RowShards",
    "is_table_key",
    "read_checkpoint",
    "shard_file",
    "shards_of_state",
    "write_shard",
]

SHARDS_KEY = (
    "table_shards"  # state.json's entry ({"run", "world", "optimizer"}): only in a sharded checkpoint
)
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"
_FIX = "copy this checkpoint's own shard files back, or resume from another checkpoint"
_HINTS = {
    "run": "a file copied from another run",
    "step": "a file of another step of the run",
    "world": "a file of a checkpoint written at another world size",
    "layout": "a file of another Engram config (seed, primes or table sizes)",
    "optimizer": "a file of a run with another table optimizer",
}


def write_shard(
    folder: str | os.PathLike[str],
    identity: ShardIdentity,
    rank: int,
    tables: list[TableRange],
    tensors: Mapping[str, torch.Tensor],
) -> Path:
    """Write rank `rank`'s rows into `folder/engram-shards/rank-RRRRR.safetensors`: `tensors` holds each
    table's `TableRange.tensor_keys()`, (hi - lo) rows each; the header records `identity`, the ranges and a
    CRC32 of every tensor. Creates the shards folder (ranks may call it at once)."""
    for t in tables:
        for key in t.tensor_keys():
            if key not in tensors:
                raise ValueError(f"rank {rank}'s shard lacks tensor {key!r} (table {t.name!r} lists it)")
            if tensors[key].dim() == 0 or tensors[key].shape[0] != t.hi - t.lo:
                raise ValueError(
                    f"rank {rank}'s tensor {key!r} has shape {tuple(tensors[key].shape)}, but table {t.name!r}'s "
                    f"rows [{t.lo}, {t.hi}) are {t.hi - t.lo}: only per-row state can be written sharded"
                )
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    header = ShardHeader(identity, rank, tuple(tables), {k: tensor_crc32(v) for k, v in cpu.items()})
    path = Path(folder) / SHARDS_FOLDER / shard_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the layout fingerprint also under the key every other table file uses (engram.checkpoint.v41)
    save_tensors(path, cpu, {**header.to_metadata(), LAYOUT_FINGERPRINT_KEY: identity.layout})
    return path


class RowShards:
    """The shard files of checkpoint `folder`, checked to belong to it: every file's identity equals
    `expect`, its rank is its name's, its tables are `tables` ({name: (num_rows, dim)}; None: the first
    file's) with one dtype and row shape per tensor across files, and each table's ranges tile its rows
    exactly. Reads headers only; ValueError naming the file, what it holds and what was expected.

    Rows are read by position (`TensorFile.read_rows_into` / `iter_rows`): no file is mapped, and a
    check (CRC32, NaN scan) or a cast holds one block of `chunk_bytes` at a time."""

    chunk_bytes = READ_CHUNK_BYTES

    def __init__(
        self,
        folder: str | os.PathLike[str],
        expect: ShardIdentity,
        tables: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.root = self.folder / SHARDS_FOLDER
        self.expect = expect
        self.files: dict[Path, tuple[ShardHeader, TensorFile]] = {}
        for path in self._listed():
            where = str(path)
            f = open_tensors(path)  # safetensors' header checks: a truncated file is refused naming it
            header = ShardHeader.from_metadata(f.metadata, where)
            self._check_identity(path, header)
            self.files[path] = (header, f)
        if not self.files:
            raise ValueError(f"{self.root} holds no shard files (rank-RRRRR.safetensors); {_FIX}")
        self.tables = self._check_tables(tables)
        self._verified: set[tuple[Path, str]] = set()

    def _listed(self) -> list[Path]:
        """The shard files of the folder, each a regular file inside it (member_file)."""
        if not os.path.lexists(self.root):
            raise ValueError(
                f"{self.folder} has no {SHARDS_FOLDER} folder, but the checkpoint's tables are sharded: each "
                f"owner rank writes its rows there; {_FIX}"
            )
        if not os.path.isdir(self.root):
            raise ValueError(f"{self.root} is not a folder; it must hold the shard files: {_FIX}")
        member_folder(self.folder, SHARDS_FOLDER, f"the checkpoint {self.folder} holds")  # no link out
        names = sorted(n for n in os.listdir(self.root) if shard_rank(n) is not None)
        return [member_file(self.root, n, f"the shard folder {self.root} holds") for n in names]

    def _check_identity(self, path: Path, header: ShardHeader) -> None:
        for field, want, got in self.expect.differences(header.identity):
            raise ValueError(
                f"{path} does not belong to this checkpoint: its {field} is {got!r}, the checkpoint's is "
                f"{want!r} ({_HINTS[field]}); {_FIX}"
            )
        rank = shard_rank(path.name)
        if header.rank != rank or not 0 <= header.rank < header.identity.world:
            raise ValueError(
                f"{path} holds the rows of rank {header.rank} (of {header.identity.world}), but its name is "
                f"rank {rank}'s; {_FIX}"
            )

    def _check_tables(self, want: Mapping[str, tuple[int, int]] | None) -> dict[str, TableRange]:
        """{name: the table (lo, hi = 0, num_rows)}, after the per-table checks across files."""
        first = next(iter(self.files))
        if want is None:
            want = {t.name: (t.num_rows, t.dim) for t in self.files[first][0].tables}
        out: dict[str, TableRange] = {}
        spans: dict[str, list[tuple[int, int, Path]]] = {name: [] for name in want}
        seen: dict[str, tuple[str, tuple[int, ...], Path]] = {}  # key -> (dtype, row shape, first file)
        for path, (header, f) in self.files.items():
            names = [t.name for t in header.tables]
            if sorted(names) != sorted(want):
                raise ValueError(
                    f"{path} holds tables {sorted(names)}, this model has {sorted(want)}; the file belongs to "
                    f"another model: {_FIX}"
                )
            for t in header.tables:
                if (t.num_rows, t.dim) != tuple(want[t.name]):
                    raise ValueError(
                        f"{path}: table {t.name!r} is {t.num_rows} x {t.dim} there, {want[t.name][0]} x "
                        f"{want[t.name][1]} in this model; the file belongs to another config: {_FIX}"
                    )
                if not 0 <= t.lo < t.hi <= t.num_rows:
                    raise ValueError(
                        f"{path}: table {t.name!r}'s row range [{t.lo}, {t.hi}) is not inside its "
                        f"{t.num_rows} rows (or empty); {_FIX}"
                    )
                prev = out.setdefault(
                    t.name, TableRange(t.name, t.num_rows, t.dim, 0, t.num_rows, t.index, t.fields)
                )
                if (prev.index, prev.fields) != (t.index, t.fields):
                    raise ValueError(
                        f"{path}: table {t.name!r} has optimizer index {t.index} and state {list(t.fields)}, "
                        f"another file {prev.index} and {list(prev.fields)}; the files come from different "
                        f"runs: {_FIX}"
                    )
                spans[t.name].append((t.lo, t.hi, path))
                for key in t.tensor_keys():
                    seen_key = self._check_tensor(path, f, t, key, seen.get(key))
                    seen.setdefault(key, seen_key)
        for name, ranges in spans.items():
            _check_tiling(name, want[name][0], sorted(ranges), self.root)
        return out

    @staticmethod
    def _check_tensor(
        path: Path, f: TensorFile, t: TableRange, key: str, first: tuple[str, tuple[int, ...], Path] | None
    ) -> tuple[str, tuple[int, ...], Path]:
        if key not in f:
            raise ValueError(
                f"{path}: no tensor {key!r}, which its header lists for table {t.name!r}; {_FIX}"
            )
        e = f.entry(key)
        n = t.hi - t.lo
        if not e.shape or e.shape[0] != n or (key == t.weight_key and e.shape[1:] != (t.dim,)):
            want = f"({n}, {t.dim})" if key == t.weight_key else f"({n}, ...)"
            raise ValueError(
                f"{path}: tensor {key!r} has shape {e.shape}, but the header's row range [{t.lo}, {t.hi}) of "
                f"table {t.name!r} needs {want}; {_FIX}"
            )
        if first is not None and (e.dtype, e.shape[1:]) != first[:2]:
            raise ValueError(
                f"{path}: tensor {key!r} is {e.dtype} {list(e.shape[1:])} per row, but {first[0]} "
                f"{list(first[1])} in {first[2]}; the files come from different runs: {_FIX}"
            )
        return e.dtype, e.shape[1:], path

    def _overlaps(self, name: str, lo: int, hi: int) -> list[tuple[Path, TensorFile, TableRange, int, int]]:
        """(file, its tensors, its range of table `name`, s, e) of each file holding rows [s, e) of [lo, hi)."""
        table = self.tables[name]
        if not 0 <= lo <= hi <= table.num_rows:
            raise ValueError(
                f"rows [{lo}, {hi}) of table {name!r} are outside its {table.num_rows} rows: is the model of "
                "another config?"
            )
        out = []
        for path, (header, f) in self.files.items():
            t = next(t for t in header.tables if t.name == name)
            s, e = max(lo, t.lo), min(hi, t.hi)
            if s < e:
                out.append((path, f, t, s, e))
        return out

    def _check_file(self, path: Path, key: str, t: TableRange, scan: tuple[int, int] | None) -> None:
        """Tensor `key` of file `path` against its header's CRC32 (once per reader), and with `scan` = (s,
        e) its rows [s, e) of the table for NaN / Inf, in one pass of blocks (`TensorFile.iter_rows`: one
        block held). A CRC32 mismatch is reported before a NaN the damage may have made."""
        crc_done = (path, key) in self._verified
        if crc_done and scan is None:
            return
        header, f = self.files[path]
        a, b = (0, t.hi - t.lo)  # the whole tensor for its CRC32, else only the rows scanned
        if crc_done and scan is not None:
            a, b = scan[0] - t.lo, scan[1] - t.lo
        crc, nan = 0, None
        for r0, rows in f.iter_rows(key, a, b, chunk_bytes=self.chunk_bytes):
            if not crc_done:
                crc = tensor_crc32(rows, crc)
            if scan is not None and nan is None:
                s, e = max(scan[0], t.lo + r0), min(scan[1], t.lo + r0 + rows.shape[0])
                if s < e:
                    where = (
                        f"{path}: table {t.name!r}, tensor {key!r}, rows [{s}, {e}) (positions from row {s})"
                    )
                    try:
                        check_finite(rows[s - t.lo - r0 : e - t.lo - r0], where)
                    except ValueError as err:
                        nan = err  # raised once the CRC32 is known good
        if not crc_done:
            want = header.checksums.get(key)
            if crc != want:
                raise ValueError(
                    f"{path}: tensor {key!r} has CRC32 {crc:08x}, its header records "
                    f"{'none' if want is None else f'{want:08x}'}: the file's data was damaged after it was "
                    f"written; {_FIX}"
                )
            self._verified.add((path, key))
        if nan is not None:
            raise nan

    def _entry(self, name: str, key: str, lo: int, hi: int, want: torch.dtype | None) -> TensorEntry:
        """Tensor `key`'s entry (dtype and row shape: alike in every file), its dtype checked to load into
        a model tensor of dtype `want` (None: any)."""
        first = next(iter(self.files.values()))[1].entry(key)
        if want is not None and not _compatible(first.torch_dtype, want):
            raise ValueError(
                f"{self.where(name, lo, hi)}: tensor {key!r} has dtype {first.dtype}, but the model's "
                f"table is {dtype_name(want)}; {_FIX}"
            )
        return first

    def check_rows(self, name: str, key: str, lo: int, hi: int, scan: bool = False) -> None:
        """Check what reading rows [lo, hi) of tensor `key` of table `name` takes: each file holding some
        of them against its CRC32 (the whole tensor, once per reader) and, with `scan`, those rows for NaN /
        Inf (the error names the file and the rows). Memory: one block of rows."""
        for path, _, t, s, e in self._overlaps(name, lo, hi):
            self._check_file(path, key, t, (s, e) if scan else None)

    def read_rows(self, name: str, key: str, lo: int, hi: int, scan: bool = False) -> torch.Tensor:
        """Rows [lo, hi) of tensor `key` of table `name`, in a new tensor of the files' dtype, from the
        files holding them (`check_rows` first), each read by position (os.preadv) straight into it: no
        mapping of a file, no intermediate copy."""
        entry = self._entry(name, key, lo, hi, None)
        out = torch.empty((hi - lo, *entry.shape[1:]), dtype=entry.torch_dtype)  # (hi - lo, ...)
        self.read_into(name, key, lo, hi, out, scan)  # the files' dtype, on the host: read straight in
        return out

    def read_into(self, name: str, key: str, lo: int, hi: int, out: torch.Tensor, scan: bool = False) -> None:
        """Rows [lo, hi) of tensor `key` of table `name` into the caller's `out` (hi - lo, *row shape), e.g.
        a model's table weight, after `check_rows`: by position straight into `out` when it is a contiguous
        CPU tensor of the files' dtype; else block by block (cast, or copied to its device), one block held.
        A float loads into any float (`_compatible`); nothing is written before the checks pass."""
        entry = self._entry(name, key, lo, hi, out.dtype)
        want = (hi - lo, *entry.shape[1:])
        if tuple(out.shape) != want:
            raise ValueError(
                f"rows [{lo}, {hi}) of {self.where(name, lo, hi)}'s tensor {key!r} are {list(want)}, the "
                f"destination {list(out.shape)}: is the model of another config?"
            )
        self.check_rows(name, key, lo, hi, scan)
        out = out.detach()
        direct = out.dtype == entry.torch_dtype and out.device.type == "cpu" and out.is_contiguous()
        for _, f, t, s, e in self._overlaps(name, lo, hi):
            if direct:
                f.read_rows_into(key, s - t.lo, e - t.lo, out[s - lo : e - lo])
                continue
            for r0, rows in f.iter_rows(key, s - t.lo, e - t.lo, chunk_bytes=self.chunk_bytes):
                at = t.lo + r0 - lo
                out[at : at + rows.shape[0]].copy_(rows)  # casts; to the device (one block)

    def where(self, name: str, lo: int, hi: int) -> str:
        """The files holding rows [lo, hi) of table `name`, for messages."""
        found = []
        for path, (header, _) in self.files.items():
            t = next(t for t in header.tables if t.name == name)
            if max(lo, t.lo) < min(hi, t.hi):
                found.append(path.name)
        return f"{self.root}/{'{' + ','.join(found) + '}' if len(found) > 1 else ''.join(found)}"

    def _fields(
        self, ranges: Mapping[str, tuple[int, int]] | None, optimizer: bool
    ) -> list[tuple[str, str, str, int, int]]:
        """(table, field, tensor key, lo, hi) of everything `read` reads."""
        out = []
        for name, t in self.tables.items():
            lo, hi = (0, t.num_rows) if ranges is None else ranges[name]
            keys = {"weight": t.weight_key, **({f: t.field_key(f) for f in t.fields} if optimizer else {})}
            out += [(name, field, key, lo, hi) for field, key in keys.items()]
        return out

    def check(
        self,
        ranges: Mapping[str, tuple[int, int]] | None = None,
        *,
        optimizer: bool = True,
        dtypes: Mapping[str, torch.dtype] | None = None,
        verify: bool = False,
    ) -> None:
        """Every check `read` makes, reading nothing into memory but one block of rows at a time: dtypes
        (`dtypes`: {table: the model's dtype of its rows}), each file's CRC32s, the rows' NaN / Inf scan
        (a table over `SCAN_LIMIT_BYTES` only with `verify`). A caller that then reads (`read_rows`,
        `read_into`) changes nothing before every file it reads has passed."""
        for name, field, key, lo, hi in self._fields(ranges, optimizer):
            want = None if dtypes is None or field != "weight" else dtypes.get(name)
            entry = self._entry(name, key, lo, hi, want)
            size = self.tables[name].num_rows * math.prod(entry.shape[1:]) * entry.torch_dtype.itemsize
            scan = scan_table(size, verify, f"{self.root}: table {name!r}, tensor {key!r}")
            self.check_rows(name, key, lo, hi, scan)

    def read(
        self,
        ranges: Mapping[str, tuple[int, int]] | None = None,
        *,
        optimizer: bool = True,
        dtypes: Mapping[str, torch.dtype] | None = None,
        verify: bool = False,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """{table: {"weight": rows, field: rows ...}}: rows `ranges[name]` = (lo, hi) of each table (default:
        all); `optimizer=False` skips the optimizer state. `dtypes` ({table: dtype}): the model's dtype of
        each table's rows (any float loads into a float; else the same dtype); the rows keep the files'
        dtype. Everything is checked first (`check`), then each tensor read (`read_rows`)."""
        self.check(ranges, optimizer=optimizer, dtypes=dtypes, verify=verify)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, field, key, lo, hi in self._fields(ranges, optimizer):
            out.setdefault(name, {})[field] = self.read_rows(name, key, lo, hi)
        return out


def _check_tiling(name: str, num_rows: int, ranges: list[tuple[int, int, Path]], root: Path) -> None:
    """ValueError unless the sorted ranges cover [0, num_rows) exactly, naming the files and ranges."""
    at, prev = 0, None
    for lo, hi, path in ranges:
        if lo > at:
            raise ValueError(
                f"rows [{at}, {lo}) of table {name!r} are in no shard file of {root} (files: "
                f"{', '.join(p.name for _, _, p in ranges)}): a rank's file is missing; {_FIX}"
            )
        if lo < at:
            assert prev is not None
            raise ValueError(
                f"{path} claims rows [{lo}, {hi}) of table {name!r}, but rows [{lo}, {min(at, hi)}) are also in "
                f"{prev[2]} (rows [{prev[0]}, {prev[1]})): the files come from different checkpoints; {_FIX}"
            )
        at, prev = hi, (lo, hi, path)
    if at != num_rows:
        raise ValueError(
            f"rows [{at}, {num_rows}) of table {name!r} are in no shard file of {root} (files: "
            f"{', '.join(p.name for _, _, p in ranges)}): a rank's file is missing; {_FIX}"
        )


def shards_of_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """The sharded-tables entry of a training checkpoint's state.json ({"run", "world", "optimizer"};
    None: whole tables). ValueError for an entry of another shape."""
    entry = state.get(SHARDS_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not {"run", "world", "optimizer"} <= set(entry):
        raise ValueError(
            f"state.json's {SHARDS_KEY} is {str(entry)[:200]}, expected {{'run', 'world', 'optimizer'}} (a "
            "checkpoint written before the row-range shard format is not read); the checkpoint is damaged "
            "or older: resume from another checkpoint"
        )
    return entry


def _compatible(stored: torch.dtype, want: torch.dtype) -> bool:
    """Whether a stored tensor may load into a model tensor of dtype `want`: any float into a float (a
    float64 run evaluated in float32 is a cast), otherwise only the same dtype (an I32 read as F32 is
    garbage: the same bytes, other numbers)."""
    return stored == want or (stored.is_floating_point and want.is_floating_point)


def is_table_key(key: str) -> bool:
    """Whether a checkpoint tensor is (a part of) a table: the weight of a module named `table`, or the
    table optimizer's state (`table.{index}.{field}`). Only these may skip the NaN scan (see `read_checkpoint`)."""
    return key.endswith(".table.weight") or key.startswith("table.")


def _read_file(
    folder: Path, name: str, dtypes: Mapping[str, torch.dtype] | None
) -> tuple[TensorFile, dict[str, torch.Tensor]]:
    """Every tensor of checkpoint file `name` (memory-mapped), its dtypes checked against `dtypes` first."""
    f = open_tensors(member_file(folder, name, f"the checkpoint {folder} holds"))
    for key in f:
        want = None if dtypes is None else dtypes.get(key)
        if want is not None and not _compatible(f.entry(key).torch_dtype, want):
            raise ValueError(
                f"{f.path}: tensor {key!r} has dtype {f.entry(key).dtype}, but the model expects "
                f"{dtype_name(want)}; the file is damaged or from another model: resume from another checkpoint"
            )
    return f, {key: f.tensor(key) for key in f}


def read_checkpoint(
    folder: str | Path,
    state: dict[str, Any],
    ranges: dict[str, tuple[int, int]] | None = None,
    *,
    optimizer: bool = True,
    dtypes: Mapping[str, torch.dtype] | None = None,
    verify: bool = False,
    tables: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors) of a training checkpoint folder whose state.json is `state`,
    whole tables or sharded; a sharded one's tables as `RowShards.read` gives them (rows `ranges[table]`,
    default all), keyed `{table}.weight` and `table.{index}.{field}` as the unsharded format keys them.
    Its shard files must be this checkpoint's (the run, world size and optimizer of state.json's
    `table_shards`, its step, model.safetensors' layout fingerprint; `tables` {name: (rows, dim)}: the
    model's tables).

    `dtypes` ({model key: dtype}, e.g. from the model's state_dict): a model tensor of another kind is
    refused (an I32 where F32 is expected would load, cast, as garbage); float dtypes load into each
    other. Every float tensor is scanned for NaN / Inf, except table tensors (`is_table_key`) over
    `SCAN_LIMIT_BYTES` without `verify`. Errors are ValueErrors naming the file, the tensor and the fix."""
    folder = Path(folder)
    model_file, model = _read_file(folder, MODEL_FILE, dtypes)
    opt_path, opt = (
        (folder / OPTIMIZER_FILE, _read_file(folder, OPTIMIZER_FILE, None)[1])
        if optimizer
        else (folder / OPTIMIZER_FILE, {})
    )
    for key, t in [*model.items(), *opt.items()]:
        name = f"{model_file.path if key in model else opt_path}: tensor {key!r}"
        if not is_table_key(key) or scan_table(t.numel() * t.element_size(), verify, name):
            check_finite(t, name)
    entry = shards_of_state(state)
    if entry is None:
        return model, opt
    layout = model_file.metadata.get(LAYOUT_FINGERPRINT_KEY)
    if layout is None:
        raise ValueError(
            f"{model_file.path} records no Engram layout fingerprint ({LAYOUT_FINGERPRINT_KEY}), which a "
            "checkpoint with sharded tables always has; the checkpoint is damaged: resume from another one"
        )
    expect = ShardIdentity(str(entry["run"]), state.get("step"), entry["world"], layout, entry["optimizer"])
    shards = RowShards(folder, expect, tables)
    table_dtypes = None if dtypes is None else {n: dtypes.get(f"{n}.weight") for n in shards.tables}
    rows = shards.read(ranges, optimizer=optimizer, dtypes=table_dtypes, verify=verify)
    for name, got in rows.items():
        t = shards.tables[name]
        model[t.weight_key] = got.pop("weight")
        for field, x in got.items():
            opt[f"table.{t.index}.{field}"] = x
    return model, opt
