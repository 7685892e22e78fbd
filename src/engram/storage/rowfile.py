"""The SSD row file: one stored table laid out so that a missed row costs one page read (SPEC §5).

A safetensors table keeps a row's 256 value bytes and its 8 scale bytes in two tensors, and a
264-byte row may straddle a 4 KiB page, so a cold row costs 2-3 page reads. Here each row's value
bytes and scale bytes sit together, and rows are packed `page_bytes // row_bytes` to a page (15 for
264-byte FP8 rows, 28 for 144-byte 4-bit rows, the rest padding), so no row crosses a page. Any row
format (`engram.rowformat.formats.RowFormat`) is stored; the header records it. The first page is a
header: magic, version, rows, dim, row stride, rows per page, layer id, the fingerprint of the layout
the rows were hashed with and that of the table they were copied from (both checked against the
checkpoint's), and (version 3) the row format; an FP8 file is written as version 2, byte for byte as
before, and a version 2 file reads as FP8.
Opening scans the rows for NaN bytes as a checkpoint's tables are scanned (by size, always with
`verify`), and hashes them against the fingerprint of the table they were copied from. `RowFile` reads rows with batched positional reads
(`os.preadv`, one per run of consecutive pages, offsets ascending), optionally `O_DIRECT`, never a
memory map (whose page cache would be an uncounted extra level), and counts reads, pages and bytes.
`split_layout_pages` counts the pages the same rows touch in the two-tensor layout. Several
processes write one file together with `create_row_file` (the header, the file sized: zeros),
`write_row_range` (each its rows [lo, hi), at their slots) and `set_row_file_tables` (the table
fingerprint, known once every row is written, into the header's fixed-width field); the bytes are
`write_row_file`'s. Knows bytes and files, nothing of caches, models or processes. Design: docs/storage.md.

One concept past 500 lines: one file format, its writers (whole, by range) and its reader, so
the header written is the header checked.
"""

from __future__ import annotations

import functools
import mmap
import os
import stat
import struct
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from engram.rowformat.formats import RowFormat, as_row_format, check_pair, format_of
from engram.storage.integrity import check_quant_rows, fingerprint_blocks, scan_table

__all__ = [
    "MAGIC",
    "PAGE_BYTES",
    "VERSION",
    "RowFile",
    "RowFileHeader",
    "create_row_file",
    "set_row_file_tables",
    "split_layout_pages",
    "write_row_file",
    "write_row_range",
]

MAGIC = b"ENGRMROW"
VERSION = 3  # 2: the table fingerprint (`tables`) joined the header; 3: the row format (FP8 files stay 2)
PAGE_BYTES = 4096  # the page a read costs (and O_DIRECT's alignment)
_MIN_PAGE_BYTES = 512  # page_bytes is a whole number of sectors (O_DIRECT), one of which holds the header
# magic, version, header bytes, rows, dim, block, row bytes, row stride, rows per group, pages per group,
# page bytes, layer id, identity (64 ascii), tables (64 ascii), label (128 utf-8), (version 3) the row
# format's code (`RowFormat.code`); then a crc32 of those
_FMTS = {2: "<8sIIQIIIIIIIi64s64s128s", 3: "<8sIIQIIIIIIIi64s64s128sI"}
_WRITE_CHUNK_ROWS = 1 << 16
_SCAN_CHUNK_BYTES = 64 * 2**20  # bytes read at a time by the NaN scan
_FIX = "rewrite the row file from this checkpoint with `engram convert SRC DST --row-file`"


