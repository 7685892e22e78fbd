"""Row lookups: gather selected rows of a whole (possibly huge or memory-mapped) Engram table.

The FP8 row format and its (de)quantisation are `engram.storage.quant`'s; this module only picks rows out of a
table and routes the work to a backend.

This module holds:

- ``LookupBackend``: which implementation a gather uses (``AUTO``, ``NUMBA``, ``TORCH``); all give
  identical bytes.
- ``dequantize_gather(values, scales, rows, dtype, out, backend, threads)``: dequantise selected rows of an
  FP8 table ``values [N, D]`` / ``scales [N, D // block]`` without converting the rest of it.  Two backends:
  the fused, multi-threaded numba kernels of ``engram.kernels.cpu_lookup`` (CPU tables, bit-identical, several
  times faster) and the torch path, their reference twin.
- ``gather_rows(weight, rows, out, backend, threads)``: the same gather for a plain float table (fp32,
  bf16, ...; no dequantisation, no autograd).

Decisions (also stated where they apply):

- numba is imported on first use, never with ``engram``; ``AUTO`` falls back to torch without it, for
  tables off the CPU and for non-contiguous tables.
- Row ids are checked (``[0, N)``) on every call; on the numba path the kernel reports a bad id or a NaN
  scale byte and the torch path then raises the reference's error.
- ``threads=None`` stays on the calling thread below 2048 rows (handing work to the pool costs about what
  a thousand rows do) and uses every core above.
"""

from __future__ import annotations

import enum
import functools
from types import ModuleType

import torch

from engram.storage.quant import (
    BLOCK,
    _check_out_dtype,
    _check_pair,
    _check_scale_bytes,
    _dequant_2d,
    _prepare_out,
    _unravel,
)

__all__ = ["LookupBackend", "dequantize_gather", "gather_rows"]

_ROW_ID_DTYPES = (torch.int64, torch.int32)

# Below this many rows `threads=None` stays on the calling thread: handing a chunk to the pool costs
# tens of microseconds, about what the kernel needs for a thousand rows.
_PARALLEL_MIN_ROWS = 2048


class LookupBackend(enum.StrEnum):
    """Which implementation `dequantize_gather` / `gather_rows` use (all give identical bytes)."""

    AUTO = "auto"  # numba for CPU tables when it imports and the table is contiguous, else torch
    NUMBA = "numba"  # engram.kernels.cpu_lookup: fused, multi-threaded, CPU only
    TORCH = "torch"  # the reference twin, any device


@functools.cache
def _kernel_module() -> ModuleType | None:
    """engram.kernels.cpu_lookup, or None without numba (imported on first use, not with engram)."""
    try:
        from engram.kernels import cpu_lookup as _lookup_kernels
    except ImportError:
        return None
    return _lookup_kernels


def _lookup_kernels(backend: LookupBackend | str, *tables: torch.Tensor) -> ModuleType | None:
    """The numba kernel module if `backend` and the tables allow it, else None (the torch path).

    AUTO falls back to torch for tables off the CPU, non-contiguous tables or without numba; NUMBA raises.
    """
    try:
        b = LookupBackend(backend)
    except ValueError:
        raise ValueError(
            f"backend={backend!r} is not one of {', '.join(repr(v.value) for v in LookupBackend)}"
        ) from None
    if b is LookupBackend.TORCH:
        return None
    device = tables[0].device
    if device.type != "cpu" or not all(t.is_contiguous() for t in tables):
        if b is LookupBackend.NUMBA:
            where = f"on {device}" if device.type != "cpu" else "not contiguous"
            raise ValueError(
                f"backend='numba' gathers from contiguous CPU tables, but this table is {where}; "
                "pass backend='auto' or 'torch'"
            )
        return None
    module = _kernel_module()
    if module is None and b is LookupBackend.NUMBA:
        raise ImportError(
            "backend='numba' needs numba, which does not import here: `pip install numba`, or pass "
            "backend='torch' (identical rows, several times slower)"
        )
    return module


def _check_threads(threads: int | None) -> None:
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, got {threads!r}")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (or None: all cores for large gathers)")


def _lookup_threads(threads: int | None, n: int, module: ModuleType) -> int:
    """Threads for n rows: `threads`, or every core for n >= _PARALLEL_MIN_ROWS when None."""
    if threads is None:
        return 1 if n < _PARALLEL_MIN_ROWS else module.available_cores()
    return threads


def _check_gather_rows(rows: torch.Tensor, table: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor of dtype torch.int64 or torch.int32, got {type(rows)}")
    if rows.dtype not in _ROW_ID_DTYPES:
        raise TypeError(f"rows has dtype {rows.dtype}, expected torch.int64 or torch.int32")
    if rows.device != table.device:
        raise ValueError(f"rows on {rows.device} but table on {table.device}")


def _check_row_range(flat: torch.Tensor, n_table: int, row_shape: tuple[int, ...]) -> None:
    bad = (flat < 0) | (flat >= n_table)
    if bool(bad.any()):  # sync point on CUDA: boundary check
        p = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"row id {int(flat[p])} at rows{list(_unravel(p, row_shape))} is out of range [0, {n_table})"
        )


