"""A safetensors file laid out before its tensors are written, then filled row by row by anyone.

`lay_out(specs, metadata)` fixes the header (names, dtypes, shapes, offsets, metadata) and the file's
size; `create` writes the header and sizes the file; `write_rows(path, laid, name, first_row, rows)`
writes rows of one tensor at their offsets (several processes at once, each its own rows: nobody
holds a whole table); `set_metadata` fills a value reserved at layout time (same length). The result
is an ordinary safetensors file, its tensors back to back in the order safetensors' own writer puts
them (its dtypes' order, largest items first so each is aligned, then by name), so the data are those
`save_file` writes of the same tensors; `engram.checkpoint.files` reads it as any other. Knows the file
format, nothing of tables or processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from engram.checkpoint.files import dtype_name, read_header

__all__ = ["LaidOut", "create", "lay_out", "set_metadata", "write_rows"]

# safetensors' dtypes in the order of its `Dtype` enum, which its writer sorts tensors by (descending):
# never decreasing in item size, so the tensors it lays out back to back are each aligned
_SAFETENSORS_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16")
_SAFETENSORS_ORDER += ("I32", "U32", "F32", "F64", "I64", "U64")


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """Where each tensor's bytes lie in the file: `spans[name]` = [begin, end) (absolute offsets),
    its `shapes` and `dtypes`; `size`: the file's length; `header`: the bytes before the data."""

    header: bytes
    spans: dict[str, tuple[int, int]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    @property
    def size(self) -> int:
        return max((b for _, b in self.spans.values()), default=len(self.header))

    def row_bytes(self, name: str) -> int:
        """Bytes of one row (index along dim 0) of tensor `name`."""
        shape = self.shapes[name]
        return math.prod(shape[1:]) * self.dtypes[name].itemsize


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def lay_out(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]) -> LaidOut:
    """The layout of a file of tensors {name: (dtype, shape)} with `metadata` (str -> str, plus format
    "pt"), in safetensors' order: its dtypes' (largest item size first: each tensor aligned), then by
    name."""
    meta = {"format": "pt", **metadata}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("safetensors metadata is text only (str -> str)")
    order = sorted(specs, key=lambda n: (-_SAFETENSORS_ORDER.index(dtype_name(specs[n][0])), n))
    header: dict = {"__metadata__": meta}
    pos, rel = 0, {}
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = (pos, pos + nbytes)
        pos += nbytes
    head = _header_bytes(header)
    spans = {n: (len(head) + a, len(head) + b) for n, (a, b) in rel.items()}
    return LaidOut(head, spans, {n: tuple(specs[n][1]) for n in order}, {n: specs[n][0] for n in order})


def create(path: str | os.PathLike[str], laid: LaidOut) -> None:
    """Write the header and size the file (the data region reads as zeros until written; sparse)."""
    with open(path, "wb") as f:
        f.write(laid.header)
        f.truncate(laid.size)


def write_rows(
    path: str | os.PathLike[str], laid: LaidOut, name: str, first_row: int, rows: torch.Tensor
) -> None:
    """Write `rows` (n, ...) as rows [first_row, first_row + n) of tensor `name` (pwrite, then fsync:
    other processes may write other rows of the same file at the same time)."""
    if name not in laid.spans:
        raise ValueError(f"{path}: the layout has no tensor {name!r}")
    shape, dtype = laid.shapes[name], laid.dtypes[name]
    if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:]:
        raise ValueError(
            f"{path}: rows of {name!r} must be {dtype} (n, {', '.join(map(str, shape[1:]))}), got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    n0 = shape[0] if shape else 1
    if not 0 <= first_row <= first_row + rows.shape[0] <= n0:
        raise ValueError(
            f"{path}: rows [{first_row}, {first_row + rows.shape[0]}) of {name!r}, which has {n0}"
        )
    data = memoryview(
        rows.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    )  # no copy on CPU
    offset = laid.spans[name][0] + first_row * laid.row_bytes(name)
    fd = os.open(path, os.O_WRONLY)
    try:
        done = 0
        while done < len(data):  # pwrite may write less than asked (2 GiB at most on Linux)
            done += os.pwrite(fd, data[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def set_metadata(path: str | os.PathLike[str], key: str, value: str) -> None:
    """Set metadata `key` of a laid-out file to `value`, which must be as long as the value reserved
    for it at layout time (the header keeps its length, so no byte of data moves)."""
    n, header = read_header(path)
    meta = header.get("__metadata__", {})
    if key not in meta or len(meta[key]) != len(value):
        raise ValueError(f"{Path(path)}: metadata {key!r} was not reserved at {len(value)} characters")
    meta[key] = value
    new = _header_bytes(header)
    if len(new) != 8 + n:
        raise ValueError(f"{Path(path)}: the header would change length ({8 + n} -> {len(new)} bytes)")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, new, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