class RowFileHeader:
    """The geometry of a row file: where row r's bytes are. Rows are packed `rows_per_group` to a group
    of `pages_per_group` pages (15 rows to 1 page for 264-byte rows; a row over a page takes whole pages).
    A row is its `value_bytes` value bytes, then its `scale_bytes` scale bytes, in row format `fmt`."""

    def __init__(
        self,
        rows: int,
        dim: int,
        *,
        fmt: RowFormat | str = RowFormat.FP8,
        page_bytes: int = PAGE_BYTES,
        layer_id: int = -1,
        identity: str = "",
        tables: str = "",
        label: str = "",
    ) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"a row file needs rows >= 1, got {rows!r}")
        if (
            isinstance(page_bytes, bool)
            or not isinstance(page_bytes, int)
            or page_bytes < _MIN_PAGE_BYTES
            or page_bytes % _MIN_PAGE_BYTES
        ):
            raise ValueError(
                f"a row file's page_bytes must be a multiple of {_MIN_PAGE_BYTES} (a disk sector, which "
                f"holds the header), got {page_bytes!r}; the default is {PAGE_BYTES}"
            )
        self.rows, self.dim = rows, dim
        self.fmt = as_row_format(fmt)
        self.fmt.check_dim(dim)
        self.value_bytes, self.scale_bytes = self.fmt.value_bytes(dim), self.fmt.scale_bytes(dim)
        self.row_bytes = self.fmt.row_bytes(dim)
        self.version = 2 if self.fmt is RowFormat.FP8 else VERSION
        self.page_bytes = page_bytes
        self.row_stride = self.row_bytes
        if self.row_bytes <= page_bytes:
            self.rows_per_group, self.pages_per_group = page_bytes // self.row_bytes, 1
        else:
            self.rows_per_group, self.pages_per_group = 1, -(-self.row_bytes // page_bytes)
        self.group_bytes = self.pages_per_group * page_bytes
        self.groups = -(-rows // self.rows_per_group)
        self.layer_id, self.identity, self.tables, self.label = layer_id, identity, tables, label
        if len(identity.encode()) > 64 or len(tables.encode()) > 64 or len(label.encode()) > 128:
            raise ValueError("a row file's identity and tables take at most 64 bytes each, its label 128")

    @property
    def file_bytes(self) -> int:
        """The size a complete file has: the header page plus every group."""
        return self.page_bytes + self.groups * self.group_bytes

    def offset_of(self, rows: np.ndarray) -> np.ndarray:
        """File offset of each row's first byte (values, then scales)."""
        rows = np.asarray(rows, dtype=np.int64)
        g, k = np.divmod(rows, self.rows_per_group)
        return self.page_bytes + g * self.group_bytes + k * self.row_stride

    def pack(self) -> bytes:
        fields = [
            MAGIC, self.version, self.page_bytes, self.rows, self.dim, self.fmt.block(self.dim), self.row_bytes,
            self.row_stride, self.rows_per_group, self.pages_per_group, self.page_bytes, self.layer_id,
            self.identity.encode(), self.tables.encode(), self.label.encode(),
        ]  # fmt: skip
        if self.version >= 3:
            fields.append(self.fmt.code)
        fixed = struct.pack(_FMTS[self.version], *fields)
        raw = fixed + struct.pack("<I", zlib.crc32(fixed))
        return raw + bytes(self.page_bytes - len(raw))

    @classmethod
    def unpack(cls, raw: bytes, path: Path) -> RowFileHeader:
        """Parse and check a header page; ValueError naming the file and the fix for anything else."""
        fix = "rewrite it with `engram convert SRC DST --row-file`"
        if len(raw) < 12 or raw[:8] != MAGIC:
            raise ValueError(f"{path} is not an engram row file (no {MAGIC!r} header); {fix}")
        (version,) = struct.unpack("<I", raw[8:12])
        if version not in _FMTS:  # before the checksum: another version's header has another layout
            raise ValueError(
                f"{path}: row file version {version}, this engram reads versions 2 and {VERSION}; {fix}"
            )
        layout = _FMTS[version]
        fixed_len = struct.calcsize(layout)
        if len(raw) < fixed_len + 4:
            raise ValueError(f"{path} is not an engram row file (its header is cut short); {fix}")
        fields = struct.unpack(layout, raw[:fixed_len])
        (crc,) = struct.unpack("<I", raw[fixed_len : fixed_len + 4])
        if crc != zlib.crc32(raw[:fixed_len]):
            raise ValueError(f"{path}: the row file header is damaged (checksum mismatch); {fix}")
        (
            _,
            _,
            header_bytes,
            rows,
            dim,
            block,
            row_bytes,
            stride,
            rpg,
            ppg,
            page,
            layer_id,
            ident,
            tables,
            label,
        ) = fields[:15]
        fmt = RowFormat.FP8
        if version >= 3:
            code = fields[15]
            found = RowFormat.from_code(code)
            if found is None:
                raise ValueError(
                    f"{path}: the row file's format code {code} is no row format this engram knows "
                    f"({', '.join(f'{f.code} {f.value}' for f in RowFormat)}); {fix}"
                )
            fmt = found
        try:
            h = cls(
                rows, dim, fmt=fmt, page_bytes=page, layer_id=layer_id, identity=ident.rstrip(b"\0").decode(),
                tables=tables.rstrip(b"\0").decode(), label=label.rstrip(b"\0").decode(errors="replace"),
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{path}: the row file header does not describe a table ({e}); {fix}") from None
        got = (header_bytes, block, row_bytes, stride, rpg, ppg)
        want = (h.page_bytes, fmt.block(dim), h.row_bytes, h.row_stride, h.rows_per_group, h.pages_per_group)
        if got != want:
            raise ValueError(
                f"{path}: header geometry (header, block, row bytes, stride, rows/group, pages/group) = {got} "
                f"does not follow from rows={rows}, dim={dim}, format {fmt.value}: expected {want}; {fix}"
            )
        return h


def _packed(h: RowFileHeader, values: np.ndarray, scales: np.ndarray, k: int = 0) -> np.ndarray:
    """The groups (groups, group_bytes) uint8 that rows values (n, value_bytes) / scales (n, scale_bytes),
    as bytes, fill from slot `k` of their first group on: each row in its slot, every other slot and the
    padding zero (what the file holds there)."""
    per, n = h.rows_per_group, values.shape[0]
    groups = -(-(k + n) // per)
    slots = np.zeros((groups * per, h.row_stride), dtype=np.uint8)
    slots[k : k + n, : h.value_bytes] = values
    slots[k : k + n, h.value_bytes : h.row_bytes] = scales
    buf = np.zeros((groups, h.group_bytes), dtype=np.uint8)
    buf[:, : per * h.row_stride] = slots.reshape(groups, per * h.row_stride)
    return buf


def _row_bytes_of(t: torch.Tensor) -> np.ndarray:
    """A host table's rows (n, k) as their bytes (n, k * itemsize) uint8, no copy when contiguous."""
    return t.contiguous().view(torch.uint8).numpy()


def write_row_file(
    path: str | os.PathLike[str],
    values: torch.Tensor,
    scales: torch.Tensor,
    *,
    layer_id: int = -1,
    identity: str = "",
    tables: str = "",
    label: str = "",
    fmt: RowFormat | str | None = None,
) -> Path:
    """Write the table values / scales of row format `fmt` (None: what their dtypes say, `format_of`; FP8:
    values (N, dim) float8_e4m3fn / scales (N, dim // 32) float8_e8m0fnu) as a row file at `path`
    (through a temporary file `.{name}.tmp-{pid}`, fsynced, then renamed; removed if the write fails);
    returns the path.

    `identity` (<= 64 ASCII bytes) names the layout the rows were hashed with and `tables` the table they
    were copied from (`engram.storage.integrity.table_fingerprint`), so a reader can refuse a file made
    for another layout or another checkpoint of the same layout; `label` is free text (the config's name)."""
    fmt = format_of(values, scales) if fmt is None else as_row_format(fmt)
    dim, _ = check_pair(fmt, values, scales)
    if values.dim() != 2 or values.device.type != "cpu":
        raise ValueError(
            f"write_row_file needs a 2-D host table, got {tuple(values.shape)} on {values.device}"
        )
    h = RowFileHeader(
        int(values.shape[0]), dim, fmt=fmt, layer_id=layer_id, identity=identity, tables=tables, label=label
    )
    v = _row_bytes_of(values)
    s = _row_bytes_of(scales)
    path = Path(path)
    # the checkpoint writers' temporary name (engram.checkpoint.temporaries): a killed write's is cleared
    # by the next writer of the folder; a failed one (a full disk, Ctrl-C) removes its own here
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    per = h.rows_per_group
    step = max(per, _WRITE_CHUNK_ROWS // per * per)  # whole groups per chunk
    try:
        with open(tmp, "wb") as f:
            f.write(h.pack())
            for r0 in range(0, h.rows, step):
                r1 = min(r0 + step, h.rows)
                f.write(_packed(h, v[r0:r1], s[r0:r1]).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def create_row_file(path: str | os.PathLike[str], header: RowFileHeader) -> None:
    """Start a row file written by several processes: the header page (`header.tables` may be left
    empty and set with `set_row_file_tables` once every row is written) and the file sized to
    `header.file_bytes` (sparse: every slot and every byte of padding reads as zero until written)."""
    with open(path, "wb") as f:
        f.write(header.pack())
        f.truncate(header.file_bytes)


def write_row_range(
    path: str | os.PathLike[str],
    header: RowFileHeader,
    first_row: int,
    values: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Write the rows values (n, width) / scales (n, scales a row) of the header's row format (FP8:
    (n, dim) / (n, dim // 32)) as rows [first_row, first_row + n) of the row file `create_row_file`
    made at `path` (pwrite at each row's slot, then fsync), so that other processes may write other
    rows of it at the same time: the range need not start or end on a group, and only its own slots are
    written (the padding between groups is written as the zeros it holds)."""
    h = header
    dim, _ = check_pair(h.fmt, values, scales)
    n = int(values.shape[0])
    if values.dim() != 2 or dim != h.dim or values.device.type != "cpu":
        raise ValueError(
            f"{path}: rows to write must be a host table of {h.dim}-wide {h.fmt.value} rows, got "
            f"{tuple(values.shape)} on {values.device}"
        )
    if not 0 <= first_row <= first_row + n <= h.rows:
        raise ValueError(f"{path}: rows [{first_row}, {first_row + n}) of a row file of {h.rows} rows")
    v = _row_bytes_of(values)
    s = _row_bytes_of(scales)
    per = h.rows_per_group
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for a in range(first_row, first_row + n, _WRITE_CHUNK_ROWS):
            b = min(a + _WRITE_CHUNK_ROWS, first_row + n)
            g0, k = divmod(a, per)  # row a's group and its slot there
            buf = _packed(h, v[a - first_row : b - first_row], s[a - first_row : b - first_row], k)
            start = k * h.row_stride  # from row a's slot to the end of row b - 1's
            end = (buf.shape[0] - 1) * h.group_bytes + ((b - 1) % per + 1) * h.row_stride
            data = memoryview(buf.reshape(-1)[start:end])
            offset = h.page_bytes + g0 * h.group_bytes + start
            done = 0
            while done < len(data):  # pwrite may write less than asked
                done += os.pwrite(fd, data[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def set_row_file_tables(path: str | os.PathLike[str], tables: str) -> None:
    """Record `tables` (the fingerprint of the table the rows hold, <= 64 ASCII bytes) in the
    header of the row file at `path`, rewritten in place (fixed width: no row moves), fsynced."""
    path = Path(path)
    with open(path, "rb") as f:
        h = RowFileHeader.unpack(f.read(PAGE_BYTES), path)
    h.tables = tables
    if len(tables.encode()) > 64:
        raise ValueError(f"{path}: a row file's tables fingerprint takes at most 64 bytes, got {tables!r}")
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.pwrite(fd, h.pack(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


class RowFile:
    """A row file opened for positional reads (`read_rows`), with counters: reads, pages_read, bytes_read.

    `io_threads`: reads in flight at once (a thread pool issues the runs of pages in parallel; an SSD
    serves several outstanding reads in about the time of one).

    `expect_rows` / `expect_dim` / `expect_identity` / `expect_tables` / `expect_layer_id`: refuse a file
    whose header differs (made for another layout, checkpoint or layer). `direct`: open with O_DIRECT (no
    page cache); where the filesystem refuses it, a warning says so and the file is read through the page
    cache. Every row is scanned for NaN bytes (as `engram.storage.integrity` scans a checkpoint's
    tables) when the rows take at most `SCAN_LIMIT_BYTES`, or always with `verify`; else a warning says
    the file was not scanned.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expect_rows: int | None = None,
        expect_dim: int | None = None,
        expect_identity: str | None = None,
        expect_tables: str | None = None,
        expect_layer_id: int | None = None,
        expect_format: RowFormat | str | None = None,
        direct: bool = False,
        io_threads: int = 1,
        verify: bool = False,
    ) -> None:
        want_fmt = None if expect_format is None else as_row_format(expect_format, "expect_format")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads={io_threads!r} must be an int >= 1 (reads in flight at once)")
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None  # started on the first read that can use it
        self.path = Path(path)
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(
                f"row file {self.path} does not exist (write it with `engram convert --row-file`)"
            ) from None
        if not stat.S_ISREG(mode):  # a FIFO is never opened (that blocks until a writer comes)
            raise ValueError(f"row file {self.path} is not a regular file; replace it with the file itself")
        with open(self.path, "rb") as f:
            self.header = RowFileHeader.unpack(f.read(PAGE_BYTES), self.path)
        h = self.header
        fix = _FIX
        if want_fmt is not None and not want_fmt.same_bytes(h.fmt, h.dim):
            raise ValueError(
                f"{self.path}: the row file holds {h.fmt.value} rows ({h.row_bytes} B each) but it is read as "
                f"{want_fmt.value} ({want_fmt.row_bytes(h.dim)} B each): a file written for another format; "
                f"open it as {h.fmt.value}, or {fix}"
            )
        for name, want, got, why in (
            ("rows", expect_rows, h.rows, "another checkpoint or layer"),
            ("dim", expect_dim, h.dim, "another checkpoint"),
            ("identity", expect_identity, h.identity, "another layout: its row ids mean other n-grams"),
            ("tables", expect_tables, h.tables, "another checkpoint's table, of other weights"),
            ("layer_id", expect_layer_id, h.layer_id, "another layer"),
        ):
            if want is not None and want != got:
                raise ValueError(
                    f"{self.path}: the row file has {name}={got!r} but the table needs {name}={want!r} "
                    f"(a file made for {why}); {fix}"
                )
        size = self.path.stat().st_size
        if size != h.file_bytes:
            fits = [
                f.value
                for f in RowFormat
                if f is not h.fmt
                and RowFileHeader(h.rows, h.dim, fmt=f, page_bytes=h.page_bytes).file_bytes == size
            ]
            why = (
                f"the size of a {' / '.join(fits)} file of these rows: the header's format disagrees with the data"
                if fits
                else "truncated or damaged?"
            )
            raise ValueError(
                f"{self.path}: the row file is {size} bytes but its header ({h.rows} {h.fmt.value} rows x "
                f"{h.row_bytes} B, {h.rows_per_group} rows per {h.group_bytes} B) needs {h.file_bytes} ({why}); {fix}"
            )
        self.rows, self.dim, self.row_bytes, self.row_format = h.rows, h.dim, h.row_bytes, h.fmt
        self.verify = bool(verify)
        where = f"row file {self.path}"
        if scan_table(h.rows * h.row_bytes, self.verify, where):
            check_quant_rows(self._pieces(), h.fmt, where, fix)
            self._check_tables(where, fix)
        self.direct = False
        self._direct_asked = direct
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if direct:
            if not hasattr(os, "O_DIRECT"):
                warnings.warn(
                    f"{self.path}: O_DIRECT does not exist on this OS; reading through the page cache",
                    stacklevel=2,
                )
            else:
                try:
                    self._fd = os.open(self.path, flags | os.O_DIRECT)
                    self.direct = True
                except OSError as e:
                    warnings.warn(
                        f"{self.path}: this filesystem refuses O_DIRECT ({e.strerror}); reading through the "
                        "page cache instead (pass direct=False to silence this)",
                        stacklevel=2,
                    )
        if not self.direct:
            self._fd = os.open(self.path, flags)
        self._buf = mmap.mmap(-1, PAGE_BYTES)  # page-aligned (O_DIRECT needs it), grown as needed
        self.reset_stats()

    def _check_tables(self, where: str, fix: str) -> None:
        """The rows' bytes against the fingerprint of the table they were copied from, where the header
        records one (`table_fingerprint`: 64 hex digits): a byte damaged in the row file is refused. Two
        more reads of the file (the fingerprint hashes every value, then every scale)."""
        h = self.header
        if len(h.tables) != 64 or any(c not in "0123456789abcdef" for c in h.tables):
            return
        got = fingerprint_blocks(
            (h.rows, h.fmt.value_width(h.dim)),
            (h.rows, h.fmt.scales_per_row(h.dim)),
            (values for _, values, _ in self._pieces()),
            (scales for _, _, scales in self._pieces()),
        )
        if got != h.tables:
            raise ValueError(
                f"{where}: its rows do not match the fingerprint of the table they were copied from (recorded "
                f"{h.tables[:16]}..., its bytes give {got[:16]}...): the file was damaged since it was written; {fix}"
            )

    def _pieces(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first row, values (n, value_bytes), scales (n, scale_bytes)) uint8 of every row, about
        _SCAN_CHUNK_BYTES at a time, read through the page cache (for the scan at open)."""
        h = self.header
        per = max(1, _SCAN_CHUNK_BYTES // h.group_bytes)  # groups a piece
        buf = np.empty(per * h.group_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(h.page_bytes)
            for g0 in range(0, h.groups, per):
                n = min(per, h.groups - g0)
                raw = buf[: n * h.group_bytes]
                if f.readinto(memoryview(raw)) != raw.shape[0]:
                    raise ValueError(f"{self.path}: the row file was truncated while it was read; {_FIX}")
                groups = raw.reshape(n, h.group_bytes)[:, : h.rows_per_group * h.row_stride]
                r0 = g0 * h.rows_per_group
                slots = groups.reshape(-1, h.row_stride)[: min(n * h.rows_per_group, h.rows - r0)]
                yield (
                    r0,
                    torch.from_numpy(slots[:, : h.value_bytes]),
                    torch.from_numpy(slots[:, h.value_bytes : h.row_bytes]),
                )

    def reset_stats(self) -> None:
        self.reads = 0  # preadv calls
        self.pages_read = 0
        self.bytes_read = 0
        self.rows_read = 0

    def stats(self) -> dict[str, float]:
        return {
            "reads": self.reads,
            "pages_read": self.pages_read,
            "bytes_read": self.bytes_read,
            "rows_read": self.rows_read,
            "pages_per_row": self.pages_read / self.rows_read if self.rows_read else 0.0,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)

    def __reduce__(self) -> tuple:
        """A copy (deepcopy, pickle) opens the same path again, refusing a file that changed identity."""
        h = self.header
        kwargs = {
            "expect_rows": h.rows,
            "expect_dim": h.dim,
            "expect_identity": h.identity,
            "expect_tables": h.tables,
            "expect_layer_id": h.layer_id,
            "expect_format": h.fmt,
            "direct": self._direct_asked,
            "io_threads": self.io_threads,
            "verify": self.verify,
        }
        return (functools.partial(RowFile, **kwargs), (self.path,))

    def read_rows(
        self, rows: np.ndarray, out_values: np.ndarray, out_scales: np.ndarray, *, count: bool = True
    ) -> None:
        """out_values (M, value_bytes) / out_scales (M, scale_bytes) uint8 <- the bytes of rows (M,) int64 (any
        order); FP8: (M, dim) / (M, dim // 32).

        The distinct page groups are read in ascending order, one `os.preadv` per run of consecutive
        groups; `count=False` leaves the counters alone (verify reads)."""
        rows = np.asarray(rows, dtype=np.int64)
        m = rows.shape[0]
        vb, sb = self.header.value_bytes, self.header.scale_bytes
        if out_values.shape != (m, vb) or out_scales.shape != (m, sb):
            raise ValueError(
                f"read_rows: out buffers must be ({m}, {vb}) and ({m}, {sb}) bytes, got "
                f"{out_values.shape} and {out_scales.shape}"
            )
        if m == 0:
            return
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise ValueError(f"row id {bad} is out of range [0, {self.rows}) of row file {self.path}")
        h = self.header
        groups, gpos = np.unique(rows // h.rows_per_group, return_inverse=True)  # ascending offsets
        n_groups = groups.shape[0]
        need = n_groups * h.group_bytes
        if len(self._buf) < need:
            self._buf = mmap.mmap(-1, max(need, len(self._buf) * 3 // 2 // PAGE_BYTES * PAGE_BYTES))
        view = memoryview(self._buf)
        starts = np.flatnonzero(np.diff(groups, prepend=-2) != 1)  # first group of each run
        ends = np.append(starts[1:], n_groups)
        runs = list(zip(starts.tolist(), ends.tolist(), strict=True))

        def read(chunk: list[tuple[int, int]]) -> None:  # os.preadv releases the GIL
            for a, b in chunk:
                off = h.page_bytes + int(groups[a]) * h.group_bytes
                want = (b - a) * h.group_bytes
                got = os.preadv(self._fd, [view[a * h.group_bytes : b * h.group_bytes]], off)
                if got != want:
                    raise ValueError(
                        f"{self.path}: read {got} of {want} bytes at offset {off}: the row file was truncated "
                        "since it was opened; rewrite it with `engram convert SRC DST --row-file`"
                    )

        try:
            k = min(self.io_threads, len(runs) // 4)  # a few runs each, else the hand-off costs more
            if k <= 1:
                read(runs)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="engram-rowfile")
                step = -(-len(runs) // k)
                futures = [self._pool.submit(read, runs[i : i + step]) for i in range(0, len(runs), step)]
                wait(futures)  # all of them, even after a failure: they write into the buffer
                for f in futures:
                    f.result()  # raises the first failed chunk's error
        finally:
            view.release()
        page = np.frombuffer(self._buf, dtype=np.uint8, count=need)
        slots = np.lib.stride_tricks.as_strided(
            page, shape=(n_groups, h.rows_per_group, h.row_stride), strides=(h.group_bytes, h.row_stride, 1)
        )
        got_rows = slots[gpos, rows % h.rows_per_group]  # (M, stride) copy
        out_values[...] = got_rows[:, :vb]
        out_scales[...] = got_rows[:, vb : self.row_bytes]
        if count:
            self.reads += starts.shape[0]
            self.pages_read += n_groups * h.pages_per_group
            self.bytes_read += need
            self.rows_read += m

    def gather_bytes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (values, scales) of rows (M,) in the file's format's dtypes (FP8: float8 tensors
        (M, dim) / (M, dim // 32))."""
        r = rows.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        h = self.header
        v = np.empty((r.shape[0], h.value_bytes), dtype=np.uint8)
        s = np.empty((r.shape[0], h.scale_bytes), dtype=np.uint8)
        self.read_rows(r, v, s)
        return torch.from_numpy(v).view(h.fmt.value_dtype), torch.from_numpy(s).view(h.fmt.scale_dtype)

    def __repr__(self) -> str:
        return (
            f"RowFile({str(self.path)!r}, rows={self.rows}, dim={self.dim}, format={self.row_format.value}, "
            f"direct={self.direct})"
        )


def split_layout_pages(
    value_offset: int, scale_offset: int, dim: int, rows: np.ndarray, page_bytes: int = PAGE_BYTES
) -> tuple[int, int]:
    """Pages the two-tensor layout (values at file offset `value_offset`, scales at `scale_offset`, as
    in a safetensors table) touches for `rows`: (sum over rows of each row's own pages, distinct pages
    of the whole set). A row costs 2 pages, 3 when its values straddle a page boundary."""
    rows = np.asarray(rows, dtype=np.int64)
    nb = dim // 32  # one ue8m0 byte per 32 values
    pages = []
    for base, width in ((value_offset, dim), (scale_offset, nb)):
        first = (base + rows * width) // page_bytes
        last = (base + rows * width + width - 1) // page_bytes
        pages.append((first, last))
    per_row = sum(int((last - first + 1).sum()) for first, last in pages)
    distinct = set()
    for first, last in pages:
        span = int((last - first).max()) if rows.shape[0] else 0
        for d in range(span + 1):
            p = np.minimum(first + d, last)
            distinct.update(p.tolist())
    return per_row, len(distinct)
