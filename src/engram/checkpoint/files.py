"""Safetensors files, through the `safetensors` package's file API: nothing here parses or writes the
format. Whole files, memory-mapped tensors, row slices, rows read by position (os.preadv: no mapping,
memory bounded by the destination or a block), member-file checks; every error names the file (and
the tensor) and the fix. Knows nothing of checkpoints, configs or tables.
Design: docs/checkpoint.md.

One concept past 500 lines: every way we touch a safetensors file (whole, mapped, by slice, by
position) behind one set of file checks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "DTYPES",
    "READ_CHUNK_BYTES",
    "FileWatch",
    "TensorEntry",
    "TensorFile",
    "TensorSlice",
    "dtype_name",
    "listed_names",
    "load_tensors",
    "member_file",
    "member_folder",
    "member_path",
    "open_tensors",
    "read_header",
    "save_tensors",
]

# safetensors dtype names <-> torch dtypes (the ones an Engram checkpoint can hold).
DTYPES: dict[str, torch.dtype] = {
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
_NAMES = {v: k for k, v in DTYPES.items()}
READ_CHUNK_BYTES = 4 * 2**20  # bytes a block of `TensorFile.iter_rows` (what a chunked check holds)
_IO_MAX = 2**30  # bytes one preadv call asks for

# Plain words for safetensors' refusals of a damaged file (its messages name no file and no fix).
_HINTS = {
    "not fully covered": "truncated or damaged (an interrupted copy or download?)",
    "header too": "it does not start with a safetensors header (is it a safetensors file?)",
}


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, what in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _regular(path: Path, what: str) -> None:
    """FileNotFoundError if `path` does not exist, ValueError unless it is a regular file (after links).
    Only `os.stat` touches it: a FIFO is never opened (opening one blocks until a writer comes)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}") from None
    except OSError as e:  # a link loop, a name too long, no permission
        raise ValueError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: {_kind(mode)}, not a {what}; replace it with the file itself")


def member_path(folder: str | os.PathLike[str], name: object, what: str) -> Path:
    """`folder / name`, whatever is there (or nothing), for a plain file name that, if a symlink,
    resolves inside `folder`: the one rule of every name a folder reader opens (`member_file`,
    `member_folder`, a model folder's tokenizer.json). Nothing is opened."""
    folder = Path(folder)
    if not isinstance(name, str):
        raise TypeError(f"{what} {name!r}: a {type(name).__name__}, expected a file name (a string)")
    plain = (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )
    if not plain:
        raise ValueError(
            f"{what} {name!r}, which is not a plain file name: a checkpoint names only files inside its own "
            f"folder {folder}; put the file there and name it without a path"
        )
    path = folder / name
    if os.path.islink(path):
        target, inside = os.path.realpath(path), os.path.realpath(folder)
        if os.path.commonpath([target, inside]) != inside:
            raise ValueError(
                f"{what} {name!r}, a symlink to {target}, outside the checkpoint folder {folder}; a checkpoint "
                "reads only files inside its folder: copy it in (cp -L; a linked snapshot: cp -rL) instead of "
                "linking it"
            )
    return path


def member_folder(folder: str | os.PathLike[str], name: object, what: str) -> Path:
    """The folder `name` inside `folder` (e.g. an HF model folder's `engram/` part), refused as
    `member_file` refuses a file's name: not a plain name, a symlink resolving outside `folder`
    (ValueError), missing (FileNotFoundError), not a folder (ValueError). Nothing is opened."""
    path = member_path(folder, name, what)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {name!r}, which does not exist in {folder}") from None
    except OSError as e:
        raise ValueError(f"{what} {name!r}: cannot read it ({e.strerror})") from None
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{what} {name!r}: {_kind(mode)}, not a folder; replace it with the folder itself")
    return path


