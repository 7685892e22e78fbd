"""`engram hf-train`'s settings and the checks made before anything heavy is read (the command is
`engram.apps.hf.train`'s `train_folder`).

Holds `TrainMode` and `HFTrainSettings` (one run, validated when built), the defaults taken from the
model (Engram's layers from its depth, table rows from its size, row width from its hidden size), the
table memory estimated before any allocation, and the output side's checks: OUT new or empty, and the
partial folder a run writes before OUT exists. Knows nothing of the Trainer or of models.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engram.apps.hf.corpus import HELD_OUT, SEQ_LEN_ONE
from engram.apps.hf.folder import EVAL_BLOCKS
from engram.checkpoint.input_files import path_kind
from engram.config import MAX_ENGRAM_DIM, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYER_ID, MAX_LAYER_ROWS, MAX_PRIMES

__all__ = [
    "TABLE_SYNCS",
    "HFTrainSettings",
    "TrainMode",
    "available_memory",
    "check_layers",
    "check_out",
    "check_table_memory",
    "default_head_dim",
    "default_layers",
    "default_table_rows",
    "partial_folder",
    "table_bytes",
]


# engram.distributed.TableSync's values (imported only to run across processes)
TABLE_SYNCS = ("sharded", "replicated")
# n-gram orders of hf-train's Engram: 2 and 3 (engram.apps.hf.train's _ORDERS), for the bounds below
_ORDERS = 2
# LoRA's rank: generous (runs use 8 to 256) but a mistyped one is refused before peft allocates it
MAX_LORA_RANK = 4096


class TrainMode(enum.Enum):
    FROZEN = "frozen"  # the backbone frozen: Engram alone trains
    LORA = "lora"  # LoRA adapters (peft) on the backbone's linear layers, merged into OUT's weights
    FULL = "full"  # every parameter


@dataclass(frozen=True)
class HFTrainSettings:
    """One `engram hf-train` run. `layers` / `table_rows` None: the defaults of the model's depth and size."""

    folder: str
    corpus: str
    out: str
    layers: tuple[int, ...] | None = None
    table_rows: int | None = None
    heads: int = 4
    head_dim: int | None = None  # None: 32 below hidden size 256, else 64
    mode: TrainMode = TrainMode.FROZEN
    lora_rank: int = 8
    engram: bool = True
    steps: int | None = None
    tokens: int | None = None
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-4
    table_lr: float = 1e-2
    seed: int = 0
    checkpoint_every: int = 0
    held_out: float = HELD_OUT
    eval_blocks: int = EVAL_BLOCKS  # the held-out blocks evaluated, from the first (0: all)
    # across processes (--distributed): how the tables stay one table, TABLE_SYNCS (None: row-sharded
    # on more than one process, engram.distributed.prepare_data_parallel's default)
    table_sync: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TrainMode):
            if self.mode not in {m.value for m in TrainMode}:
                raise ValueError(f"mode={self.mode!r}: give one of {[m.value for m in TrainMode]}")
            object.__setattr__(self, "mode", TrainMode(self.mode))
        for name in ("heads", "lora_rank", "batch_size", "seq_len", "steps", "tokens", "table_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a whole number >= 1")
        if self.seq_len == 1:
            raise ValueError(SEQ_LEN_ONE)
        self._check_sizes()
        for name in ("checkpoint_every", "eval_blocks", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a whole number >= 0")
        for name in ("lr", "table_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a finite number > 0")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give --steps or --tokens, not both")
        if not self.engram and self.mode is TrainMode.FROZEN:
            raise ValueError(
                "--no-engram with --mode frozen trains nothing: give --mode lora or --mode full for a "
                "baseline"
            )
        if not self.engram and (self.layers is not None or self.table_rows is not None):
            raise ValueError("--layers and --table-rows describe Engram: drop them with --no-engram")
        if self.table_sync is not None and self.table_sync not in TABLE_SYNCS:
            raise ValueError(f"--table-sync {self.table_sync!r}: give one of {', '.join(TABLE_SYNCS)}")
        if not self.engram and self.table_sync is not None:
            raise ValueError("--table-sync describes Engram's tables: drop it with --no-engram")
        h = self.held_out
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0 <= h < 1:  # NaN too
            raise ValueError(f"--held-out {h!r}: give a fraction in [0, 1), e.g. 0.05")

    def _check_sizes(self) -> None:
        """The sizes of Engram and LoRA against engram.config's bounds, before the model is read: a
        mistyped one (--heads 1000000000) is refused at once, never after minutes of prime search."""
        if self.heads > MAX_HEADS:
            raise ValueError(
                f"--heads {self.heads}: give 1 to {MAX_HEADS} hash heads per n-gram order (default 4)"
            )
        d = self.head_dim
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_HEAD_DIM):
            raise ValueError(
                f"--head-dim {d!r}: give a row width from 1 to {MAX_HEAD_DIM} (default 32 or 64)"
            )
        if d is not None and _ORDERS * self.heads * d > MAX_ENGRAM_DIM:
            raise ValueError(
                f"--heads {self.heads} --head-dim {d}: one token reads {_ORDERS} orders x {self.heads} heads x {d} "
                f"= {_ORDERS * self.heads * d:,} values, over {MAX_ENGRAM_DIM:,}: give fewer heads or a "
                "smaller --head-dim"
            )
        if self.table_rows is not None and self.table_rows > MAX_LAYER_ROWS:
            raise ValueError(
                f"--table-rows {self.table_rows:,}: give at most {MAX_LAYER_ROWS:,} rows a layer (2^36)"
            )
        if self.lora_rank > MAX_LORA_RANK:
            raise ValueError(f"--lora-rank {self.lora_rank}: give 1 to {MAX_LORA_RANK} (default 8)")
        if self.layers is not None:
            bad = [
                i
                for i in self.layers
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_LAYER_ID
            ]
            if bad:
                raise ValueError(
                    f"--layers {','.join(map(str, self.layers))}: {bad} out of range: give decoder layer ids "
                    f"from 0 to {MAX_LAYER_ID}"
                )
            primes = len(self.layers) * _ORDERS * self.heads
            if primes > MAX_PRIMES:
                raise ValueError(
                    f"--layers ({len(self.layers)} layers) x {_ORDERS} orders x --heads {self.heads} = {primes:,} "
                    f"primes to search, over {MAX_PRIMES:,}: give fewer layers or heads"
                )

    @property
    def num_steps(self) -> int:
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))
        return 200 if self.steps is None else self.steps

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["layers"] = None if self.layers is None else list(self.layers)
        return d


