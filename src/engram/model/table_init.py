"""Row-addressed initial values of an Engram table: row r of layer l's table depends on (seed, l, r)
only, never on the world size, the process, or what was drawn before it.

`chunked_normal` draws rows [lo, hi) of a normal(0, std) table in fixed chunks of `INIT_CHUNK_ROWS`
rows, each from its own seeded generator, so any split of the rows (one process, N ranks each drawing
its own) gives the same table bit for bit. `table_seed(seed, layer_id)` is a layer's stream; `RowInit`
is the whole recipe of one table (what a lazy `TrainableTable` and a born-sharded one record, and what
ranks compare instead of the table's values). Knows tensors and seeds, nothing of modules or processes.
Design: docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from engram.storage import hugepages

__all__ = ["INIT_CHUNK_ROWS", "INIT_RECIPE", "RowInit", "chunked_normal", "table_seed"]

# Rows per initialisation chunk: fixed, so a table's initial values do not depend on the world size.
INIT_CHUNK_ROWS = 1 << 16
"""Rows per initialisation chunk of `chunked_normal`.

Fixed, so a table's initial values do not depend on the world size.
"""
# The name of the recipe below, in what ranks compare: change it with the recipe (chunk size, stream).
INIT_RECIPE = f"normal in chunks of {INIT_CHUNK_ROWS} rows, stream seed * 1000003 + chunk"


def table_seed(seed: int, layer_id: int) -> int:
    """Layer `layer_id`'s stream of a model seeded with `seed` (one stream per layer)."""
    return seed + 10007 * layer_id


def chunked_normal(
    lo: int,
    hi: int,
    dim: int,
    *,
    std: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [lo, hi) of a normal(0, std) table drawn by chunks: any split of the rows gives the same values.

    Chunk c (rows c*INIT_CHUNK_ROWS ..) is drawn whole (in fp32, on the CPU) from a generator seeded
    with (seed, c), so any split of the rows, and any table length, gives the same values. Cost: up to
    one extra chunk drawn per end; memory: one chunk beside `out`.

    Args:
        lo: The first row.
        hi: One past the last row.
        dim: Width of a row.
        std: The standard deviation.
        seed: The table's seed (`table_seed` of a model seed and a layer).
        dtype: The result's dtype (without `out`).
        device: The result's device (without `out`).
        out: Written into when given (its dtype and device then rule).

    Returns:
        The rows (hi - lo, dim): `out` when given.

    Raises:
        ValueError: Not 0 <= lo <= hi, dim below 1, or `out` of the wrong shape.

    Examples:
        >>> import torch
        >>> from engram.distributed import chunked_normal
        >>> whole = chunked_normal(0, 1000, 8, seed=3)
        >>> torch.equal(whole[400:700], chunked_normal(400, 700, 8, seed=3))
        True
    """
    if not 0 <= lo <= hi or dim < 1:
        raise ValueError(f"chunked_normal needs 0 <= lo <= hi and dim >= 1, got lo={lo}, hi={hi}, dim={dim}")
    if out is None:
        out = hugepages.empty((hi - lo, dim), dtype=dtype, device=device)
    elif tuple(out.shape) != (hi - lo, dim):
        raise ValueError(
            f"chunked_normal: out has shape {tuple(out.shape)}, rows [{lo}, {hi}) need {(hi - lo, dim)}"
        )
    gen = torch.Generator()
    for c in range(lo // INIT_CHUNK_ROWS, (hi - 1) // INIT_CHUNK_ROWS + 1 if hi > lo else 0):
        c0 = c * INIT_CHUNK_ROWS
        a, b = max(lo, c0), min(hi, c0 + INIT_CHUNK_ROWS)
        gen.manual_seed(seed * 1_000_003 + c)  # one stream per chunk (distinct for < 1e6 chunks)
        # Always the whole chunk: randn's vectorised sampler makes a shorter draw no prefix of a longer one.
        chunk = torch.randn(INIT_CHUNK_ROWS, dim, generator=gen).mul_(std)  # (INIT_CHUNK_ROWS, dim)
        out[a - lo : b - lo].copy_(chunk[a - c0 : b - c0])
    return out


@dataclasses.dataclass(frozen=True)
class RowInit:
    """How a table [num_rows, dim] starts: `chunked_normal` rows of `std` from `seed` (the layer's
    stream, `table_seed`), stored in `dtype` on `device`. A lazy table records it instead of its rows;
    ranks that agree on `describe()` (a few bytes) hold the same table without comparing a row."""

    num_rows: int
    dim: int
    std: float
    seed: int
    dtype: torch.dtype = torch.float32
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"a table needs num_rows >= 1 and dim >= 1, got {self.num_rows} x {self.dim}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not abs(self.seed) < 1 << 40:
            raise ValueError(f"a table's seed must be an int of magnitude below 2**40, got {self.seed!r}")
        std = self.std
        if (
            isinstance(std, bool)
            or not isinstance(std, int | float)
            or not (math.isfinite(std) and 0 <= std <= 1)
        ):
            raise ValueError(f"a table's init std must be a finite number in [0, 1], got {std!r}")

    def rows(self, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [lo, hi) of the table (hi - lo, dim), in `dtype` on `device` (or into `out`)."""
        if not 0 <= lo <= hi <= self.num_rows:
            raise ValueError(f"rows [{lo}, {hi}) are not rows of a table of {self.num_rows}")
        return chunked_normal(
            lo, hi, self.dim, std=self.std, seed=self.seed, dtype=self.dtype, device=self.device, out=out
        )

    def describe(self) -> str:
        """What ranks compare: shape, dtype, std, seed and the recipe's name (not the device: ranks
        of one group each have their own)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{dtype} ({self.num_rows}, {self.dim}) normal(0, {self.std!r}) seed {self.seed}; {INIT_RECIPE}"
        )
