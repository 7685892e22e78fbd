"""Sharded training checkpoints (every Engram table's rows split over one file per owner rank) and
`read_checkpoint`, which reads a run's checkpoint in either format, checked, under the unsharded
format's keys. Plain file logic: no torch.distributed here; files go through
`engram.checkpoint.files`. Design: docs/checkpoint.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram.checkpoint.files import dtype_name, member_file, open_tensors, save_tensors
from engram.checkpoint.integrity import check_finite, scan_table

__all__ = [
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "SHARDS_KEY",
    "TableShards",
    "is_table_key",
    "read_checkpoint",
    "read_table_rows",
    "save_shard",
    "shard_file",
    "tables_of_state",
]

SHARDS_KEY = "table_shards"  # state.json's entry: present only in a sharded checkpoint
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"


def shard_file(rank: int) -> str:
    """The file name of rank `rank`'s table rows."""
    return f"tables-rank-{rank}.safetensors"


@dataclass(frozen=True)
class TableShards:
    """Where one table's rows are: `files` holds (file name, lo, hi), rows [lo, hi) in each, sorted
    by lo. `optimizer_index` is the table's parameter index in the table optimizer (None: it has
    none), `optimizer_fields` its per-row state tensors (empty before the first step)."""

    name: str
    num_rows: int
    dim: int
    files: tuple[tuple[str, int, int], ...]
    optimizer_index: int | None = None
    optimizer_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        files = sorted(((str(f), int(a), int(b)) for f, a, b in self.files), key=lambda e: e[1:])
        object.__setattr__(self, "files", tuple(files))
        object.__setattr__(self, "optimizer_fields", tuple(self.optimizer_fields))

    @property
    def tensors(self) -> dict[str, str]:
        """Shard-file key -> the key the unsharded format gives it (model or optimizer file)."""
        out = {f"{self.name}.weight": f"{self.name}.weight"}
        for f in self.optimizer_fields:
            out[f"{self.name}.optimizer.{f}"] = f"table.{self.optimizer_index}.{f}"
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "optimizer_index": self.optimizer_index,
            "optimizer_fields": list(self.optimizer_fields),
            "files": [{"file": f, "lo": a, "hi": b} for f, a, b in self.files],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableShards:
        """The inverse of `to_json`; ValueError (not KeyError) for an entry of another shape."""
        try:
            files = tuple((e["file"], int(e["lo"]), int(e["hi"])) for e in d["files"])
            fields = tuple(str(f) for f in d.get("optimizer_fields", ()))
            return cls(
                str(d["name"]), int(d["num_rows"]), int(d["dim"]), files, d.get("optimizer_index"), fields
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(
                f"{SHARDS_KEY} entry {str(d)[:200]} is not a table layout ({type(e).__name__}: {e}); the "
                "checkpoint's state.json is damaged: resume from another checkpoint"
            ) from None

    def _file(self, folder: Path, f: str) -> Path:
        """Shard file `f`: a regular file inside `folder` (never "../x", an absolute path or a FIFO)."""
        return member_file(
            folder, f, f"{folder / 'state.json'}: {SHARDS_KEY} of table {self.name!r} names the file"
        )

    def check(self, folder: str | Path, weight_dtype: torch.dtype | None = None) -> None:
        """ValueError unless the files are in `folder`, their ranges cover [0, num_rows) exactly and
        every tensor has (hi - lo) rows and one dtype and row shape across files (reads headers only);
        with `weight_dtype`, the table's rows must be of that dtype (the model's)."""
        folder = Path(folder)
        where = f"checkpoint {folder}, table {self.name!r}"
        at, prev = 0, None
        for f, lo, hi in self.files:
            if lo > at:
                raise ValueError(
                    f"{where}: rows [{at}, {lo}) are in no shard file ({f} starts at row {lo}); the "
                    "checkpoint's state.json does not match its files: resume from another checkpoint"
                )
            if lo < at:
                raise ValueError(
                    f"{where}: rows [{lo}, {min(at, hi)}) are in both {prev} and {f}; the checkpoint's "
                    "state.json does not match its files: resume from another checkpoint"
                )
            if hi <= lo:
                raise ValueError(f"{where}: {f} is listed with the empty row range [{lo}, {hi}); remove it")
            at, prev = hi, f
        if at != self.num_rows:
            raise ValueError(
                f"{where}: the shard files cover rows [0, {at}) of {self.num_rows}; rows [{at}, "
                f"{self.num_rows}) are missing: resume from another checkpoint"
            )
        seen: dict[str, tuple[str, list[int], str]] = {}  # key -> (dtype, row shape, first file)
        for f, lo, hi in self.files:
            try:
                path = self._file(folder, f)
            except FileNotFoundError:
                raise ValueError(
                    f"{where}: shard file {f} (rows [{lo}, {hi})) is missing; copy every "
                    "tables-rank-*.safetensors of the checkpoint into the folder (each owner rank wrote one)"
                ) from None
            fh = open_tensors(path)
            for key in self.tensors:
                if key not in fh:
                    raise ValueError(
                        f"{where}: {f} has no tensor {key!r}; the file belongs to another checkpoint: "
                        "copy this checkpoint's own shard files"
                    )
                e = fh.entry(key)
                shape, dtype = list(e.shape), e.dtype
                if (
                    key.endswith(".weight")
                    and weight_dtype is not None
                    and not _compatible(e.torch_dtype, weight_dtype)
                ):
                    raise ValueError(
                        f"{path}: tensor {key!r} has dtype {dtype}, but the model's table is "
                        f"{dtype_name(weight_dtype)}; the file is damaged or from another run: resume from "
                        "another checkpoint"
                    )
                if not shape or shape[0] != hi - lo or (key.endswith(".weight") and shape[1:] != [self.dim]):
                    want = f"({hi - lo}, {self.dim})" if key.endswith(".weight") else f"({hi - lo}, ...)"
                    raise ValueError(
                        f"{where}: {f} holds {key!r} of shape {tuple(shape)}, expected {want} for rows "
                        f"[{lo}, {hi}); the file belongs to another checkpoint: copy this one's own"
                    )
                first = seen.setdefault(key, (dtype, shape[1:], f))
                if (dtype, shape[1:]) != first[:2]:
                    raise ValueError(
                        f"{where}: {key!r} is {dtype} {shape[1:]} per row in {f} but {first[0]} "
                        f"{first[1]} in {first[2]}; the files come from different runs: copy this "
                        "checkpoint's own shard files"
                    )

    def read_rows(self, folder: str | Path, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of shard tensor `key` (see `tensors`), from the files overlapping them;
        only those rows are read. Assumes `check` passed."""
        if not 0 <= lo <= hi <= self.num_rows:
            raise ValueError(
                f"rows [{lo}, {hi}) of table {self.name!r} are outside its {self.num_rows} rows: "
                "is the model of another config?"
            )
        folder = Path(folder)
        out: torch.Tensor | None = None
        for f, a, b in self.files:
            s, e = max(lo, a), min(hi, b)
            if out is not None and s >= e:
                continue
            fh = open_tensors(self._file(folder, f))
            if out is None:  # dtype and row shape from the first file's header
                entry = fh.entry(key)
                out = torch.empty((hi - lo, *entry.shape[1:]), dtype=entry.torch_dtype)  # (hi - lo, ...)
            if s < e:
                out[s - lo : e - lo] = fh.slice(key)[s - a : e - a]  # only these rows are read
        assert out is not None  # check() made sure there is at least one file
        return out


def tables_of_state(state: dict[str, Any]) -> list[TableShards] | None:
    """The table layout of a checkpoint's state.json (None: the unsharded format)."""
    entries = state.get(SHARDS_KEY)
    if entries is not None and not isinstance(entries, list):
        raise ValueError(
            f"state.json's {SHARDS_KEY} is a {type(entries).__name__}, expected a list of table layouts; "
            "the checkpoint is damaged: resume from another checkpoint"
        )
    return None if entries is None else [TableShards.from_json(d) for d in entries]


def save_shard(
    folder: str | Path, rank: int, tensors: dict[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write rank `rank`'s table rows (keys as `TableShards.tensors` names them) into `folder`
    (`metadata`: e.g. the layout fingerprint)."""
    path = Path(folder) / shard_file(rank)
    save_tensors(path, tensors, metadata)
    return path


def read_table_rows(
    folder: str | Path,
    tables: list[TableShards],
    ranges: dict[str, tuple[int, int]] | None = None,
    *,
    optimizer: bool = True,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors) of the tables, keyed as the unsharded format keys them:
    rows `ranges[name]` = (lo, hi) of each (default: the whole table); `optimizer=False` skips the
    optimizer state. Validates every table's files first (ValueError naming the file and the fix);
    `dtypes` ({model key: dtype}): the dtypes the model expects of the tables' rows."""
    model: dict[str, torch.Tensor] = {}
    opt: dict[str, torch.Tensor] = {}
    for t in tables:
        t.check(folder, None if dtypes is None else dtypes.get(f"{t.name}.weight"))
    for t in tables:
        lo, hi = (0, t.num_rows) if ranges is None else ranges[t.name]
        for key, dest in t.tensors.items():
            if key.endswith(".weight"):
                model[dest] = t.read_rows(folder, key, lo, hi)
            elif optimizer:
                opt[dest] = t.read_rows(folder, key, lo, hi)
    return model, opt


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
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every tensor of checkpoint file `name` (memory-mapped), its dtypes checked against `dtypes` first."""
    f = open_tensors(member_file(folder, name, f"the checkpoint {folder} holds"))
    for key in f:
        want = None if dtypes is None else dtypes.get(key)
        if want is not None and not _compatible(f.entry(key).torch_dtype, want):
            raise ValueError(
                f"{f.path}: tensor {key!r} has dtype {f.entry(key).dtype}, but the model expects "
                f"{dtype_name(want)}; the file is damaged or from another model: resume from another checkpoint"
            )
    return f.path, {key: f.tensor(key) for key in f}


def read_checkpoint(
    folder: str | Path,
    state: dict[str, Any],
    ranges: dict[str, tuple[int, int]] | None = None,
    *,
    optimizer: bool = True,
    dtypes: Mapping[str, torch.dtype] | None = None,
    verify: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors) of a checkpoint folder whose state.json is `state`, in either
    format; a sharded one's tables as `read_table_rows` gives them (ranges: see there).

    `dtypes` ({model key: dtype}, e.g. from the model's state_dict): a model tensor of another kind is
    refused (an I32 where F32 is expected would load, cast, as garbage); float dtypes load into each other. Every float tensor is scanned
    for NaN / Inf, except table tensors (`is_table_key`) over `SCAN_LIMIT_BYTES` without `verify`. Errors
    are ValueErrors naming the file, the tensor and the fix."""
    folder = Path(folder)
    model_path, model = _read_file(folder, MODEL_FILE, dtypes)
    opt_path, opt = _read_file(folder, OPTIMIZER_FILE, None) if optimizer else (folder / OPTIMIZER_FILE, {})
    tables = tables_of_state(state)
    where = {key: model_path for key in model} | {key: opt_path for key in opt}
    if tables is not None:
        rows, opt_rows = read_table_rows(folder, tables, ranges, optimizer=optimizer, dtypes=dtypes)
        shards = folder / "tables-rank-*.safetensors"
        where |= {key: shards for key in [*rows, *opt_rows]}
        model.update(rows)
        opt.update(opt_rows)
    for key, t in [*model.items(), *opt.items()]:
        name = f"{where[key]}: tensor {key!r}"
        if not is_table_key(key) or scan_table(t.numel() * t.element_size(), verify, name):
            check_finite(t, name)
    return model, opt
