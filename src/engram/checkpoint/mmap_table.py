"""`MmapQuantTable` / `MmapFP8Table`: a stored table memory-mapped from a safetensors file, rows read on demand.

It is an `engram.model.table.EngramTable` like the others, but it opens checkpoint files
(`engram.checkpoint.files.open_tensors`), so it lives here, above the single-device model, which knows
no file format. `MmapQuantTable` holds any row format (`engram.rowformat.formats.RowFormat`: FP8, INT8,
4-bit), `MmapFP8Table` V4.1's FP8. The pair checks, the pooled gather and the chunked dequantisation are
the model's (`quant_table_shape`, `gather_fp8`, `dequantize_table`), shared with `QuantTable`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engram.checkpoint.files import open_tensors
from engram.model.table import EngramTable, dequantize_table, gather_fp8, quant_table_shape
from engram.rowformat.formats import RowFormat, as_row_format
from engram.rowformat.fp8 import BLOCK
from engram.storage.outpool import OutputPool

__all__ = ["MmapFP8Table", "MmapQuantTable"]


class MmapQuantTable(EngramTable):
    """A table of any row format, memory-mapped from a safetensors file: `gather` reads only its rows.

    `weight` (values [rows, width]) and `scale` (scales [rows, scales a row]) are read-only views of the
    file, not buffers: they stay on the host (a state_dict does not hold them, `.to()` leaves them), and
    `gather(rows, dtype, device)` returns rows on `device` (default: the rows' device). The file's page
    cache is the only copy (pages are read as touched), so a table larger than RAM works: the mapping
    is read-only and shared (`TensorFile.mapped`), which the kernel does not count against RAM + swap,
    and a write to it raises.

    Args:
        path: The safetensors file holding the values.
        weight_name: The values tensor's name in the file.
        scale_name: The scales tensor's name (in `scale_path`).
        fmt: The row format (a `RowFormat` or its value). The tensors' dtypes and shapes must be the
            format's (a 4-bit table named as INT8 is refused, naming the file).
        scale_path: The file holding the scales, if not `path`.

    Raises:
        FileNotFoundError: A file does not exist.
        ValueError: A tensor is missing or has the wrong dtype or shape for the format; the
            message names the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        weight_name: str,
        scale_name: str,
        fmt: RowFormat | str = RowFormat.FP8,
        *,
        scale_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.row_format = as_row_format(fmt)
        self.path = Path(path)
        self.scale_path = self.path if scale_path is None else Path(scale_path)
        self.weight_name, self.scale_name = weight_name, scale_name
        f = self.row_format
        values_file = open_tensors(self.path)
        width = "dim" if f.values_per_byte == 1 else f"dim / {f.values_per_byte}"
        w = values_file.expect(weight_name, f.value_dtype, ["rows", width], mapped=True)
        dim = f.dim_of(w.shape[1])
        if w.shape[0] < 1 or dim % BLOCK or dim == 0:
            raise ValueError(
                f"{self.path}: tensor {weight_name!r} has shape {list(w.shape)}, expected [rows >= 1, {width}] "
                f"with dim a positive multiple of {BLOCK} (format {f.value})"
            )
        self.weight = w  # (rows, width), file-backed
        scales_file = values_file if self.scale_path == self.path else open_tensors(self.scale_path)
        self.scale = scales_file.expect(  # (rows, scales a row), file-backed
            scale_name, f.scale_dtype, [w.shape[0], f.scales_per_row(dim)], mapped=True
        )
        what = f"{type(self).__name__}({self.path})"
        self.num_rows, self.dim = quant_table_shape(self.weight, self.scale, f, what)
        # a read of a mapped page cut off by a truncation is a SIGBUS: checked before each batch of reads
        self._watches = [values_file.watch()] + ([] if scales_file is values_file else [scales_file.watch()])
        self.out_pool = OutputPool()  # reused host outputs of gather

    def check_files(self) -> None:
        """Check that no mapped file was truncated since it was opened: one fstat per file.

        Reading a truncated mapping would kill the process with SIGBUS, so this runs before each
        batch of reads.

        Raises:
            ValueError: A file was truncated; the message names it.
        """
        for watch in self._watches:
            watch.check()

    def gather(
        self,
        rows: torch.Tensor,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The dequantised embeddings of rows, read from the file.

        The rows are gathered and dequantised on the host, then copied once to the device.

        Args:
            rows: Row ids (...) int64/int32, on any device (a device's ids come to the host: a sync).
            dtype: The embeddings' dtype (default float32).
            device: Where the result goes (default: the rows' device).

        Returns:
            The embeddings (..., dim) in `dtype` on `device`.

        Raises:
            TypeError: `rows` is not a tensor.
            ValueError: A mapped file was truncated (see `check_files`), or a row id is out of range.
        """
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor of row ids, got {type(rows).__name__}")
        target = rows.device if device is None else torch.device(device)
        host_rows = rows if rows.device.type == "cpu" else rows.cpu()  # sync point: ids to the host
        self.check_files()
        out = gather_fp8(self.weight, self.scale, host_rows, dtype, self.out_pool)
        return out if target.type == "cpu" else out.to(target, non_blocking=False)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table dequantised in memory (reads the whole file).

        Args:
            dtype: The result's dtype.

        Returns:
            The table [rows, dim] in `dtype`.
        """
        self.check_files()
        return dequantize_table(self.weight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, dim={self.dim}, format={self.row_format.value}, path={str(self.path)!r}"


class MmapFP8Table(MmapQuantTable):
    """An FP8 table memory-mapped from a safetensors file (V4.1's tensors); the rest is `MmapQuantTable`'s.

    Args:
        path: The safetensors file holding the values.
        weight_name: The values tensor, float8_e4m3fn [rows, dim].
        scale_name: The scales tensor, float8_e8m0fnu [rows, dim // 32] (in `scale_path`).
        scale_path: The file holding the scales, if not `path`.

    Raises:
        FileNotFoundError: A file does not exist.
        ValueError: A tensor is missing or has the wrong dtype or shape; the message names the file.

    Examples:
        >>> import torch
        >>> from safetensors.torch import save_file
        >>> from engram import FP8Table, MmapFP8Table
        >>> fp8 = FP8Table.from_float(torch.randn(100, 64))
        >>> save_file({"table.weight": fp8.weight, "table.scale": fp8.scale}, "table.safetensors")
        >>> table = MmapFP8Table("table.safetensors", "table.weight", "table.scale")
        >>> rows = torch.tensor([3, 7])
        >>> table.num_rows, torch.equal(table.gather(rows), fp8.gather(rows))
        (100, True)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        weight_name: str,
        scale_name: str,
        *,
        scale_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(path, weight_name, scale_name, RowFormat.FP8, scale_path=scale_path)
