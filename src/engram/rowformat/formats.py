"""The row formats a stored Engram table may take, beside V4.1's FP8 (`engram.rowformat.fp8`).

`RowFormat` names each: FP8 e4m3 + ue8m0 per 32 (264 B a 256-wide row), INT8 with one bfloat16 scale
per 32 values (272 B) or per row (258 B), and 4-bit integers two to a byte with one bfloat16 scale per
32 values (144 B, 0.545x FP8). Per format: the values' and scales' dtypes, bytes per row (values then
scales), the numeric code a row file's header records, the (values, scales) pair check, the format a
pair's dtypes say it is, and the integer formats' scale check (finite and positive). The rounding
rules are `engram.storage.quant_int`'s; the layout and decisions are in docs/storage.md.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from engram.rowformat.fp8 import BLOCK, SCALE_DTYPE, VALUE_DTYPE, check_fp8_pair

__all__ = [
    "INT_SCALE_DTYPE",
    "RowFormat",
    "as_row_format",
    "check_int_scales",
    "check_pair",
    "format_of",
]

INT_SCALE_DTYPE = torch.bfloat16  # the integer formats' scales: float32's range, so any finite table fits


class RowFormat(enum.StrEnum):
    """How one stored row of width D is laid out: D values (packed), then its scales."""

    FP8 = "fp8"  # D float8_e4m3fn + D / 32 ue8m0 bytes (SPEC §5)
    INT8_BLOCK32 = "int8"  # D int8 + D / 32 bfloat16 scales
    INT8_ROW = "int8-row"  # D int8 + 1 bfloat16 scale
    INT4_BLOCK32 = "int4"  # D / 2 bytes of two 4-bit ints + D / 32 bfloat16 scales (docs/storage.md)

    @property
    def code(self) -> int:
        """The number a row file's header records (stable: never renumber)."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> RowFormat | None:
        """The format a header's code names, None for a code this engram does not know."""
        return next((f for f, c in _CODES.items() if c == code), None)

    @property
    def value_dtype(self) -> torch.dtype:
        """The values tensor's dtype: e4m3, int8, or uint8 bytes of two 4-bit ints."""
        return {RowFormat.FP8: VALUE_DTYPE, RowFormat.INT4_BLOCK32: torch.uint8}.get(self, torch.int8)

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPE if self is RowFormat.FP8 else INT_SCALE_DTYPE

    @property
    def values_per_byte(self) -> int:
        return 2 if self is RowFormat.INT4_BLOCK32 else 1

    @property
    def qmax(self) -> int:
        """The largest |integer| the quantiser writes (FP8: the largest finite e4m3, 448)."""
        return {RowFormat.FP8: 448, RowFormat.INT4_BLOCK32: 7}.get(self, 127)

    def check_dim(self, dim: int) -> None:
        """Raise unless `dim` is a row width this format stores (a positive multiple of 32)."""
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim % BLOCK:
            raise ValueError(
                f"row width D={dim!r} must be a positive multiple of {BLOCK} for format {self.value}"
            )

    def block(self, dim: int) -> int:
        """Values per scale: the whole row for INT8_ROW, else 32."""
        self.check_dim(dim)
        return dim if self is RowFormat.INT8_ROW else BLOCK

    def scales_per_row(self, dim: int) -> int:
        return dim // self.block(dim)

    def value_bytes(self, dim: int) -> int:
        """Bytes of one row's values."""
        self.check_dim(dim)
        return dim // self.values_per_byte

    def value_width(self, dim: int) -> int:
        """The values tensor's last dimension (its elements are bytes in every format)."""
        return self.value_bytes(dim)

    def scale_bytes(self, dim: int) -> int:
        """Bytes of one row's scales."""
        return self.scales_per_row(dim) * self.scale_dtype.itemsize

    def row_bytes(self, dim: int) -> int:
        """Bytes one stored row takes: 264 (FP8), 272 (INT8), 258 (INT8_ROW), 144 (INT4) at D = 256."""
        return self.value_bytes(dim) + self.scale_bytes(dim)

    def same_bytes(self, other: RowFormat, dim: int) -> bool:
        """Whether rows of width `dim` are the same bytes in both formats (int8 and int8-row at D = 32)."""
        return self is other or (
            self.value_dtype == other.value_dtype
            and self.scale_dtype == other.scale_dtype
            and self.block(dim) == other.block(dim)
        )

    def dim_of(self, value_width: int) -> int:
        """The row width a values tensor of last dimension `value_width` holds."""
        return value_width * self.values_per_byte


