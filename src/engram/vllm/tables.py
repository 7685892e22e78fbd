"""Where the served model's Engram tables live, chosen by an option: in memory, or quantised (FP8, or the
INT8 / 4-bit row formats of `engram.hf.export_quantised`) from the systems layer (`engram.systems`).

| `tables`  | the table                                                     | needs                       |
|-----------|---------------------------------------------------------------|-----------------------------|
| `memory`  | as the part stores it (float, or FP8), read into memory       | any part                    |
| `host`    | FP8 in host DRAM behind a `TieredTable` (prefetched)          | an FP8 part (`export_fp8`)  |
| `mmap`    | the part's FP8 file memory-mapped, a hot-row cache in front   | an FP8 part                 |
| `rowfile` | the SSD row file (`engram convert --row-file`), read with positional reads, one hot-row cache in front (`LevelTable`, no host level) | an FP8 part with row files |

`patches` (memory patch files, `engram.memory`) are written into the tables after they load, in
order, before `host` moves them behind the tier: `memory` and `host` only (the others serve the
table read-only from its file). `cache_fraction` sizes the hot-row cache of `mmap` and `rowfile`
(default 5 % of each table's rows);
`verify` checks every table at load whatever its size (CRC32s, NaN / Inf, a row file's bytes against
its table's fingerprint), where by default only tables up to 256 MiB are.
The options come from the served model's config (`hf_overrides={"vllm_engram": {...}}` in vLLM),
are checked by `engram.vllm.options`, and apply to every Engram layer. A quantised table serves exactly what
`engram.hf` serves from the same part (an INT8 / 4-bit part the same way as an FP8 one: the tiers move
its format's bytes); nothing is quantised here (a float part asked to serve
FP8 is refused, naming `export_fp8`). No vLLM import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.checkpoint.convert import open_row_file
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.checkpoint.v41 import load_engram_modules
from engram.memory import EngramLayers, apply_patch
from engram.model.module import Engram
from engram.model.table import QuantTable
from engram.systems import LevelTable, TieredTable, offload_engram
from engram.vllm.folder import EngramPart
from engram.vllm.options import OPTIONS_KEY, ServeOptions, ServePlan, TableMode, serve_options, serve_plan

__all__ = [
    "OPTIONS_KEY",
    "ServeOptions",
    "TableMode",
    "build_tables",
    "load_tables",
    "prefetch",
    "serve_options",
    "table_stats",
]


def load_tables(part: EngramPart, options: ServeOptions, dtype: torch.dtype) -> dict[int, Engram]:
    """The part's Engram modules ({layer_id: Engram}, weights in `dtype`) with tables where `options`
    say, after `serve_plan`'s check: refuses an FP8 mode for a float part and `rowfile` without the row
    files, naming the fix."""
    return build_tables(serve_plan(part, options), dtype)


def build_tables(plan: ServePlan, dtype: torch.dtype) -> dict[int, Engram]:
    """`load_tables` for a plan already checked (the served model's, from the registry): no check again,
    but each patch's fit to the part (`apply_patch`: layout, tokenizer, the layers' weights, the rows it
    replaces), refused naming the patch file."""
    part, options = plan.part, plan.options
    mode = options.tables
    # host: read into memory here (what offload_engram does with a mapped file), patched, then tiered
    mapped = mode in (TableMode.MMAP, TableMode.ROWFILE)
    _, modules = load_engram_modules(part.part, part.config, mmap=mapped, dtype=dtype, verify=options.verify)
    for m in modules.values():  # serving: no gradients
        m.requires_grad_(False)
    if plan.patches:
        _apply_patches(plan, modules)
    holder = nn.ModuleDict({str(k): v for k, v in modules.items()})
    if mode is TableMode.HOST:
        offload_engram(holder, "host")
    elif mode is TableMode.MMAP:
        for m in modules.values():
            assert isinstance(m.table, MmapQuantTable)  # MmapFP8Table, or another row format's
            m.table = TieredTable(m.table, "ssd", cache_rows=_cache_rows(m.table.num_rows, options))
    elif mode is TableMode.ROWFILE:
        for lid, m in modules.items():
            assert isinstance(m.table, MmapQuantTable | QuantTable)
            rows = _cache_rows(m.table.num_rows, options)
            # one cache: on a CPU level 1 is in DRAM already, and a second DRAM level behind it repeats
            # its work for no hits (measured: 0 of 139K lookups hit it in bench_vllm)
            row_file = open_row_file(part.part, lid, verify=options.verify)
            m.table = LevelTable(row_file, device_rows=rows, host_rows=0)
    return modules


def _apply_patches(plan: ServePlan, modules: dict[int, Engram]) -> None:
    """Write the plan's patches into the modules' tables, in order (`apply_patch`, which checks each
    one's fit first); ValueError naming the patch file, the folder and the fix."""
    part = plan.part
    layers = EngramLayers(modules, NgramHasher(part.config, part.compression))
    for path, patch in zip(plan.options.patches, plan.patches, strict=True):
        try:
            apply_patch(layers, patch)
        except ValueError as e:
            raise ValueError(
                f"{OPTIONS_KEY}['patches']: {path} cannot be served with {part.folder}: {e}"
            ) from None


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
