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
    """A table of row format `fmt` memory-mapped from a safetensors file: `gather` reads only the
    requested rows.

    `weight` (values [rows, width]) and `scale` (scales [rows, scales a row]) are read-only views of the
    file, not buffers: they stay on the host (a state_dict does not hold them, `.to()` leaves them), and
    `gather(rows, dtype, device)` returns rows on `device` (default: the rows' device). The file's page
    cache is the only copy (pages are read as touched), so a table larger than RAM works: the mapping
    is read-only and shared (`TensorFile.mapped`), which the kernel does not count against RAM + swap,
    and a write to it raises. The tensors' dtypes and shapes must be the format's (a 4-bit table named
    as INT8 is refused, naming the file).
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
        """Raise ValueError naming the file if a mapped file was truncated since it was opened (reading
        it would kill the process with SIGBUS): one fstat per file, before each batch of reads."""
        for watch in self._watches:
            watch.check()

    def gather(
        self,
        rows: torch.Tensor,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """rows (...) int64/int32 (any device) -> (..., dim) in `dtype` on `device` (default rows.device).

        The rows are gathered and dequantised on the host, then copied once to the device.
        """
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor of row ids, got {type(rows).__name__}")
        target = rows.device if device is None else torch.device(device)
        host_rows = rows if rows.device.type == "cpu" else rows.cpu()  # sync point: ids to the host
        self.check_files()
        out = gather_fp8(self.weight, self.scale, host_rows, dtype, self.out_pool)
        return out if target.type == "cpu" else out.to(target, non_blocking=False)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table [rows, dim] dequantised to `dtype` in memory (reads the whole file)."""
        self.check_files()
        return dequantize_table(self.weight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, dim={self.dim}, format={self.row_format.value}, path={str(self.path)!r}"


class MmapFP8Table(MmapQuantTable):
    """An FP8 table memory-mapped from a safetensors file: `weight` float8_e4m3fn [rows, dim], `scale`
    float8_e8m0fnu [rows, dim // 32] (V4.1's tensors); the rest is `MmapQuantTable`'s."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        weight_name: str,
        scale_name: str,
        *,
        scale_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(path, weight_name, scale_name, RowFormat.FP8, scale_path=scale_path)
