"""The row-range shard format of training checkpoints whose Engram tables are split over processes: one
safetensors file per owner rank, `<checkpoint>/engram-shards/rank-RRRRR.safetensors`, holding rows
[lo, hi) of every table and of its per-row optimizer state, and a header (`ShardHeader`, in the file's
metadata) saying which run, step, world size, rank, Engram layout and table optimizer it belongs to,
each table's name, shape and row range, a CRC32 of every tensor and a seal over all of that (an
edited header is refused). Used by both `engram train --distributed` and the HF Trainer
(`engram.distributed.EngramShardsCallback`); the reader and writer are `engram.checkpoint.shards`.
Plain data: no torch.distributed, no files opened here. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from engram.storage.integrity import tensor_crc32  # what a shard header records of each tensor

__all__ = [
    "FORMAT",
    "HEADER_KEY",
    "SHARDED_STATE_KEY",
    "SHARDS_FOLDER",
    "ShardHeader",
    "ShardIdentity",
    "TableRange",
    "shard_file",
    "shard_rank",
    "tensor_crc32",
]

SHARDS_FOLDER = "engram-shards"  # inside a checkpoint folder
"""The folder of a checkpoint that holds its row-range shard files (`rank-RRRRR.safetensors`)."""
HEADER_KEY = "engram_row_shard"  # the safetensors metadata entry holding the header (JSON)
FORMAT = 2  # 1: the HF Trainer's files before the two formats became one (not read)
# In an HF optimizer state (EngramOptimizer's table part): the tables' rows are in shard files.
SHARDED_STATE_KEY = "engram_sharded_tables"
"""The key of an HF optimizer state's table part whose rows are in shard files (run, steps, world size)."""
_NAME = re.compile(r"rank-(\d{5})\.safetensors")


def shard_file(rank: int) -> str:
    """The file name (inside SHARDS_FOLDER) of rank `rank`'s rows."""
    return f"rank-{rank:05d}.safetensors"


def shard_rank(name: str) -> int | None:
    """The rank a shard file name stands for (None: not a shard file's name)."""
    m = _NAME.fullmatch(name)
    return None if m is None else int(m.group(1))


@dataclass(frozen=True)
class ShardIdentity:
    """What every shard file of one checkpoint shares: the run that wrote it (a name drawn when the run
    began, kept across its resumes), the step it was written at, the world size, the Engram layout's
    fingerprint (`engram.addressing.layout.layout_fingerprint`) and the table optimizer's class (None:
    no optimizer state)."""

    run: str
    step: int
    world: int
    layout: str
    optimizer: str | None

    def differences(self, other: ShardIdentity) -> list[tuple[str, object, object]]:
        """(field, this value, other's) for each field that differs."""
        return [
            (f, getattr(self, f), getattr(other, f))
            for f in ("run", "step", "world", "layout", "optimizer")
            if getattr(self, f) != getattr(other, f)
        ]


@dataclass(frozen=True)
class TableRange:
    """Rows [lo, hi) of table `name` (num_rows x dim in all) in one file; `index`: the table's parameter
    index in the table optimizer (None: it has none), `fields`: its per-row state tensors."""

    name: str
    num_rows: int
    dim: int
    lo: int
    hi: int
    index: int | None = None
    fields: tuple[str, ...] = ()

    @property
    def weight_key(self) -> str:
        return f"{self.name}.weight"

    def field_key(self, field: str) -> str:
        return f"{self.name}.optimizer.{field}"

    def tensor_keys(self) -> list[str]:
        """The file's tensors of this table: the rows, then each optimizer field."""
        return [self.weight_key, *(self.field_key(f) for f in self.fields)]


@dataclass(frozen=True)
class ShardHeader:
    """One shard file's header: its identity, the rank that wrote it, its tables' ranges and each tensor's
    CRC32 (tensor key -> crc)."""

    identity: ShardIdentity
    rank: int
    tables: tuple[TableRange, ...]
    checksums: dict[str, int]

    def _body(self) -> dict[str, Any]:
        i = self.identity
        return {
            "format": FORMAT,
            "run": i.run,
            "step": i.step,
            "world": i.world,
            "layout": i.layout,
            "optimizer": i.optimizer,
            "rank": self.rank,
            "tables": [
                {
                    "name": t.name,
                    "num_rows": t.num_rows,
                    "dim": t.dim,
                    "lo": t.lo,
                    "hi": t.hi,
                    "index": t.index,
                    "fields": list(t.fields),
                }
                for t in self.tables
            ],
            "crc32": dict(sorted(self.checksums.items())),
        }

    def to_metadata(self) -> dict[str, str]:
        """The safetensors metadata that holds this header (the seal: sha256 of the rest)."""
        body = self._body()
        return {HEADER_KEY: json.dumps({**body, "seal": _seal(body)})}

    @classmethod
    def from_metadata(cls, meta: dict[str, str], where: str) -> ShardHeader:
        """The header in a file's metadata; ValueError naming `where` (the file) for a file without one,
        of another format, or whose header was edited or damaged (the seal does not match)."""
        raw = meta.get(HEADER_KEY)
        if raw is None:
            raise ValueError(
                f"{where}: not an Engram row shard (no {HEADER_KEY!r} metadata); shard files written before "
                "the format had one are not read: resume from a newer checkpoint, or retrain"
            )
        try:
            d = json.loads(raw)
            seal = d.pop("seal")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            raise ValueError(f"{where}: its shard header is not valid JSON with a seal; {_DAMAGED}") from None
        if d.get("format") != FORMAT:
            raise ValueError(
                f"{where}: shard format {d.get('format')!r}, this engram reads format {FORMAT}; the file "
                "was written by another version: resume from a checkpoint this version wrote"
            )
        if seal != _seal(d):
            raise ValueError(
                f"{where}: its shard header does not match its seal (the header was edited or damaged after "
                f"it was written); {_DAMAGED}"
            )
        try:
            identity = ShardIdentity(
                str(d["run"]),
                _int(d["step"]),
                _int(d["world"]),
                str(d["layout"]),
                None if d["optimizer"] is None else str(d["optimizer"]),
            )
            tables = tuple(
                TableRange(
                    str(t["name"]),
                    _int(t["num_rows"]),
                    _int(t["dim"]),
                    _int(t["lo"]),
                    _int(t["hi"]),
                    None if t["index"] is None else _int(t["index"]),
                    tuple(str(f) for f in t["fields"]),
                )
                for t in d["tables"]
            )
            checksums = {str(k): _int(v) for k, v in d["crc32"].items()}
            return cls(identity, _int(d["rank"]), tables, checksums)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: its shard header lacks or mangles {e}; {_DAMAGED}") from None


_DAMAGED = "re-copy the checkpoint's shard files, or resume from another checkpoint"


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{v!r} (not an integer)")
    return v


def _seal(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