_CODES = {RowFormat.FP8: 0, RowFormat.INT8_BLOCK32: 1, RowFormat.INT8_ROW: 2, RowFormat.INT4_BLOCK32: 3}


def as_row_format(name: RowFormat | str, where: str = "format") -> RowFormat:
    """`name` as a RowFormat; ValueError listing the formats there are (`where` names the argument)."""
    try:
        return RowFormat(name)
    except ValueError:
        known = ", ".join(f.value for f in RowFormat)
        raise ValueError(
            f"{where}={name!r} is not a row format this engram knows; choose one of {known}"
        ) from None


def format_of(values: torch.Tensor, scales: torch.Tensor) -> RowFormat:
    """The format a (values, scales) pair's dtypes and widths say it is: e4m3 -> FP8, uint8 -> INT4,
    int8 -> INT8_ROW with one scale a row (unless the row is one block wide), else INT8; raises for others."""
    for t, name in ((values, "values"), (scales, "scales")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if values.dtype == VALUE_DTYPE:
        return RowFormat.FP8
    if values.dtype == torch.uint8:
        return RowFormat.INT4_BLOCK32
    if values.dtype == torch.int8:
        one_block = values.dim() > 0 and values.shape[-1] == BLOCK
        return (
            RowFormat.INT8_ROW
            if scales.dim() > 0 and scales.shape[-1] == 1 and not one_block
            else RowFormat.INT8_BLOCK32
        )
    raise TypeError(
        f"values of dtype {values.dtype} are no row format's: expected {VALUE_DTYPE} (fp8), torch.int8 "
        "(int8, int8-row) or torch.uint8 (int4, two values a byte)"
    )


def check_pair(fmt: RowFormat, values: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """Validate rows `values [..., W]` / `scales [..., S]` of format `fmt`; return (D, S), D the row width."""
    if fmt is RowFormat.FP8:
        return check_fp8_pair(values, scales)
    for t, name, expected in ((values, "values", fmt.value_dtype), (scales, "scales", fmt.scale_dtype)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of dtype {expected}, got {type(t).__name__}")
        if t.dtype != expected:
            hint = ""
            if name == "values" and t.dtype in (torch.int8, torch.uint8, VALUE_DTYPE):
                hint = f" (these are {format_of(values, scales).value} values, not {fmt.value})"
            raise TypeError(f"{name} has dtype {t.dtype}, expected {expected} for format {fmt.value}{hint}")
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension [..., W]")
    dim = fmt.dim_of(values.shape[-1])
    if dim % BLOCK or dim == 0:
        raise ValueError(
            f"values are {values.shape[-1]} bytes a row: {dim} values in format {fmt.value}, not a positive "
            f"multiple of {BLOCK}"
        )
    nb = fmt.scales_per_row(dim)
    if scales.dim() != values.dim() or scales.shape[-1] != nb or scales.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {(*values.shape[:-1], nb)} "
            f"({nb} scale(s) a row of {dim} values in format {fmt.value})"
        )
    if values.device != scales.device:
        raise ValueError(f"values on {values.device} but scales on {scales.device}")
    return dim, nb


def check_int_scales(scales: torch.Tensor, describe_row: Callable[[int], str], block: int) -> None:
    """Raise if any bfloat16 scale of `scales` [R, S] is not finite and positive (NaN, inf, zero or
    negative: none of them the quantiser writes); `describe_row(r)` names row r."""
    bad = ~((scales > 0) & ~torch.isinf(scales))
    if bool(bad.any()):  # sync point on CUDA
        r, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"scale {float(scales[r, j])} at {describe_row(r)}, block {j} (columns {j * block}.."
            f"{(j + 1) * block - 1}); a stored table's scales are finite and positive"
        )
