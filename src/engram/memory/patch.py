"""A memory patch: Engram table rows and their new values, the file they live in, and what they fit.

`MemoryPatch` holds, per Engram layer, sorted unique row ids and their new contents in the table's
own row format (float32 / bfloat16 rows of a trainable table, or values + scales of a quantised one:
FP8, INT8, 4-bit), plus what it was made for: the layout's and the tokenizer's fingerprints, the
signature of each layer's reader (every Engram weight but the table: what the rows mean), and
a sketch of the rows it replaces (`rows_sketch`). `save_patch` / `load_patch` write and read
one safetensors file, sealed and CRC-checked like every part. Knows nothing of models: applying is
`engram.memory.apply`'s. Design: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engram.checkpoint.temporaries import removed_on_failure, temporary_path
from engram.checkpoint.v41.format import CRC32_KEY, SEAL_KEY, crc32_entry, file_crc32s, seal_of
from engram.rowformat.formats import RowFormat
from engram.storage import quant
from engram.storage.integrity import tensor_crc32

__all__ = [
    "FLOAT_ROWS",
    "PATCH_FORMAT",
    "LayerRows",
    "MemoryPatch",
    "load_patch",
    "rows_as_float",
    "rows_in_format",
    "rows_sketch",
    "save_patch",
    "sketch_mismatch",
]

PATCH_FORMAT = "engram-memory-patch/1"  # the file's engram_patch_format entry
FLOAT_ROWS = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_KEY = "engram_patch"  # the metadata entry holding the patch's description (JSON)
_FORMAT_KEY = "engram_patch_format"


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """One layer's part of a patch: `rows` int64 [R] sorted and unique; `values` [R, width] in the
    row format's value dtype (float rows: [R, dim]); `scales` [R, scales a row] for a quantised format,
    None for float rows; `before`: float32 [R, 2], the `rows_sketch` of those rows in the table the
    patch was made for (what it replaces)."""

    rows: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None
    before: torch.Tensor

    @property
    def nbytes(self) -> int:
        s = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return (
            self.rows.numel() * 8
            + self.values.numel() * self.values.element_size()
            + s
            + self.before.numel() * 4
        )


@dataclasses.dataclass(frozen=True)
class MemoryPatch:
    """Rows to write into a model's Engram tables, and the model they fit (module docstring).

    Made by `memorize`, read by `load_patch`; its rows are checked on construction. Two patches with
    the same rows written the same way are the same patch (`fingerprint`), whatever their names.

    Args:
        layers: Each layer's rows and their new contents, by layer id (at least one layer).
        row_format: The rows' format: a `FLOAT_ROWS` name, or a `RowFormat` value ("fp8", "int8", ...).
        dim: The table's row width (values a row).
        table_rows: Each layer's table size, in rows.
        layout: The fingerprint of the layout that addresses the rows
            (`engram.addressing.layout.layout_fingerprint`).
        tokenizer: The tokenizer fingerprint of the compression map.
        readers: Each layer's reader signature (`engram.memory.apply.reader_signature`).
        facts: How many facts it holds (what `memorize` wrote it from).
        name: A name for messages; not part of its identity.

    Raises:
        ValueError: No layers, an unknown row format, or a layer's rows that do not fit the other
            fields: a layer without a table size or reader signature, row ids not int64 [R], not
            sorted and unique, or outside the table, or values, scales or sketch of another dtype
            or shape than the row format's.
    """

    layers: dict[int, LayerRows]
    row_format: str  # a FLOAT_ROWS name, or a RowFormat value ("fp8", "int8", ...)
    dim: int  # the table's row width (values a row)
    table_rows: dict[int, int]  # each layer's table size
    layout: str  # engram.addressing.layout.layout_fingerprint
    tokenizer: str  # the compression map's tokenizer fingerprint
    readers: dict[int, dict[str, Any]]  # each layer's reader signature (engram.memory.apply.reader_signature)
    facts: int = 0  # how many facts it holds (what memorize wrote it from)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a memory patch needs at least one layer of rows")
        if self.row_format not in FLOAT_ROWS and self.row_format not in {f.value for f in RowFormat}:
            known = ", ".join([*FLOAT_ROWS, *(f.value for f in RowFormat)])
            raise ValueError(f"row format {self.row_format!r} is not one of {known}")
        for lid, lr in self.layers.items():
            _check_layer(self, lid, lr, "MemoryPatch")

    @property
    def quantised(self) -> bool:
        """Whether its rows are in a quantised format (values + scales), not float rows."""
        return self.row_format not in FLOAT_ROWS

    @property
    def num_rows(self) -> int:
        """Rows it writes, over all layers."""
        return sum(lr.rows.numel() for lr in self.layers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (what the file holds, less its header)."""
        return sum(lr.nbytes for lr in self.layers.values())

    @property
    def fingerprint(self) -> str:
        """sha256 (64 hex digits) of its rows, contents and description: a patch's identity.

        The same rows written the same way have the same one, whatever its name.
        """
        h = hashlib.sha256(json.dumps(self.describe(with_name=False), sort_keys=True).encode())
        for lid in sorted(self.layers):
            lr = self.layers[lid]
            for t in (lr.rows, lr.values, lr.scales, lr.before):
                if t is not None:
                    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def describe(self, *, with_name: bool = True) -> dict[str, Any]:
        """What the file's header records of the patch (JSON).

        Args:
            with_name: Include its name (`fingerprint` describes it without).

        Returns:
            `row_format`, `dim`, `layout`, `tokenizer`, `facts`, `layers` (per layer id, as a
                string: its table's rows, the number of rows it writes, the reader signature) and,
                when `with_name`, `name`.
        """
        out: dict[str, Any] = {
            "row_format": self.row_format,
            "dim": self.dim,
            "layout": self.layout,
            "tokenizer": self.tokenizer,
            "facts": self.facts,
            "layers": {
                str(lid): {
                    "table_rows": self.table_rows[lid],
                    "rows": int(lr.rows.numel()),
                    "reader": self.readers[lid],
                }
                for lid, lr in sorted(self.layers.items())
            },
        }
        if with_name:
            out["name"] = self.name
        return out


