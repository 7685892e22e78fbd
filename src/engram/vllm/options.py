"""The served model's Engram options (`hf_overrides={"vllm_engram": {...}}` in vLLM), read and checked
against the part they serve: where the tables live (`TableMode`, the table of `engram.vllm.tables`),
the hot-row cache's share of each table, and the memory patches written into the tables at load
(`engram.memory`: files read here, made absolute, and refused for tables served read-only from their
files). Light (no numba, no vLLM): the registry checks them in the process the user started, before
any worker: `serve_plan` checks them against the part once, and the model builds its tables from that
`ServePlan` without checking again (whether each patch fits the part's weights and rows is
`apply_patch`'s check, where the tables are loaded).
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from typing import Any

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.convert import open_row_file, row_file_path
from engram.memory.apply import check_addressing
from engram.memory.patch import FLOAT_ROWS, MemoryPatch, load_patch
from engram.vllm.folder import EngramPart

__all__ = [
    "OPTIONS_KEY",
    "ServeOptions",
    "ServePlan",
    "TableMode",
    "check_options",
    "serve_options",
    "serve_plan",
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
    # check every table at load (its CRC32s, NaN / Inf; the row files' bytes), not only those up to 256 MiB
    verify: bool = False
    patches: tuple[str, ...] = ()  # memory patch files (absolute paths), written into the tables in order


KEYS = ("tables", "cache_fraction", "verify", "patches")


def serve_options(value: Any) -> ServeOptions:
    """The options in `value` (None, or a dict with `tables`, `cache_fraction`, `verify` and `patches`),
    checked; relative patch paths are made absolute against this process's working directory."""
    if value is None:
        return ServeOptions()
    if not isinstance(value, dict):
        raise ValueError(
            f"{OPTIONS_KEY} must be a dict like {{'tables': 'rowfile', 'cache_fraction': 0.05}}, got "
            f"{type(value).__name__} {value!r}"
        )
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(
            f"{OPTIONS_KEY} has unknown keys {unknown}; it takes {', '.join(map(repr, KEYS[:-1]))} and "
            f"{KEYS[-1]!r}"
        )
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
    verify = value.get("verify", False)
    if not isinstance(verify, bool):
        raise ValueError(
            f"{OPTIONS_KEY}['verify']={verify!r} must be True or False (True: check every table at load, "
            "however large)"
        )
    return ServeOptions(mode, float(frac), verify, _patch_paths(value.get("patches", [])))


def _patch_paths(value: Any) -> tuple[str, ...]:
    """`patches`: a list of patch file paths, made absolute (a worker may run in another directory)."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(p, str | os.PathLike) and os.fspath(p) for p in value
    ):
        raise ValueError(
            f"{OPTIONS_KEY}['patches']={value!r} must be a list of memory patch files (engram memorize writes "
            "them), e.g. ['facts.patch.safetensors']"
        )
    return tuple(os.path.abspath(os.fspath(p)) for p in value)


def check_options(part: EngramPart, options: ServeOptions) -> None:
    """Refuse an FP8 mode for a float part and `rowfile` without its row files or with one that does not
    open (truncated, written for another part: `open_row_file` checks the header), naming the fix."""
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
        for lid in part.config.layer_ids:
            open_row_file(part.part, lid).close()
    if options.patches and mode in (TableMode.MMAP, TableMode.ROWFILE):
        raise ValueError(
            f"tables={mode.value!r} serves each table read-only from its file, so the memory patches "
            f"{list(options.patches)} cannot be written into it: serve them with tables 'memory' or 'host'"
        )


@dataclass(frozen=True)
class ServePlan:
    """A part and the options it is served with, checked against each other: made by `serve_plan` only,
    so whoever holds one (the registry's cache, the model's build) need not check again."""

    part: EngramPart
    options: ServeOptions
    patches: tuple[MemoryPatch, ...] = ()  # options.patches' files, read and checked, in their order


def serve_plan(part: EngramPart, options: ServeOptions | dict[str, Any] | None) -> ServePlan:
    """`options` (checked `ServeOptions`, or the raw `vllm_engram` value) checked against `part`: the one
    place the serving options are checked, and where the patch files are read (`load_patch`: sealed,
    CRC-checked). Raises ValueError naming the value and the fix."""
    checked = options if isinstance(options, ServeOptions) else serve_options(options)
    check_options(part, checked)
    patches = tuple(load_patch(p) for p in checked.patches)
    if patches:
        _check_patches(part, checked.patches, patches)
    return ServePlan(part, checked, patches)


def _check_patches(part: EngramPart, paths: tuple[str, ...], patches: tuple[MemoryPatch, ...]) -> None:
    """What of each patch's fit the part tells without its weights (`check_addressing`, and float rows
    against quantised tables or the other way round), so a patch for another model is refused here, in
    seconds, not where a worker loads the tables; the rest (the exact row format, the layers' readers)
    `apply_patch` checks there."""
    layout = Layout(part.config)
    tables = {ly.layer_id: (ly.table_rows, part.config.head_dim) for ly in layout.layers}
    fingerprint = layout_fingerprint(layout)
    held = "quantised" if part.fp8 else "float"
    for path, patch in zip(paths, patches, strict=True):
        try:
            check_addressing(patch, fingerprint, part.compression.fingerprint, tables)
            if (patch.row_format in FLOAT_ROWS) == part.fp8:
                raise ValueError(
                    f"it holds {patch.row_format} rows, the part's tables hold {held} rows; write the patch on "
                    "a model whose tables are in that format"
                )
        except ValueError as e:
            raise ValueError(
                f"{OPTIONS_KEY}['patches']: {path} cannot be served with {part.folder}: {e}"
            ) from None
