"""Row lookups: gather selected rows of a whole (possibly huge or memory-mapped) Engram table.

`dequantize_gather` decodes rows of any row format (`engram.rowformat.formats`: FP8, INT8, 4-bit) without
converting the rest of the table; `gather_rows` is the same for plain float tables. Backends (`LookupBackend`) give identical
bits: the fused numba kernels of `engram.kernels.cpu_lookup` (CPU), the Triton gather (CUDA) and the
torch reference twin. Row ids are checked on every call. Knows nothing of modules or tiers.
Design: docs/storage.md.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from types import ModuleType

import torch

from engram import kernels
from engram.kernels.threads import check_threads, resolve_threads
from engram.rowformat.formats import RowFormat, as_row_format, check_int_scales, check_pair, format_of
from engram.rowformat.fp8 import (
    BLOCK,
    check_dequant_dtype,
    check_fp8_pair,
    check_row_ids,
    check_row_range,
    check_scale_bytes,
    prepare_out,
)
from engram.storage.quant import dequantize_into
from engram.storage.quant_int import dequantize_int_into

__all__ = ["LookupBackend", "dequantize_gather", "gather_rows"]


# Below this many rows `threads=None` stays on the calling thread: handing a chunk to the pool costs
# tens of microseconds, about what the kernel needs for a thousand rows.
_PARALLEL_MIN_ROWS = 2048
_BYTE_TABLES = (torch.int8, torch.uint8)  # gather_rows also copies the integer formats' values (as bytes)


class LookupBackend(enum.StrEnum):
    """Which implementation `dequantize_gather` / `gather_rows` use (all give identical bytes)."""

    AUTO = "auto"  # numba for contiguous CPU tables, Triton on CUDA, else torch
    NUMBA = "numba"  # engram.kernels.cpu_lookup: fused, multi-threaded, CPU only
    TORCH = "torch"  # the reference twin, any device


def _cpu_kernels(backend: LookupBackend | str, *tables: torch.Tensor) -> ModuleType | None:
    """The numba kernel module if `backend` and the tables allow it, else None (the torch path).

    AUTO takes torch for tables off the CPU or not contiguous; NUMBA raises for them.
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
    from engram.kernels import cpu_lookup  # imports numba on the first CPU gather, not with engram

    return cpu_lookup