# ------------------------------------------------------------------------------------------- checks
def default_layers(depth: int) -> tuple[int, ...]:
    """Engram early and in the middle, as V4.1 (layers 1 and 14 of 30 or more): one layer below 8 layers."""
    if depth < 2:
        return (0,)
    return (1,) if depth < 8 else (1, depth // 2 - 1)


def check_layers(layers: Sequence[int], depth: int, folder: str) -> tuple[int, ...]:
    bad = [i for i in layers if not 0 <= i < depth]
    if bad:
        raise ValueError(
            f"--layers {','.join(map(str, layers))}: {bad} out of range: {folder} has {depth} decoder layers "
            f"(ids 0..{depth - 1}); give ids in that range, e.g. --layers "
            f"{','.join(map(str, default_layers(depth)))}"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"--layers {','.join(map(str, layers))} names a layer twice; give each once")
    return tuple(sorted(layers))


def default_head_dim(hidden: int) -> int:
    return 32 if hidden < 256 else 64


def default_table_rows(backbone_params: int, n_layers: int, head_dim: int) -> int:
    """Rows per layer so that the tables hold about half as many parameters as the backbone (at least
    4096 rows a layer): Engram's memory grows with the model it serves."""
    return max(4096, backbone_params // (2 * n_layers * head_dim))


def table_bytes(rows: int, n_layers: int, head_dim: int) -> int:
    """Bytes the tables take while training: float32 weights and SparseRowAdam's state (a float32
    momentum per value, a second moment and a step per row)."""
    return n_layers * rows * (8 * head_dim + 8)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_table_memory(rows: int, n_layers: int, head_dim: int, available: int | None = None) -> None:
    """Refuse tables that would not fit in the memory available now (estimated before any allocation)."""
    need = table_bytes(rows, n_layers, head_dim)
    available = available_memory() if available is None else available
    if available is not None and need > available:
        fit = max(1, available // (2 * n_layers * (8 * head_dim + 8)))
        raise ValueError(
            f"--table-rows {rows:,}: {n_layers} table(s) of {rows:,} rows x {head_dim} need about "
            f"{need / 1e9:.3g} GB to train (float32 weights + Adam state), but this machine has "
            f"{available / 1e9:.3g} GB available: give --table-rows {fit:,} or fewer"
        )


def partial_folder(out: str | os.PathLike[str]) -> Path:
    """Where a run writes before OUT exists: checkpoints, then OUT's files, renamed to OUT at the end."""
    o = Path(out)
    return o.parent / f".{o.name}.engram-partial"


def check_out(out: str | os.PathLike[str]) -> None:
    o = Path(out)
    kind = path_kind(o)
    if kind is None:
        return
    if kind != "a folder":
        raise ValueError(f"--out {out} is {kind}: give a new folder")
    if any(o.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty: give a new folder (or remove this one)")
