"""Reading and writing safetensors files without loading them whole.

Holds:
- `ST_DTYPES`: safetensors dtype names <-> torch dtypes (the ones an Engram checkpoint can hold).
- `read_safetensors_header(path)`: the parsed, validated header of a file ({name: SafetensorsEntry});
  a truncated file (an interrupted copy or download) is refused with the byte counts.
- `SafetensorsEntry`: where one tensor's bytes are; `.mmap()` maps them read-only (nothing is read
  until indexed), `.read()` copies them into memory.
- `expect_entry(entries, path, name, dtype, shape)`: one entry, checked against the dtype and shape
  a caller needs (the error names the file, the tensor and both).
- `write_safetensors(path, tensors)`: a file written in chunks (a memory-mapped table streams through
  without being loaded), readable by the `safetensors` package.

The format: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape,
data_offsets}} (plus `__metadata__`), then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "ST_DTYPES",
    "SafetensorsEntry",
    "expect_entry",
    "read_safetensors_header",
    "write_safetensors",
]

# safetensors refuses headers above 100 MB; so do we (a corrupt length would otherwise be read).
_MAX_HEADER_BYTES = 100_000_000
_WRITE_CHUNK = 1 << 26  # bytes per write: streams a memory-mapped table without loading it whole

# safetensors dtype names <-> torch dtypes (the ones an Engram checkpoint can hold).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
# Item sizes of every dtype a header may name (including ones engram cannot turn into tensors).
_ST_ITEMSIZE = {"F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8} | {
    k: torch.empty(0, dtype=v).element_size() for k, v in ST_DTYPES.items()
}


# ------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    path: Path
    name: str
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in ST_DTYPES:
            raise TypeError(
                f"{self.path}: tensor {self.name!r} has dtype {self.dtype}, which engram cannot read"
            )
        return ST_DTYPES[self.dtype]

    def mmap(self) -> torch.Tensor:
        """A read-only memory-mapped tensor over the file's bytes (nothing is read until indexed).

        Never write to it: the pages are mapped read-only and a write would crash the process.
        """
        dtype = self.torch_dtype
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=dtype)
        arr = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start, shape=(self.nbytes,))
        with warnings.catch_warnings():  # torch warns that the array is read-only: intended here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(arr)
        return flat.view(dtype).view(self.shape)

    def read(self) -> torch.Tensor:
        """The tensor copied into memory."""
        return self.mmap().clone()


def read_safetensors_header(
    path: str | os.PathLike[str], *, allow_truncated: bool = False
) -> dict[str, SafetensorsEntry]:
    """Parse and validate a safetensors header: {name: SafetensorsEntry}; `__metadata__` is skipped.

    Checks the 8-byte little-endian header length, the JSON, every entry's dtype / shape / data_offsets
    (size consistent with shape and dtype), and that the file holds all the bytes the header promises:
    a shorter file (an interrupted copy or download) raises ValueError naming the file, unless
    `allow_truncated` (used to list what a damaged file was meant to hold).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(
                    f"{path}: {size} bytes, too short for a safetensors file (8-byte header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > _MAX_HEADER_BYTES:
                raise ValueError(
                    f"{path}: header length {n} is not a safetensors header length (2..{_MAX_HEADER_BYTES}); "
                    "is this a safetensors file?"
                )
            if 8 + n > size:
                raise ValueError(
                    f"{path}: truncated: the header needs bytes 8..{8 + n} but the file has {size} bytes; "
                    "copy or download the file again"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: the safetensors header is a JSON {type(header).__name__}, expected an object"
        )
    data_start = 8 + n
    out: dict[str, SafetensorsEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _parse_entry(path, name, info, data_start, None if allow_truncated else size)
    return out


def _parse_entry(path: Path, name: str, info: Any, data_start: int, size: int | None) -> SafetensorsEntry:
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: tensor {name!r}: {what}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad(f"header entry {info!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _ST_ITEMSIZE:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if nbytes != expected:
        raise bad(f"data_offsets {offsets} hold {nbytes} bytes but {dtype} {shape} needs {expected}")
    end = data_start + offsets[1]
    if size is not None and end > size:
        raise ValueError(
            f"{path}: truncated: tensor {name!r} ends at byte {end} but the file has only {size} bytes "
            "(an interrupted copy or download?); copy or download the file again"
        )
    return SafetensorsEntry(path, name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def expect_entry(
    entries: dict[str, SafetensorsEntry], path: Path, name: str, dtype: str, shape: Sequence[int | str]
) -> SafetensorsEntry:
    """`entries[name]`, checked to be `dtype` with `shape` (a str in `shape` matches any size)."""
    if name not in entries:
        have = ", ".join(sorted(entries)[:8]) + (" ..." if len(entries) > 8 else "")
        raise ValueError(f"{path}: no tensor {name!r} (the file holds: {have or 'nothing'})")
    e = entries[name]
    if e.dtype != dtype:
        raise ValueError(f"{path}: tensor {name!r} has dtype {e.dtype}, expected {dtype}")
    ok = len(e.shape) == len(shape) and all(
        isinstance(s, str) or s == d for s, d in zip(shape, e.shape, strict=True)
    )
    if not ok:
        raise ValueError(f"{path}: tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}")
    return e


# ------------------------------------------------------------------------------------------- writing


def _write_tensor(f: Any, t: torch.Tensor) -> None:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)  # (nbytes,), little-endian raw bytes
    for start in range(0, flat.numel(), _WRITE_CHUNK):
        f.write(flat[start : start + _WRITE_CHUNK].numpy().data)


def write_safetensors(path: str | os.PathLike[str], tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Write [(name, tensor), ...] as a safetensors file at `path`; return the data bytes written.

    Widest dtypes come first so every tensor is aligned; the data is written in 64 MiB chunks, so a
    memory-mapped tensor streams from its file without being loaded whole. The file is fsync'ed.
    """
    items = sorted(tensors, key=lambda kv: -kv[1].element_size())  # stable: keeps order within a width
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        if name in header:
            raise ValueError(f"tensor name {name!r} is given twice; a safetensors file holds each name once")
        if t.dtype not in _TORCH_TO_ST:
            raise TypeError(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors files here cannot hold "
                f"(supported: {', '.join(str(d) for d in _TORCH_TO_ST)})"
            )
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _TORCH_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            _write_tensor(f, t)
        f.flush()
        os.fsync(f.fileno())
    return offset