def dequantize_gather(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
    backend: LookupBackend | str = LookupBackend.AUTO,
    threads: int | None = None,
) -> torch.Tensor:
    """Dequantise the table rows ``rows`` (int64/int32, any shape ``[...]``) of a whole table
    ``values [N, D]`` / ``scales [N, D // block]`` -> ``[..., D]`` in ``dtype``.

    Only the requested rows' bytes are gathered (the table may be huge or memory-mapped and is never
    converted as a whole).  ``backend``: ``"numba"`` runs the fused kernel of ``engram.kernels.cpu_lookup``
    (CPU, contiguous tables; ``threads`` threads, None = all cores from 2048 rows; repeated ids are decoded
    once per window of 1024 positions); ``"torch"`` is the reference twin (repeated ids are dequantised
    once when that halves the work or better, then expanded); ``"auto"`` takes numba where it can, and on CUDA
    with triton the Triton gather (`engram.kernels.fp8_gather`, which skips the NaN-scale check).  All
    give identical bits for finite tables.  Raises ValueError for row ids outside [0, N), plus the
    checks of ``dequantize_rows``; after such an error ``out``'s contents are unspecified.
    """
    dim, _ = _check_pair(values, scales, block)
    _check_out_dtype(dtype)
    if values.dim() != 2:
        raise ValueError(f"values must be a table [N, D], got shape {tuple(values.shape)}")
    _check_gather_rows(rows, values)
    _check_threads(threads)
    n_table = values.shape[0]
    row_shape = tuple(rows.shape)
    result = _prepare_out(out, (*row_shape, dim), dtype, values.device)
    n = rows.numel()
    out2d = result.view(n, dim)  # [n, D]
    flat = rows.reshape(n)  # [n]
    if n == 0:
        return result
    if backend in (LookupBackend.AUTO, "auto") and dtype in (torch.float32, torch.bfloat16):
        from engram import kernels  # lazy: triton is optional

        if kernels.use_triton(values, scales, flat):  # CUDA + triton: the fused Triton gather
            _check_row_range(flat, n_table, row_shape)  # sync point: the boundary check
            kernels.fp8_gather(values, scales, flat, dtype, out=out2d)  # scale bytes are not checked
            return result
    module = _lookup_kernels(backend, values, scales)
    if module is not None and module.fp8_gather(
        values, scales, flat, out2d, _lookup_threads(threads, n, module)
    ):
        return result  # else a bad row id or NaN scale: the torch path below raises the reference's error

    # The torch path (the reference twin); also raises the errors the kernel found.
    _check_row_range(flat, n_table, row_shape)
    v_u8 = values.view(torch.uint8)  # [N, D] bytes; index_select on bytes avoids any fp8 kernel support
    s_u8 = scales.view(torch.uint8)  # [N, nb]

    ids = flat
    inverse: torch.Tensor | None = None
    if n > 1:
        uniq, inv = torch.unique(flat, return_inverse=True)  # sorted, also improves gather locality
        if 2 * uniq.numel() <= n:
            ids, inverse = uniq, inv

    g_v = v_u8.index_select(0, ids)  # [u, D] uint8, only the requested rows
    g_s = s_u8.index_select(0, ids)  # [u, nb]
    _check_scale_bytes(g_s, lambda r: f"table row {int(ids[r])}", block)
    if inverse is None:
        _dequant_2d(g_v, g_s, block, out2d)
    else:
        uniq_rows = torch.empty((ids.numel(), dim), dtype=dtype, device=values.device)  # [u, D], u <= n/2
        _dequant_2d(g_v, g_s, block, uniq_rows)
        torch.index_select(uniq_rows, 0, inverse, out=out2d)
    return result


def gather_rows(
    weight: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: LookupBackend | str = LookupBackend.AUTO,
    threads: int | None = None,
) -> torch.Tensor:
    """Rows ``rows`` (int64/int32, any shape ``[...]``) of a plain table ``weight [N, D]`` (fp32, bf16, ...)
    -> ``[..., D]`` in the table's dtype, into ``out`` if given.

    The no-dequantisation twin of ``dequantize_gather`` (same backends and ``threads``), for inference
    and prefetch: the result carries no autograd history (train through ``F.embedding``).  The torch
    backend is ``index_select``.  Raises ValueError for row ids outside [0, N).
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        found = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight)
        raise TypeError(f"weight must be a floating-point table [N, D], got {found}")
    _check_gather_rows(rows, weight)
    _check_threads(threads)
    weight = weight.detach()
    row_shape = tuple(rows.shape)
    result = _prepare_out(out, (*row_shape, weight.shape[1]), weight.dtype, weight.device)
    n = rows.numel()
    out2d = result.view(n, weight.shape[1])
    flat = rows.reshape(n)
    if n == 0:
        return result
    module = _lookup_kernels(backend, weight)
    if module is not None and module.rows_gather(weight, flat, out2d, _lookup_threads(threads, n, module)):
        return result
    _check_row_range(flat, weight.shape[0], row_shape)
    with torch.no_grad():
        torch.index_select(weight, 0, flat, out=out2d)
    return result