def _begin(
    rows: torch.Tensor,
    threads: int | None,
    out: torch.Tensor | None,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[int | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every gather starts with: the ids and `threads` checked, then the output. Returns (threads,
    the result (*rows.shape, dim), its (n, dim) view, the ids flat (n,))."""
    check_row_ids(rows, device)
    threads = check_threads(threads)
    result = prepare_out(out, (*rows.shape, dim), dtype, device)
    n = rows.numel()
    return threads, result, result.view(n, dim), rows.reshape(n)


def _distinct(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids the torch twin decodes: (the distinct ids sorted (u,), the inverse (n,) that expands them)
    when that halves the work or better, else (flat, None). Sorting also improves the gather's locality."""
    n = flat.numel()
    if n > 1:
        uniq, inv = torch.unique(flat, return_inverse=True)
        if 2 * uniq.numel() <= n:
            return uniq, inv
    return flat, None


def _decode_expand(
    decode: Callable[[torch.Tensor], None],
    ids: torch.Tensor,
    inverse: torch.Tensor | None,
    out2d: torch.Tensor,
) -> None:
    """decode(dst) writes the rows of `ids`, as `_distinct` gave them with `inverse`: into out2d [n, D]
    directly, or into a [u, D] scratch (u <= n / 2) then expanded into out2d by the inverse."""
    if inverse is None:
        decode(out2d)
    else:
        uniq_rows = torch.empty((ids.numel(), out2d.shape[1]), dtype=out2d.dtype, device=out2d.device)
        decode(uniq_rows)
        torch.index_select(uniq_rows, 0, inverse, out=out2d)


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
    fmt: RowFormat | str | None = None,
    dedup: bool = False,
) -> torch.Tensor:
    """Dequantise the table rows ``rows`` (int64/int32, any shape ``[...]``) of a whole table
    ``values [N, D]`` / ``scales [N, D // block]`` -> ``[..., D]`` in ``dtype``.

    Only the requested rows' bytes are gathered (the table may be huge or memory-mapped and is never
    converted as a whole).  ``backend``: ``"numba"`` runs the fused kernel of ``engram.kernels.cpu_lookup``
    (CPU, contiguous tables; ``threads`` threads, None = all cores from 2048 rows; repeated ids are decoded
    once per window of 1024 positions); ``"torch"`` is the reference twin (repeated ids are dequantised
    once when that halves the work or better, then expanded); ``"auto"`` takes numba where it can, and on CUDA
    with triton the Triton gather (`engram.kernels.fp8_gather`, which skips the NaN-scale check).  All
    give identical bits for finite tables.  ``dedup`` (the Triton FP8 gather only): sort the ids first, on
    the device without a sync (`kernels.dedup_order`), so that each repeated row is read once.  Raises
    ValueError for row ids outside [0, N), plus the checks of ``dequantize_rows``; after such an error
    ``out``'s contents are unspecified.

    ``fmt``: the row format (None: what the pair's dtypes say, `format_of`); the integer formats
    (``values [N, W]`` int8 or uint8 of 4-bit pairs, bfloat16 ``scales``) take `_gather_int`, the same
    backends with their own kernels, and refuse scales that are not finite and positive.
    """
    fmt = format_of(values, scales) if fmt is None else as_row_format(fmt)
    if fmt is not RowFormat.FP8:
        return _gather_int(fmt, values, scales, rows, dtype, out, backend, threads)
    dim, _ = check_fp8_pair(values, scales, block)
    check_dequant_dtype(dtype)
    if values.dim() != 2:
        raise ValueError(f"values must be a table [N, D], got shape {tuple(values.shape)}")
    threads, result, out2d, flat = _begin(rows, threads, out, dim, dtype, values.device)
    n_table, n = values.shape[0], flat.numel()
    if n == 0:
        return result
    auto = backend in (LookupBackend.AUTO, "auto") and dtype in (torch.float32, torch.bfloat16)
    if auto and kernels.use_triton(values, scales, flat):  # CUDA + triton: the fused Triton gather
        check_row_range(rows, n_table)  # sync point: the boundary check
        order = kernels.dedup_order(flat) if dedup else None
        kernels.fp8_gather(values, scales, flat, dtype, out=out2d, order=order)  # scale bytes are not checked
        return result
    module = _cpu_kernels(backend, values, scales)
    if module is not None and module.fp8_gather(
        values, scales, flat, out2d, resolve_threads(threads, n, _PARALLEL_MIN_ROWS)
    ):
        return result  # else a bad row id or NaN scale: the torch path below raises the reference's error

    # The torch path (the reference twin); also raises the errors the kernel found.
    check_row_range(rows, n_table)
    v_u8 = values.view(torch.uint8)  # [N, D] bytes; index_select on bytes avoids any fp8 kernel support
    s_u8 = scales.view(torch.uint8)  # [N, nb]

    ids, inverse = _distinct(flat)
    g_v = v_u8.index_select(0, ids)  # [u, D] uint8, only the requested rows
    g_s = s_u8.index_select(0, ids)  # [u, nb]
    check_scale_bytes(g_s, lambda r: f"table row {int(ids[r])}", block)
    _decode_expand(lambda dst: dequantize_into(g_v, g_s, block, dst), ids, inverse, out2d)
    return result


def _gather_int(
    fmt: RowFormat,
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    backend: LookupBackend | str,
    threads: int | None,
) -> torch.Tensor:
    """`dequantize_gather` for the integer formats: numba, Triton or the torch twin, identical bits."""
    dim, nb = check_pair(fmt, values, scales)
    check_dequant_dtype(dtype)
    if values.dim() != 2:
        raise ValueError(f"values must be a table [N, W], got shape {tuple(values.shape)}")
    threads, result, out2d, flat = _begin(rows, threads, out, dim, dtype, values.device)
    n_table, n = values.shape[0], flat.numel()
    if n == 0:
        return result
    auto = backend in (LookupBackend.AUTO, "auto") and dtype in (torch.float32, torch.bfloat16)
    if auto and kernels.use_triton(values, scales, flat):
        check_row_range(rows, n_table)  # sync point: the boundary check
        kernels.int_gather(values, scales, flat, dtype, out=out2d)  # scales are not checked
        return result
    if _cpu_kernels(backend, values, scales) is not None:
        from engram.kernels import cpu_lookup_int  # numba, on the first CPU gather

        four = fmt is RowFormat.INT4_BLOCK32
        if cpu_lookup_int.int_gather(
            values, scales, flat, out2d, four, resolve_threads(threads, n, _PARALLEL_MIN_ROWS)
        ):
            return result  # else a bad row id or scale: the torch path raises the reference's error

    check_row_range(rows, n_table)
    ids, inverse = _distinct(flat)
    g_v = values.index_select(0, ids)  # [u, W], only the requested rows
    g_s = scales.index_select(0, ids)  # [u, nb]
    check_int_scales(g_s, lambda r: f"table row {int(ids[r])}", dim // nb)
    _decode_expand(lambda dst: dequantize_int_into(g_v, g_s, fmt, dst), ids, inverse, out2d)
    return result


def gather_rows(
    weight: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: LookupBackend | str = LookupBackend.AUTO,
    threads: int | None = None,
) -> torch.Tensor:
    """Rows ``rows`` (int64/int32, any shape ``[...]``) of a plain table ``weight [N, D]`` (fp32, bf16, ...; or
    the int8 / uint8 values of quantised rows) -> ``[..., D]`` in the table's dtype, into ``out`` if given.

    The no-dequantisation twin of ``dequantize_gather`` (same backends and ``threads``), for inference
    and prefetch: the result carries no autograd history (train through ``F.embedding``).  The torch
    backend is ``index_select``.  Raises ValueError for row ids outside [0, N).
    """
    plain = isinstance(weight, torch.Tensor) and (weight.is_floating_point() or weight.dtype in _BYTE_TABLES)
    if not plain or weight.dim() != 2:
        found = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight)
        raise TypeError(
            f"weight must be a floating-point table [N, D] (or the int8 / uint8 values of quantised rows), got {found}"
        )
    weight = weight.detach()
    threads, result, out2d, flat = _begin(rows, threads, out, weight.shape[1], weight.dtype, weight.device)
    n = flat.numel()
    if n == 0:
        return result
    module = _cpu_kernels(backend, weight)
    if module is not None and module.rows_gather(
        weight, flat, out2d, resolve_threads(threads, n, _PARALLEL_MIN_ROWS)
    ):
        return result
    check_row_range(rows, weight.shape[0])
    with torch.no_grad():
        torch.index_select(weight, 0, flat, out=out2d)
    return result
