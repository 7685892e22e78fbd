"""The float rows both quantisers take (`quant.quantize_rows`, `quant_int.quantize_int_rows`): the checks
of x, the names of its rows in errors, and the walk over bounded chunks in float32 that stops at the first
value that is not finite. Knows nothing of any row format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["QUANT_IN_DTYPES", "check_float_rows", "float32_chunks", "row_name"]

QUANT_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float_rows(x: torch.Tensor) -> None:
    """TypeError unless x is a tensor of a dtype in QUANT_IN_DTYPES; ValueError for a 0-d x."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANT_IN_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}, expected one of {', '.join(str(d) for d in QUANT_IN_DTYPES)}"
        )
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., D]")


def row_name(flat_row: int, lead_shape: tuple[int, ...]) -> str:
    """Human name of a row of ``[..., D]``: its leading index, plus the flat row index if that differs."""
    if len(lead_shape) == 0:
        return "the (only) row"
    if len(lead_shape) == 1:
        return f"row {flat_row}"
    idx, rest = [], flat_row
    for size in reversed(lead_shape):
        idx.append(rest % size)
        rest //= size
    return f"row {tuple(reversed(idx))} (flat row {flat_row})"


def float32_chunks(
    x2: torch.Tensor, step: int, who: str, name: Callable[[int], str]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """x2 [R, D] in chunks of `step` rows: (start, stop, x2[start:stop] as float32 [r, D]), so temporaries
    stay bounded by a chunk. Raises ValueError (from `who`, naming the row by `name(flat row)`) at the
    first value that is NaN or inf, or for float64, beyond float32's range."""
    n_rows = x2.shape[0]
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        xf = x2[start:stop].float()  # [r, D]; float64 beyond fp32 range becomes inf here
        finite = torch.isfinite(xf)
        if not bool(finite.all()):
            i, c = (int(v) for v in (~finite).nonzero()[0])
            orig = x2[start + i, c].item()
            why = "is not finite" if not torch.isfinite(x2[start + i, c]) else "overflows float32"
            raise ValueError(
                f"{who}: x at {name(start + i)}, column {c} is {orig!r}, which {why}; an Engram table must be finite"
            )
        yield start, stop, xf