def value_dtype(row_format: str) -> torch.dtype:
    """The dtype of a row format's values tensor."""
    if row_format in FLOAT_ROWS:
        return FLOAT_ROWS[row_format]
    return RowFormat(row_format).value_dtype


def rows_as_float(values: torch.Tensor, scales: torch.Tensor | None, row_format: str) -> torch.Tensor:
    """Stored rows in float32: float rows widened, quantised ones dequantised (exact for FP8)."""
    if scales is None:
        return values.float()
    return quant.dequantize(values, scales, torch.float32, fmt=row_format)


def rows_in_format(x: torch.Tensor, row_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float rows stored in `row_format`: (values, scales), scales None for float rows."""
    if row_format in FLOAT_ROWS:
        return x.to(FLOAT_ROWS[row_format]), None
    return quant.quantize(x, RowFormat(row_format))


SKETCH_TOLERANCE = 2.0**-7  # of a row's L1 norm: bfloat16 rounds each value by at most 2^-8 of itself


def rows_sketch(x: torch.Tensor) -> torch.Tensor:
    """float32 [R, 2]: float rows [R, D] projected on two fixed +-1 vectors (seeded by D). What a patch
    records of the rows it replaces: compared with a tolerance (`sketch_mismatch`), so the same rows
    in float32, bfloat16 or float16 match and rows of another table or training run do not."""
    g = torch.Generator().manual_seed(0x5EED + x.shape[-1])
    signs = torch.randint(0, 2, (x.shape[-1], 2), generator=g).float().mul_(2).sub_(1)
    return x.float() @ signs.to(x.device)


def sketch_mismatch(have: torch.Tensor, want: torch.Tensor, l1: torch.Tensor) -> int:
    """How many rows' sketches differ by more than `SKETCH_TOLERANCE` of the row's L1 norm (`l1`, [R])."""
    return int(((have - want).abs() > SKETCH_TOLERANCE * l1[:, None] + 1e-30).any(-1).sum())


def _check_layer(p: MemoryPatch, lid: int, lr: LayerRows, where: str) -> None:
    """Shapes, dtypes and row ids of one layer's rows; ValueError naming `where` and the layer."""
    fix = "write it with engram.memory.memorize (or save_patch of a MemoryPatch built right)"
    if lid not in p.table_rows or lid not in p.readers:
        raise ValueError(f"{where}: layer {lid} has rows but no table size or reader signature; {fix}")
    r = lr.rows
    if r.dtype != torch.int64 or r.dim() != 1:
        raise ValueError(
            f"{where}: layer {lid}'s row ids must be int64 [R], got {r.dtype} {list(r.shape)}; {fix}"
        )
    n = r.numel()
    if n and (int(r.min()) < 0 or int(r.max()) >= p.table_rows[lid]):
        raise ValueError(
            f"{where}: layer {lid} names rows outside its table of {p.table_rows[lid]} rows "
            f"({int(r.min())}..{int(r.max())}); {fix}"
        )
    if n > 1 and not bool((r[1:] > r[:-1]).all()):
        raise ValueError(f"{where}: layer {lid}'s row ids are not sorted and unique; {fix}")
    if p.row_format in FLOAT_ROWS:
        want_v, want_s = [n, p.dim], None
    else:
        fmt = RowFormat(p.row_format)
        want_v, want_s = [n, fmt.value_width(p.dim)], [n, fmt.scales_per_row(p.dim)]
    if lr.values.dtype != value_dtype(p.row_format) or list(lr.values.shape) != want_v:
        raise ValueError(
            f"{where}: layer {lid}'s values are {lr.values.dtype} {list(lr.values.shape)}, expected "
            f"{value_dtype(p.row_format)} {want_v} ({p.row_format} rows of width {p.dim}); {fix}"
        )
    if lr.before.dtype != torch.float32 or list(lr.before.shape) != [n, 2]:
        raise ValueError(
            f"{where}: layer {lid}'s sketch of the replaced rows is {lr.before.dtype} {list(lr.before.shape)}, "
            f"expected float32 {[n, 2]}; {fix}"
        )
    if want_s is None:
        if lr.scales is not None:
            raise ValueError(f"{where}: layer {lid} has scales, but {p.row_format} rows have none; {fix}")
    else:
        fmt = RowFormat(p.row_format)
        if lr.scales is None or lr.scales.dtype != fmt.scale_dtype or list(lr.scales.shape) != want_s:
            got = "none" if lr.scales is None else f"{lr.scales.dtype} {list(lr.scales.shape)}"
            raise ValueError(
                f"{where}: layer {lid}'s scales are {got}, expected {fmt.scale_dtype} {want_s}; {fix}"
            )


def _tensors(p: MemoryPatch) -> dict[str, torch.Tensor]:
    out = {}
    for lid, lr in p.layers.items():
        out[f"rows.{lid}"] = lr.rows.detach().cpu().contiguous()
        out[f"values.{lid}"] = lr.values.detach().cpu().contiguous()
        if lr.scales is not None:
            out[f"scales.{lid}"] = lr.scales.detach().cpu().contiguous()
        out[f"before.{lid}"] = lr.before.detach().cpu().contiguous()
    return out


def save_patch(patch: MemoryPatch, path: str | os.PathLike[str]) -> Path:
    """Write a patch to one safetensors file.

    Staged beside it, then renamed: a reader never sees half a patch (an existing file is replaced).
    Its header holds the description (`MemoryPatch.describe`), a CRC32 of every tensor and a seal.

    Args:
        patch: The patch.
        path: The file to write, in a folder that exists (e.g. `facts.patch.safetensors`).

    Returns:
        `path`, as a Path.

    Raises:
        ValueError: `path` is a folder, or its parent is not one.
    """
    dst = Path(path)
    if dst.is_dir():
        raise ValueError(f"{dst} is a folder: a patch is one file (e.g. {dst / 'facts.patch.safetensors'})")
    if not dst.parent.is_dir():
        raise ValueError(f"{dst.parent} is not a folder: make it first, or write the patch elsewhere")
    tensors = _tensors(patch)
    meta = {_FORMAT_KEY: PATCH_FORMAT, _KEY: json.dumps(patch.describe(), sort_keys=True)}
    meta[CRC32_KEY] = crc32_entry({k: tensor_crc32(t) for k, t in tensors.items()})
    meta[SEAL_KEY] = seal_of(meta)
    tmp = temporary_path(dst)
    with removed_on_failure(tmp):
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, dst)
    return dst


