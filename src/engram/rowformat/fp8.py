"""The FP8 row format of Engram tables, its ue8m0 scale rule and the checks every gather shares (SPEC §5).

A row of width D is D float8 e4m3 values plus one ue8m0 scale byte per `BLOCK` (32) values: a
256-wide row takes 264 bytes. This module is the one vocabulary the quantiser, the gathers, the
tables, the kernels and the tiers import: block size, dtypes, bytes per row, the (values, scales)
pair check, the row-id check and the ue8m0 byte -> power-of-two rule (`scale_bytes_to_float`). It
imports torch alone, so the kernels below storage and storage itself share it. Design: docs/storage.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "BLOCK",
    "DEQUANT_DTYPES",
    "FP8_MAX",
    "ROW_ID_DTYPES",
    "SCALE_DTYPE",
    "VALUE_DTYPE",
    "check_block",
    "check_dequant_dtype",
    "check_fp8_pair",
    "check_row_ids",
    "check_row_range",
    "check_rows",
    "check_scale_bytes",
    "check_value_bytes",
    "exp2_bits",
    "fp8_row_bytes",
    "prepare_out",
    "scale_bytes_to_float",
]

BLOCK: int = 32  # values per ue8m0 scale byte
FP8_MAX: float = 448.0  # largest finite e4m3 value
VALUE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu
ROW_ID_DTYPES = (torch.int64, torch.int32)
DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")


def fp8_row_bytes(dim: int, block: int = BLOCK) -> int:
    """Bytes one stored row of width `dim` takes: `dim` fp8 values + `dim // block` scale bytes."""
    check_block(block)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0 or dim % block:
        raise ValueError(f"row width D={dim!r} must be a non-negative multiple of block={block}")
    return dim + dim // block


def _check_dtype(t: torch.Tensor, name: str, expected: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {expected}, got {type(t).__name__}")
    if t.dtype != expected:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {expected}")


def check_fp8_pair(values: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> tuple[int, int]:
    """Validate FP8 rows `values [..., D]` and their `scales [..., D // block]`; return (D, D // block)."""
    check_block(block)
    _check_dtype(values, "values", VALUE_DTYPE)
    _check_dtype(scales, "scales", SCALE_DTYPE)
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension [..., D]")
    dim = values.shape[-1]
    if dim % block:
        raise ValueError(f"row width D={dim} is not divisible by block={block}")
    nb = dim // block
    if scales.dim() != values.dim() or scales.shape[-1] != nb:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {(*values.shape[:-1], nb)} "
            f"(D // block = {dim} // {block} = {nb} scales per row)"
        )
    if scales.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"leading dims differ: values {tuple(values.shape[:-1])} vs scales {tuple(scales.shape[:-1])}"
        )
    if values.device != scales.device:
        raise ValueError(f"values on {values.device} but scales on {scales.device}")
    return dim, nb


def check_dequant_dtype(dtype: torch.dtype) -> None:
    if dtype not in DEQUANT_DTYPES:
        raise TypeError(
            f"dequantised dtype {dtype} is not supported, expected one of "
            f"{', '.join(str(d) for d in DEQUANT_DTYPES)}"
        )


def check_scale_bytes(s_u8: torch.Tensor, describe_row: Callable[[int], str], block: int = BLOCK) -> None:
    """Raise if any scale byte (uint8 [R, nb]) is 255 (NaN); `describe_row(r)` names row r."""
    bad = s_u8 == 255
    if bool(bad.any()):  # sync point on CUDA
        r, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"scale byte 255 (NaN scale) at {describe_row(r)}, block {j} "
            f"(columns {j * block}..{(j + 1) * block - 1}); a stored table must have finite scales"
        )


def check_value_bytes(v_u8: torch.Tensor, describe_row: Callable[[int], str]) -> None:
    """Raise if any value byte (uint8 [R, D]) is 0x7F / 0xFF (NaN in e4m3): the rule `check_scale_bytes`
    applies to scale byte 255, so no stored byte dequantises to NaN; `describe_row(r)` names row r."""
    bad = (v_u8 & 0x7F) == 0x7F
    if bool(bad.any()):  # sync point on CUDA
        r, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"value byte 0x{int(v_u8[r, c]):02X} (NaN in e4m3) at {describe_row(r)}, column {c}; a stored "
            "table must have finite values"
        )


def prepare_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`out` checked against the result's shape, dtype and device (contiguous), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device}")
    if not out.is_contiguous():
        # Results are written through a [rows, D] view, which only aliases a contiguous tensor.
        raise ValueError("out must be contiguous")
    return out


def check_row_ids(rows: torch.Tensor, device: torch.device | None = None) -> None:
    """Raise unless `rows` is an int64 / int32 tensor (on `device` when given); no device sync."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor of int64 or int32 row ids, got {type(rows).__name__}")
    if rows.dtype not in ROW_ID_DTYPES:
        raise TypeError(f"rows must be int64 or int32 row ids, got {rows.dtype}")
    if device is not None and rows.device != device:
        raise ValueError(f"rows are on {rows.device} but the table is on {device}; move one of them")


def check_row_range(rows: torch.Tensor, num_rows: int) -> None:
    """Raise for the first row id outside [0, num_rows), naming it and its position."""
    if rows.numel() == 0:
        return
    lo, hi = torch.aminmax(rows)  # one pass; a sync point on CUDA: the boundary check
    if int(lo) < 0 or int(hi) >= num_rows:
        bad = (rows < 0) | (rows >= num_rows)
        pos = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"row id {int(rows[pos])} at position {pos} is out of range [0, {num_rows}), outside this table's rows; "
            "were the rows hashed for this layer with this config?"
        )


def check_rows(rows: torch.Tensor, num_rows: int, device: torch.device | None = None) -> None:
    """The row-id check of every gather: int64 / int32 ids (on `device`), each in [0, num_rows)."""
    check_row_ids(rows, device)
    check_row_range(rows, num_rows)


# ------------------------------------------------------------------------------------- ue8m0 rules


def exp2_bits(b: torch.Tensor) -> torch.Tensor:
    """Scale bytes (uint8 / int, any shape) -> float32 ``2**(b - 127)``, built exactly from the bits.

    For b in 1..254 the float32 with exponent field b and zero mantissa is exactly 2**(b - 127).
    b = 0 is the subnormal 2**-127 (mantissa bit 22 alone); b = 255 is NaN (quiet NaN bits).
    """
    bi = b.to(torch.int32)
    bits = bi << 23
    bits = torch.where(bi == 0, torch.full_like(bits, 1 << 22), bits)
    bits = torch.where(bi == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_bytes_to_float(scales: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (``float8_e8m0fnu`` or raw ``uint8`` bytes, any shape) -> float32 ``2**(b - 127)``.

    Exact for every byte; byte 0 gives the subnormal 2**-127 and byte 255 gives NaN (this helper does not
    raise; the dequantisers do).
    """
    if not isinstance(scales, torch.Tensor) or scales.dtype not in (SCALE_DTYPE, torch.uint8):
        found = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"scales has dtype {found}, expected {SCALE_DTYPE} (or raw torch.uint8 bytes)")
    return exp2_bits(scales.view(torch.uint8))
