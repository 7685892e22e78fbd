"""Where the served model's Engram tables live, chosen by an option: in memory, or FP8 from the systems
layer (`engram.systems`).

| `tables`  | the table                                                     | needs                       |
|-----------|---------------------------------------------------------------|-----------------------------|
| `memory`  | as the part stores it (float, or FP8), read into memory       | any part                    |
| `host`    | FP8 in host DRAM behind a `TieredTable` (prefetched)          | an FP8 part (`export_fp8`)  |
| `mmap`    | the part's FP8 file memory-mapped, a hot-row cache in front   | an FP8 part                 |
| `rowfile` | the SSD row file (`engram convert --row-file`), read with positional reads, one hot-row cache in front (`LevelTable`, no host level) | an FP8 part with row files |

`cache_fraction` sizes the hot-row cache of `mmap` and `rowfile` (default 5 % of each table's rows).
The options come from the served model's config (`hf_overrides={"vllm_engram": {...}}` in vLLM),
are checked by `serve_options`, and apply to every Engram layer. An FP8 table serves exactly what
`engram.hf` serves from the same FP8 part; nothing is quantised here (a float part asked to serve
FP8 is refused, naming `export_fp8`). No vLLM import.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engram.checkpoint.convert import open_row_file, row_file_path
from engram.checkpoint.v41 import load_engram_modules
from engram.model.module import Engram
from engram.model.table import FP8Table, MmapFP8Table
from engram.systems import LevelTable, TieredTable, offload_engram
from engram.vllm.folder import EngramPart

__all__ = [
    "OPTIONS_KEY",
    "ServeOptions",
    "TableMode",
    "load_tables",
    "prefetch",
    "serve_options",
    "table_stats",
]

OPTIONS_KEY = "vllm_engram"  # the served model config's attribute holding the options (a dict)


class TableMode(enum.StrEnum):
    MEMORY = "memory"
    HOST = "host"
    MMAP = "mmap"
    ROWFILE = "rowfile"


@dataclass(frozen=True)
class ServeOptions:
    tables: TableMode = TableMode.MEMORY
    cache_fraction: float = 0.05  # hot-row cache of mmap / rowfile tables, a fraction of each table's rows


def serve_options(value: Any) -> ServeOptions:
    """The options in `value` (None, or a dict with `tables` and `cache_fraction`), checked."""
    if value is None:
        return ServeOptions()
    if not isinstance(value, dict):
        raise ValueError(
            f"{OPTIONS_KEY} must be a dict like {{'tables': 'rowfile', 'cache_fraction': 0.05}}, got "
            f"{type(value).__name__} {value!r}"
        )
    unknown = sorted(set(value) - {"tables", "cache_fraction"})
    if unknown:
        raise ValueError(f"{OPTIONS_KEY} has unknown keys {unknown}; it takes 'tables' and 'cache_fraction'")
    tables = value.get("tables", TableMode.MEMORY)
    try:
        mode = TableMode(tables)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in TableMode)
        raise ValueError(f"{OPTIONS_KEY}['tables']={tables!r}: use one of {choices}") from None
    frac = value.get("cache_fraction", ServeOptions.cache_fraction)
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 1 or math.isnan(frac):
        raise ValueError(
            f"{OPTIONS_KEY}['cache_fraction']={frac!r} must be a number in (0, 1] (the hot-row cache's share "
            "of each table's rows)"
        )
    return ServeOptions(mode, float(frac))


def load_tables(part: EngramPart, options: ServeOptions, dtype: torch.dtype) -> dict[int, Engram]:
    """The part's Engram modules ({layer_id: Engram}, weights in `dtype`) with tables where `options`
    say. Refuses an FP8 mode for a float part and `rowfile` without the row files, naming the fix."""
    mode = options.tables
    if mode is not TableMode.MEMORY and not part.fp8:
        raise ValueError(
            f"tables={mode.value!r} serves FP8 tables, but {part.part} stores float tables: write an FP8 part "
            "with engram.hf.export_fp8(model, folder) (lossy: e4m3 values, ue8m0 scales), or serve "
            "tables='memory'"
        )
    if mode is TableMode.ROWFILE:
        missing = [lid for lid in part.config.layer_ids if not row_file_path(part.part, lid).is_file()]
        if missing:
            raise ValueError(
                f"tables='rowfile' reads {[str(row_file_path(part.part, lid)) for lid in missing]}, which are "
                f"missing: write them with engram.checkpoint.convert.write_row_files({str(part.part)!r})"
            )
    _, modules = load_engram_modules(part.part, part.config, mmap=mode is not TableMode.MEMORY, dtype=dtype)
    for m in modules.values():  # serving: no gradients
        m.requires_grad_(False)
    holder = nn.ModuleDict({str(k): v for k, v in modules.items()})
    if mode is TableMode.HOST:
        offload_engram(holder, "host")
    elif mode is TableMode.MMAP:
        for m in modules.values():
            assert isinstance(m.table, MmapFP8Table)
            m.table = TieredTable(m.table, "ssd", cache_rows=_cache_rows(m.table.num_rows, options))
    elif mode is TableMode.ROWFILE:
        for lid, m in modules.items():
            assert isinstance(m.table, MmapFP8Table | FP8Table)
            rows = _cache_rows(m.table.num_rows, options)
            # one cache: on a CPU level 1 is in DRAM already, and a second DRAM level behind it repeats
            # its work for no hits (measured: 0 of 139K lookups hit it in bench_vllm)
            m.table = LevelTable(open_row_file(part.part, lid), device_rows=rows, host_rows=0)
    return modules


def _cache_rows(num_rows: int, options: ServeOptions) -> int:
    return max(1, min(num_rows, math.ceil(options.cache_fraction * num_rows)))


def prefetch(modules: dict[int, Engram], rows: dict[int, torch.Tensor], dtype: torch.dtype | None) -> None:
    """Start fetching each layer's rows in the background (tables behind a `TieredTable`; the others
    are served synchronously): the model computes the layers before the Engram layer meanwhile."""
    for lid, m in modules.items():
        if isinstance(m.table, TieredTable):
            m.table.prefetch(rows[lid], dtype)


def table_stats(modules: dict[int, Engram]) -> dict[int, dict[str, Any]]:
    """Per layer: the table's kind and, for tiered tables, their counters (hit rates included)."""
    out: dict[int, dict[str, Any]] = {}
    for lid, m in modules.items():
        t = m.table
        entry: dict[str, Any] = {"table": type(t).__name__}
        if isinstance(t, TieredTable | LevelTable):
            entry.update(t.stats())
        out[lid] = entry
    return out