def member_file(folder: str | os.PathLike[str], name: object, what: str) -> Path:
    """The regular file `name` inside checkpoint folder `folder`, where `name` is a file name a checkpoint
    holds (an index's shard name, a state.json entry) and `what` says where it came from (e.g.
    "model.safetensors.index.json maps 'x' to").

    Refused, before anything is opened: a name that is not a plain file name (absolute, with a path
    separator, "." or ".."; ValueError), a symlink resolving outside the folder (ValueError), a missing
    file (FileNotFoundError) and anything but a regular file: a folder, a FIFO, a device (ValueError).
    Every message names the entry and the fix."""
    folder = Path(folder)
    path = member_path(folder, name, what)
    try:
        _regular(path, "file")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {name!r}, which does not exist in {folder}") from None
    except ValueError as e:
        raise ValueError(f"{what} {name!r}: {str(e).removeprefix(f'{path}: ')}") from None
    return path


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of `dtype` (e.g. "F8_E4M3"); TypeError for a dtype engram does not store."""
    if dtype not in _NAMES:
        raise TypeError(
            f"dtype {dtype} is not one an Engram checkpoint holds (supported: {', '.join(map(str, _NAMES))})"
        )
    return _NAMES[dtype]


@contextlib.contextmanager
def _refusals(path: Path, name: str | None = None) -> Iterator[None]:
    """Turn safetensors' (and torch's memory-mapping) errors into ValueErrors naming the file and the fix."""
    where = f"{path}" if name is None else f"{path}: tensor {name!r}"
    try:
        yield
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        hint = next((h for key, h in _HINTS.items() if key in reason), None)
        size = path.stat().st_size if path.is_file() else 0
        raise ValueError(
            f"{where}: not a readable safetensors file ({size} bytes; safetensors says: {reason})"
            + (f": {hint}" if hint else "")
            + "; re-copy or re-convert it"
        ) from None
    except RuntimeError as e:  # torch could not map the file (raised while a tensor is made)
        if "mmap" not in str(e):
            raise
        hint = (
            "; Linux refuses a copy-on-write mapping larger than RAM + swap unless vm.overcommit_memory=1: "
            "add swap or set that"
            if "Cannot allocate memory" in str(e)
            else ""
        )
        raise ValueError(f"{where}: cannot memory-map the file ({e}){hint}") from None


# ------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it (nothing is read)."""

    path: Path
    name: str
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise TypeError(
                f"{self.path}: tensor {self.name!r} has dtype {self.dtype}, which engram cannot read"
            )
        return DTYPES[self.dtype]


class TensorSlice:
    """`TensorFile.slice(name)[a:b]`: rows a..b of one tensor (a view of the file's mapping)."""

    def __init__(self, path: Path, name: str, sl: Any) -> None:
        self.path, self.name, self._slice = path, name, sl

    def __getitem__(self, index: Any) -> torch.Tensor:
        with _refusals(self.path, self.name):
            return self._slice[index]