def load_patch(path: str | os.PathLike[str]) -> MemoryPatch:
    """Read a patch written by `save_patch`, checking its seal and every tensor's CRC32.

    Args:
        path: The patch file.

    Returns:
        The patch, checked as `MemoryPatch` checks its rows.

    Raises:
        ValueError: Anything else than an intact patch file (missing, not a patch, edited, damaged,
            incomplete); the message names the file and the fix.
    """
    src = Path(path)
    if not src.is_file():
        raise ValueError(f"{src}: no such patch file (engram memorize writes one with --out)")
    try:
        with safe_open(str(src), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get(_FORMAT_KEY) != PATCH_FORMAT:
                found = meta.get(_FORMAT_KEY)
                what = "no patch format entry" if found is None else f"format {found!r}"
                raise ValueError(
                    f"{src}: not a memory patch ({what}; this engram reads {PATCH_FORMAT}): give a file "
                    "written by engram memorize"
                )
            crcs = file_crc32s(meta, str(src))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{src}: not a readable safetensors file ({e}); write the patch again") from None
    if crcs is None:
        raise ValueError(f"{src}: its seal and CRC32s were removed; write the patch again")
    if set(crcs) != set(tensors):
        raise ValueError(f"{src}: its tensors are not the ones its header lists; write the patch again")
    for k, t in tensors.items():
        if tensor_crc32(t) != crcs[k]:
            raise ValueError(f"{src}: tensor {k} does not match its CRC32 (damaged); copy or write it again")
    try:
        d = json.loads(meta[_KEY])
        layers = {int(k): v for k, v in d["layers"].items()}
        rows = {
            lid: LayerRows(
                tensors[f"rows.{lid}"],
                tensors[f"values.{lid}"],
                tensors.get(f"scales.{lid}"),
                tensors[f"before.{lid}"],
            )
            for lid, v in layers.items()
        }
        return MemoryPatch(
            rows,
            d["row_format"],
            int(d["dim"]),
            {lid: int(v["table_rows"]) for lid, v in layers.items()},
            d["layout"],
            d["tokenizer"],
            {lid: v["reader"] for lid, v in layers.items()},
            int(d["facts"]),
            d.get("name", ""),
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, ValueError) and str(e).startswith("MemoryPatch:"):
            raise ValueError(f"{src}: {str(e).removeprefix('MemoryPatch: ')}") from None
        raise ValueError(
            f"{src}: its patch description is incomplete ({e!r}); write the patch again"
        ) from None