class FileWatch:
    """A descriptor kept open on a memory-mapped file, and the size the mapping needs (`size` bytes).

    Reading a mapped page that a truncation has cut off is a SIGBUS: the process dies (exit 135)
    with no Python error. `check()` (one fstat, microseconds) raises a ValueError naming the file
    instead, so a reader calls it before each batch of reads; a truncation during the batch itself
    is not caught. fstat of the descriptor sees the mapped file itself, even if its path has been
    replaced or removed since (then the mapping is intact and so is the check). A copy shares the
    descriptor; a pickled one reopens the path.
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path, self.size = Path(path), int(size)
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def check(self) -> None:
        """Raise ValueError if the file now holds fewer than `size` bytes."""
        now = os.fstat(self._fd).st_size
        if now < self.size:
            raise ValueError(
                f"{self.path} was truncated after it was opened: {now} bytes, expected {self.size}; "
                "reading it would crash the process (SIGBUS). Restore the file (re-copy or re-convert "
                "it) and open the table again"
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> FileWatch:
        return self  # immutable: the copy watches the same file through the same descriptor

    def __reduce__(self) -> tuple[type[FileWatch], tuple[Path, int]]:
        return type(self), (self.path, self.size)

    def __repr__(self) -> str:
        return f"FileWatch({str(self.path)!r}, size={self.size})"


class TensorFile:
    """An open safetensors file (see `open_tensors`)."""

    def __init__(self, path: Path, handle: Any) -> None:
        # `handle` is a numpy-framework one: its header queries map nothing. Tensors come from a torch
        # handle opened on first use, whose copy-on-write mapping of the whole file Linux refuses beyond
        # RAM + swap (a huge table is read through `mapped` instead).
        self.path, self._handle = path, handle
        self._torch: Any = None
        self._fd: int | None = None  # positional reads' descriptor (read_rows_into, iter_rows): at the first
        self.size = path.stat().st_size  # bytes, as safetensors checked the header against
        with _refusals(path):
            self.metadata: dict[str, str] = dict(handle.metadata() or {})
            self._keys: list[str] = list(handle.keys())

    def _torch_handle(self) -> Any:
        if self._torch is None:
            with _refusals(self.path):
                self._torch = safe_open(str(self.path), framework="pt")
        return self._torch

    def keys(self) -> list[str]:
        """The tensor names, sorted."""
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def _check_name(self, name: str) -> None:
        if name not in self._keys:
            have = ", ".join(self._keys[:8]) + (" ..." if len(self._keys) > 8 else "")
            raise ValueError(f"{self.path}: no tensor {name!r} (the file holds: {have or 'nothing'})")

    def entry(self, name: str) -> TensorEntry:
        """What the header says of tensor `name` (ValueError naming the file's tensors if it has none)."""
        self._check_name(name)
        with _refusals(self.path, name):
            sl = self._handle.get_slice(name)
            return TensorEntry(self.path, name, sl.get_dtype(), tuple(sl.get_shape()))

    def entries(self) -> dict[str, TensorEntry]:
        return {name: self.entry(name) for name in self._keys}

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, memory-mapped: nothing is read until touched, and writes stay in this process
        (copy-on-write, the file never changes). `.clone()` it to hold it in memory."""
        self._check_name(name)
        with _refusals(self.path, name):
            return self._torch_handle().get_tensor(name)

    def _locate(self, name: str) -> tuple[TensorEntry, int, int]:
        """(entry, byte offset, byte size) of tensor `name` in the file.

        Where the bytes lie follows from what safetensors has validated, not from parsing the header: it
        refuses files whose data region has gaps or trailing bytes, so that region is the file's last
        sum(nbytes) bytes, holding the tensors back to back in `offset_keys()` order."""
        self._check_name(name)
        with _refusals(self.path, name):
            order = list(self._handle.offset_keys())
        entries = {key: self.entry(key) for key in order}
        # torch_dtype raises TypeError for a dtype engram cannot read: its size is unknown here too
        sizes = {key: math.prod(e.shape) * e.torch_dtype.itemsize for key, e in entries.items()}
        start = self.size - sum(sizes.values())
        offset = start + sum(sizes[k] for k in order[: order.index(name)])
        return entries[name], offset, sizes[name]

    def mapped(self, name: str) -> torch.Tensor:
        """Tensor `name` as a read-only shared mapping of the file (numpy memmap, mode "r"): what a table
        far larger than RAM needs, since `tensor` maps copy-on-write, which Linux refuses beyond RAM + swap.
        The result is not writable (a write raises); `.clone()` it for a private copy."""
        e, offset, size = self._locate(name)
        if size == 0:
            return torch.empty(e.shape, dtype=e.torch_dtype)
        arr = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(size,))
        with warnings.catch_warnings():  # torch warns that the array is not writable: that is the point
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(arr)
        return raw.view(e.torch_dtype).view(e.shape)

    # Positional reads (os.preadv): what a reader holding a few rows of a large file needs. Nothing is
    # mapped, so only the destination is resident (the page cache is the kernel's, not the process's),
    # and a file truncated since it was opened is a short read, a ValueError, never a SIGBUS.

    def _descriptor(self) -> int:
        """A read-only descriptor on the file, opened at the first read and kept (closed with this object);
        refused if the file is no longer the size whose header safetensors checked."""
        if self._fd is None:
            try:  # O_NONBLOCK: a FIFO swapped in since open_tensors must not block the open
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as e:
                raise ValueError(f"{self.path}: cannot open the file to read it ({e.strerror})") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.size:
                os.close(fd)
                now = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
                raise ValueError(
                    f"{self.path} changed after it was opened ({now}, was {self.size} bytes): another "
                    "process replaced or truncated it; restore the file (re-copy it) and read it again"
                )
            self._fd = fd
            weakref.finalize(self, os.close, fd)
        return self._fd

    def _rows(self, name: str, lo: int, hi: int | None) -> tuple[TensorEntry, int, int, int]:
        """(entry, rows' first byte, row bytes, hi) of rows [lo, hi) of tensor `name` (hi None: the last)."""
        e, offset, _ = self._locate(name)
        if not e.shape:
            raise ValueError(f"{self.path}: tensor {name!r} is a scalar: it has no rows to read")
        n = e.shape[0]
        hi = n if hi is None else hi
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"{self.path}: rows [{lo}, {hi}) of tensor {name!r} are outside its {n} rows")
        row = math.prod(e.shape[1:]) * e.torch_dtype.itemsize
        return e, offset + lo * row, row, hi

    def _pread(self, name: str, buf: memoryview, at: int) -> None:
        """Fill `buf` (bytes) from byte `at` of the file; a short read is a truncated file (ValueError)."""
        fd, done = self._descriptor(), 0
        while done < len(buf):
            try:  # at most 1 GiB a call (Linux reads at most 2 GiB - 4 KiB at once)
                n = os.preadv(fd, [buf[done : done + _IO_MAX]], at + done)
            except OSError as e:
                raise ValueError(
                    f"{self.path}: tensor {name!r}: reading bytes [{at + done}, {at + len(buf)}) failed "
                    f"({e.strerror}); re-copy the file"
                ) from None
            if n == 0:
                now = os.fstat(fd).st_size
                raise ValueError(
                    f"{self.path}: tensor {name!r}: the file ends at byte {now}, before the tensor's bytes "
                    f"[{at}, {at + len(buf)}): it was truncated after it was opened (it had {self.size} "
                    "bytes); restore the file (re-copy it) and read it again"
                )
            done += n

    def read_rows_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [lo, hi) of tensor `name`, read (os.preadv) straight into `out`, a contiguous CPU tensor of
        the tensor's dtype and shape (hi - lo, *row shape): no mapping, no intermediate copy. Returns `out`."""
        e, at, _, hi = self._rows(name, lo, hi)
        want = (hi - lo, *e.shape[1:])
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"read_rows_into: out is a {type(out).__name__}, expected a torch.Tensor")
        if out.dtype != e.torch_dtype or tuple(out.shape) != want:
            raise ValueError(
                f"{self.path}: tensor {name!r} rows [{lo}, {hi}) are {e.dtype} {list(want)}, but out is "
                f"{out.dtype} {list(out.shape)}: pass a tensor of that dtype and shape (cast afterwards)"
            )
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"read_rows_into: out must be a contiguous CPU tensor (got {out.device}, "
                f"{'contiguous' if out.is_contiguous() else 'not contiguous'}); read into one and copy"
            )
        if out.numel():
            self._pread(name, memoryview(out.detach().reshape(-1).view(torch.uint8).numpy()), at)
        return out

    def iter_rows(
        self, name: str, lo: int = 0, hi: int | None = None, *, chunk_bytes: int = READ_CHUNK_BYTES
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of tensor `name` over rows [lo, hi) (hi None: the last), about `chunk_bytes`
        at a time (at least one row), each read by os.preadv into one buffer reused for every block: a
        block is overwritten by the next, so copy what you keep. Memory: one block, whatever the file."""
        e, at, row, hi = self._rows(name, lo, hi)
        if row == 0 or hi == lo:
            return
        step = max(1, chunk_bytes // row)  # rows a block
        buf = torch.empty((min(step, hi - lo), *e.shape[1:]), dtype=e.torch_dtype)
        raw = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        for a in range(lo, hi, step):
            n = min(step, hi - a)
            self._pread(name, raw[: n * row], at + (a - lo) * row)
            yield a, buf[:n]

    def watch(self) -> FileWatch:
        """A FileWatch on this file at the size it was opened with (for readers of `mapped` tensors)."""
        return FileWatch(self.path, self.size)

    def slice(self, name: str) -> TensorSlice:
        """`slice(name)[a:b]`: only those rows of tensor `name` are read."""
        self._check_name(name)
        with _refusals(self.path, name):
            return TensorSlice(self.path, name, self._torch_handle().get_slice(name))

    def expect(
        self, name: str, dtype: torch.dtype, shape: Sequence[int | str], *, mapped: bool = False
    ) -> torch.Tensor:
        """`tensor(name)` (with `mapped`, `mapped(name)`), checked to be `dtype` with `shape` first (a str in
        `shape` matches any size); the error names the file, the tensor, what it is and what was expected."""
        e = self.entry(name)
        if e.dtype != dtype_name(dtype):
            raise ValueError(
                f"{self.path}: tensor {name!r} has dtype {e.dtype}, expected {dtype_name(dtype)}"
            )
        ok = len(e.shape) == len(shape) and all(
            isinstance(s, str) or s == d for s, d in zip(shape, e.shape, strict=True)
        )
        if not ok:
            raise ValueError(
                f"{self.path}: tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}"
            )
        return self.mapped(name) if mapped else self.tensor(name)


def open_tensors(path: str | os.PathLike[str]) -> TensorFile:
    """Open a safetensors file; safetensors checks its header and size first (a truncated or foreign
    file raises ValueError naming it, a missing one FileNotFoundError)."""
    path = Path(path)
    _regular(path, "safetensors file")  # never opens a FIFO or a device
    with _refusals(path):
        handle = safe_open(str(path), framework="numpy")  # header checks only; maps nothing for torch
    return TensorFile(path, handle)


def load_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a file, {name: tensor}, memory-mapped as `TensorFile.tensor` maps them."""
    f = open_tensors(path)
    return {name: f.tensor(name) for name in f}


def listed_names(path: str | os.PathLike[str]) -> list[str]:
    """The tensor names a file's header lists, even when safetensors refuses the file (e.g. truncated):
    for error messages only ("these are damaged, not missing"), never to read data. [] without a header."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
            return []
        _, header = read_header(path)
    except (OSError, ValueError, RecursionError):  # ValueError: also bad JSON / UTF-8; too deep
        return []
    return sorted(k for k in header if k != "__metadata__")


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict[str, Any]]:
    """(n, header) of a safetensors file, read without safetensors: a tensor's data starts at byte
    8 + n + header[name]["data_offsets"][0]. For what safetensors' API does not tell (the names of a
    refused file, where bytes lie on disk); never to read data. Raises OSError, or ValueError for a
    file without a header."""
    # the format: an 8-byte little-endian length, then that many bytes of JSON. Nothing else here
    # reads the format.
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > 100_000_000:  # safetensors' own header limit: not a header
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return n, header


# ------------------------------------------------------------------------------------------- writing


def save_tensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write {name: tensor} as a safetensors file at `path` (metadata: str -> str, plus format "pt");
    return the tensor bytes written. safetensors writes a temporary file and renames it into place; the
    file is then fsync'ed.

    Memory: `save_file` writes straight from each tensor's memory (safetensors >= 0.8 passes pointers, no
    copy), so a CPU tensor costs nothing extra and a memory-mapped one streams from its file. Only a tensor
    on a GPU or not contiguous is copied to the host first (all of them before the write starts).
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist; create it first")
    meta = {"format": "pt", **(metadata or {})}
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"{path}: metadata {bad[0]!r} is not str -> str (safetensors metadata is text only)")
    ready: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{path}: tensor {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype not in _NAMES:
            raise TypeError(
                f"{path}: tensor {name!r} has dtype {t.dtype}, which an Engram checkpoint cannot hold "
                f"(supported: {', '.join(map(str, _NAMES))}); cast it first"
            )
        ready[name] = t.detach().cpu().contiguous()  # no copy for a contiguous CPU tensor
    try:
        save_file(ready, path, metadata=meta)
    except (SafetensorError, RuntimeError, ValueError) as e:
        why = " ".join(str(e).split())  # safetensors' messages span lines
        if "share memory" in why:  # its advice (save_model) does not apply here
            why = why.split(". ")[0] + "; pass a .clone() of all but one of them"
        raise ValueError(f"{path}: could not write the safetensors file ({why})") from None
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return sum(t.numel() * t.element_size() for t in ready.values())
