"""Engram tables: one physical table per Engram layer, rows addressed by `NgramHasher` rows.

`EngramTable` is the interface every table kind implements (`num_rows`, `dim`, `gather`);
`TrainableTable` (a parameter with sparse gradients), `FP8Table` (frozen FP8 buffers) and `QuantTable`
(frozen buffers of any row format: FP8, INT8, 4-bit) implement it here; the file-backed `MmapFP8Table`
and `MmapQuantTable` live where files are known (`engram.checkpoint.mmap_table`).
This file only stores tables and routes rows to them: dequantisation is `engram.storage.quant`'s, row
gathers `engram.storage.lookup`'s. Design: docs/model.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.table_init import RowInit
from engram.rowformat.formats import RowFormat, as_row_format, check_pair, format_of
from engram.rowformat.fp8 import BLOCK, SCALE_DTYPE, VALUE_DTYPE, check_rows
from engram.storage import hugepages, lookup, quant
from engram.storage.integrity import check_quant_table
from engram.storage.outpool import OutputPool

__all__ = [
    "EngramTable",
    "FP8Table",
    "QuantTable",
    "TrainableTable",
    "dequantize_table",
    "fp8_table_shape",
    "gather_fp8",
    "quant_table_shape",
    "quantize_table",
    "requantize_table",
]

# Rows per chunk when quantising / dequantising a whole table: bounds the float temporaries to a
# few tens of MiB whatever the table size.
_CHUNK_ROWS = 1 << 16


class EngramTable(nn.Module):
    """The interface every table kind implements: `num_rows`, `dim` and `gather(rows)` -> [..., dim].

    Offload (`engram.systems`), memory-mapped files (`engram.checkpoint.mmap_table`) and sharding
    (`engram.distributed`) each give an `Engram` module another kind by swapping its `table`.
    """

    num_rows: int
    dim: int

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The embeddings of rows.

        Args:
            rows: Row ids of any shape, int64 or int32, each in [0, num_rows).
            dtype: The embeddings' dtype (None: the table's own, or float32 for a stored format).

        Returns:
            The embeddings, (..., dim).

        Raises:
            NotImplementedError: Always, here: every table kind implements it.
        """
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, dim={self.dim}"


class TrainableTable(EngramTable):
    """A dense parameter [num_rows, dim] whose gradient is sparse: it touches only looked-up rows.

    Repeated row ids in a batch are gathered once (torch.unique), which also makes the sparse
    gradient carry one entry per distinct row.

    A lazy table records how its rows are drawn in `recipe` (a `RowInit`, which `.to()` / `.double()`
    update), and the first read of `weight` (a gather, a state_dict, an optimizer built over it)
    draws the rows; a row-sharded table draws only its own (`engram.distributed`). A lazy table is
    not among the module's parameters until then, so a forward that records gradients refuses to be
    its first use (an optimizer built before would silently leave it out); a forward under
    `torch.no_grad()` draws it.

    Args:
        num_rows: Rows of the table.
        dim: Width of a row.
        dtype: float32, bfloat16, or float64 (for checks).
        device: Where the parameter lives.
        init_std: The rows' normal standard deviation.
        seed: `table_init.table_seed` of a model seed and the layer: the rows are
            `table_init.chunked_normal`'s, so row r depends on (seed, r) only and N ranks each
            drawing their own rows hold this table between them. None: `nn.init.normal_` from
            torch's generator.
        lazy: With a seed: no memory until first used.

    Raises:
        ValueError: A size below 1, or `lazy` without a seed.
        TypeError: `dtype` is not one a trainable table takes.

    Examples:
        >>> import torch
        >>> from engram import TrainableTable
        >>> table = TrainableTable(100, 64, seed=0, lazy=True)
        >>> table.is_lazy
        True
        >>> with torch.no_grad():
        ...     table.gather(torch.tensor([[1, 2, 2]])).shape
        torch.Size([1, 3, 64])
        >>> table.is_lazy
        False
    """

    recipe: RowInit | None

    def __init__(
        self,
        num_rows: int,
        dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_std: float = 0.02,
        seed: int | None = None,
        lazy: bool = False,
    ) -> None:
        super().__init__()
        if num_rows < 1 or dim < 1:
            raise ValueError(f"a table needs num_rows >= 1 and dim >= 1, got {num_rows} x {dim}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise TypeError(f"a trainable table is fp32, bf16 (or fp64 for checks), got {dtype}")
        if lazy and seed is None:
            raise ValueError("a lazy table draws its rows when first used, from seed=... (pass one)")
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.init_std, self.seed = init_std, seed
        self.recipe = None
        if seed is not None:
            where = torch.device("cpu") if device is None else torch.device(device)
            self.recipe = RowInit(self.num_rows, self.dim, init_std, seed, dtype, where)
            if not lazy:
                self.materialize()
            return
        self.weight = nn.Parameter(hugepages.empty((num_rows, dim), dtype=dtype, device=device))
        self.reset_parameters()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, init_std: float = 0.02) -> TrainableTable:
        """A table whose parameter is `weight` itself (no copy, no initialisation).

        Args:
            weight: The table [num_rows, dim] (detached).
            init_std: Recorded as the table's `init_std` (used by `reset_parameters`).

        Returns:
            The table.

        Raises:
            ValueError: `weight` is not a 2-D tensor.
        """
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            found = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"from_weight needs a table [num_rows, dim], got {found}")
        table = cls.__new__(cls)
        EngramTable.__init__(table)
        table.num_rows, table.dim = int(weight.shape[0]), int(weight.shape[1])
        table.weight = nn.Parameter(weight.detach())
        table.init_std, table.seed, table.recipe = init_std, None, None
        return table

    @property
    def is_lazy(self) -> bool:
        """Whether the rows are still to be drawn (`recipe` kept, no `weight` yet)."""
        return "weight" not in self._parameters

    def materialize(self) -> nn.Parameter:
        """The parameter, drawing the rows of a lazy table first.

        The whole table is drawn, with one chunk of temporaries beside it.

        Returns:
            The `weight` parameter.
        """
        if self.is_lazy:
            assert self.recipe is not None
            self._set_weight(self.recipe.rows(0, self.num_rows))
        return self._parameters["weight"]  # type: ignore[return-value]

    def _set_weight(self, values: torch.Tensor) -> None:
        self.__dict__["_setting"] = True  # register_parameter asks hasattr(self, "weight") first
        try:
            self.weight = nn.Parameter(values)
        finally:
            del self.__dict__["_setting"]

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if name == "weight" and d.get("recipe") is not None and "_setting" not in d and self.is_lazy:
            return self.materialize()  # first use of a lazy table
        return super().__getattr__(name)

    def reset_parameters(self) -> None:
        """Draw the rows again: normal(0, init_std), or the seeded recipe's rows (a lazy table stays lazy)."""
        if self.seed is None:
            nn.init.normal_(self.weight, std=self.init_std)
        elif not self.is_lazy:
            assert self.recipe is not None
            with torch.no_grad():
                self.recipe.rows(0, self.num_rows, out=self.weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TrainableTable:
        if self.is_lazy and self.recipe is not None:
            # what `fn` (a parent's .to(device) / .double()) does to a weight: probed on an empty one
            p = self.recipe
            probe = fn(torch.empty((0, self.dim), dtype=p.dtype, device=p.device))
            self.recipe = dataclasses.replace(p, dtype=probe.dtype, device=probe.device)
        return super()._apply(fn, recurse)  # type: ignore[return-value]

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.materialize()  # a state_dict is a use: it holds the rows
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        if self.is_lazy and self.recipe is not None and prefix + "weight" in state_dict:
            p = self.recipe  # the rows come from the state: room for them, nothing drawn
            self._set_weight(hugepages.empty((self.num_rows, self.dim), dtype=p.dtype, device=p.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def extra_repr(self) -> str:
        lazy = f", lazy (seed {self.seed})" if self.is_lazy else ""
        return f"num_rows={self.num_rows}, dim={self.dim}{lazy}"

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The embeddings of rows; with gradients, each distinct row is gathered once (sparse gradient).

        Args:
            rows: Row ids of any shape, int64 or int32, each in [0, num_rows).
            dtype: The embeddings' dtype (None: the table's).

        Returns:
            The embeddings, (..., dim).

        Raises:
            TypeError: `rows` is not an int64 or int32 tensor.
            ValueError: A row id is outside [0, num_rows).
            RuntimeError: The table is lazy and this is its first use, in a forward that records
                gradients (draw it first: `materialize`, `engram.hf.build_optimizer` or
                `engram.distributed.prepare_data_parallel`).
        """
        check_rows(rows, self.num_rows)
        if self.is_lazy and torch.is_grad_enabled():
            raise RuntimeError(
                f"this {self.num_rows} x {self.dim} table is lazy (seed {self.seed}: drawn at its first use) "
                "and its first use is a forward that records gradients: an optimizer built over "
                "model.parameters() before now does not hold it, so it would never train. Draw it first: "
                "engram.distributed.prepare_data_parallel(model, ...) under several processes (each rank "
                "draws its own rows), engram.hf.build_optimizer(model), or table.materialize(); or make it "
                "drawn at once (add_engram(..., lazy_tables=False))"
            )
        if not (torch.is_grad_enabled() and self.weight.requires_grad):  # no gradient: a plain gather
            emb = F.embedding(rows, self.weight)
        else:
            uniq, inverse = torch.unique(rows, return_inverse=True)  # (U,), rows.shape
            emb = F.embedding(uniq, self.weight, sparse=True)  # (U, dim)
            # index_select, not emb[inverse]: its backward sums repeated rows in a fixed order, where
            # advanced indexing's multi-threaded backward does not (training would not be reproducible)
            emb = emb.index_select(0, inverse.reshape(-1)).view(*rows.shape, self.dim)  # (..., dim)
        return emb if dtype is None or emb.dtype == dtype else emb.to(dtype)


# ------------------------------------------------------------------------------------------ FP8 tables


def fp8_table_shape(values: torch.Tensor, scales: torch.Tensor, what: str) -> tuple[int, int]:
    """Validate a stored FP8 table pair; return (num_rows, dim). `what` names it in errors."""
    for t, name, expected in ((values, "values", VALUE_DTYPE), (scales, "scales", SCALE_DTYPE)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what}: {name} must be a torch.Tensor of dtype {expected}, got {type(t).__name__}"
            )
        if t.dtype != expected:
            raise TypeError(f"{what}: {name} has dtype {t.dtype}, expected {expected}")
    if values.dim() != 2 or values.shape[0] < 1 or values.shape[1] < 1:
        raise ValueError(
            f"{what}: values must be a table [rows >= 1, dim >= 1], got shape {list(values.shape)}"
        )
    rows, dim = values.shape
    if dim % BLOCK:
        raise ValueError(
            f"{what}: row width {dim} is not a multiple of {BLOCK} (one ue8m0 scale per {BLOCK} values)"
        )
    expected_scales = [rows, dim // BLOCK]
    if list(scales.shape) != expected_scales:
        raise ValueError(
            f"{what}: scales have shape {list(scales.shape)}, expected {expected_scales} "
            f"(one scale per {BLOCK} values of each of the {rows} rows)"
        )
    if values.device != scales.device:
        raise ValueError(f"{what}: values on {values.device} but scales on {scales.device}")
    return int(rows), int(dim)


def gather_fp8(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype | None,
    pool: OutputPool | None = None,
) -> torch.Tensor:
    """lookup.dequantize_gather (rows of any row format, the format the pair's dtypes say), plus float64
    output (dequantised exactly in fp32, then widened); a CPU output comes from `pool` (no fresh pages to
    fault in: see engram.storage.outpool)."""
    dtype = torch.float32 if dtype is None else dtype
    if dtype == torch.float64:
        return lookup.dequantize_gather(values, scales, rows, torch.float32).double()
    out = None
    cpu = values.device.type == "cpu" and values.dim() == 2 and isinstance(rows, torch.Tensor)
    if pool is not None and cpu and dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = pool.empty((*rows.shape, format_of(values, scales).dim_of(values.shape[1])), dtype)
    return lookup.dequantize_gather(values, scales, rows, dtype, out)


def dequantize_table(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole table [rows, dim] in `dtype`, dequantised chunk by chunk (bounded temporaries); any row
    format (the pair's dtypes say which)."""
    fmt = format_of(values, scales)
    n, dim = values.shape[0], fmt.dim_of(values.shape[1])
    work = torch.float32 if dtype == torch.float64 else dtype
    out = torch.empty((n, dim), dtype=dtype, device=values.device)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        v, sc = values[start:stop], scales[start:stop]
        if work == dtype:
            quant.dequantize(v, sc, dtype, out=out[start:stop], fmt=fmt)
        else:
            out[start:stop] = quant.dequantize(v, sc, work, fmt=fmt)
    return out


def quantize_table(weight: torch.Tensor, fmt: RowFormat | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float table [rows, dim] (fp32/bf16/fp16/fp64) quantised to row format `fmt` in chunks (bounded
    temporaries): (values, scales) on the table's device."""
    fmt = as_row_format(fmt)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        found = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"quantising needs a float table [rows, dim], got {found}")
    weight = weight.detach()
    n, dim = weight.shape
    if dim % BLOCK or dim == 0:
        raise ValueError(
            f"row width {dim} is not a multiple of {BLOCK}; {fmt.value} rows need dim % 32 == 0 and dim > 0"
        )
    values = torch.empty((n, fmt.value_width(dim)), dtype=fmt.value_dtype, device=weight.device)
    scales = torch.empty((n, fmt.scales_per_row(dim)), dtype=fmt.scale_dtype, device=weight.device)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        v, sc = quant.quantize(weight[start:stop], fmt)
        values[start:stop].copy_(v)
        scales[start:stop].copy_(sc)
    return values, scales


def requantize_table(
    values: torch.Tensor, scales: torch.Tensor, fmt: RowFormat | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored table (any row format, e.g. memory-mapped) in row format `fmt`: each chunk of rows
    dequantised to float32 (exact for FP8) and quantised again, so the whole table is never float; the
    bytes as they are when it already is `fmt`."""
    fmt, src = as_row_format(fmt), format_of(values, scales)
    n, dim = values.shape[0], src.dim_of(values.shape[1])
    if src.same_bytes(fmt, dim):
        return values.view(fmt.value_dtype), scales
    out_v = torch.empty((n, fmt.value_width(dim)), dtype=fmt.value_dtype, device=values.device)
    out_s = torch.empty((n, fmt.scales_per_row(dim)), dtype=fmt.scale_dtype, device=values.device)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        x = quant.dequantize(values[start:stop], scales[start:stop], torch.float32, fmt=src)
        out_v[start:stop], out_s[start:stop] = quant.quantize(x, fmt)
    return out_v, out_s


def quant_table_shape(
    values: torch.Tensor, scales: torch.Tensor, fmt: RowFormat, what: str
) -> tuple[int, int]:
    """Validate a stored table pair of row format `fmt`; return (num_rows, dim). `what` names it in errors."""
    if fmt is RowFormat.FP8:
        return fp8_table_shape(values, scales, what)
    try:
        dim, _ = check_pair(fmt, values, scales)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None
    if values.dim() != 2 or values.shape[0] < 1:
        raise ValueError(f"{what}: values must be a table [rows >= 1, width], got shape {list(values.shape)}")
    return int(values.shape[0]), int(dim)


_BUILD_FIX = "every stored byte must dequantise to a finite number: quantise float rows with from_float"


class QuantTable(EngramTable):
    """A frozen table of any row format (`engram.rowformat.formats.RowFormat`): values [rows, width] and
    scales [rows, scales a row] as buffers `weight` / `scale`, as `FP8Table` keeps FP8 (which this also
    holds). INT8 rows: int8 values, one bfloat16 scale per 32 values or per row; 4-bit rows: uint8 bytes
    of two values, one bfloat16 scale per 32. `.half()` / `.to(bf16)` on a parent move the device only.
    """

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        fmt: RowFormat | str | None = None,
        *,
        what: str = "",
        check: bool = True,
    ) -> None:
        super().__init__()
        self.row_format = format_of(values, scales) if fmt is None else as_row_format(fmt)
        what = what or f"QuantTable({self.row_format.value})"
        self.num_rows, self.dim = quant_table_shape(values, scales, self.row_format, what)
        # one rule for values and scales: no byte that dequantises to NaN (one pass over the bytes); a
        # loader passes check=False and scans them itself, naming the file, within its scan limit
        if check and not values.is_meta:
            check_quant_table(values, scales, self.row_format, what, _BUILD_FIX)
        self.register_buffer("weight", values)  # (rows, width) in the format's value dtype
        self.register_buffer("scale", scales)  # (rows, scales a row) in its scale dtype
        self.out_pool = OutputPool()  # reused CPU outputs of gather (a plain attribute, not state)

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: RowFormat | str = RowFormat.FP8) -> QuantTable:
        """Quantise a float table to a row format (`quant.quantize`'s rule), in chunks.

        Args:
            weight: A float table [rows, dim], dim a multiple of 32.
            fmt: The row format (a `RowFormat` or its value).

        Returns:
            The table.
        """
        fmt = as_row_format(fmt)
        return cls(*quantize_table(weight, fmt), fmt)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table dequantised, chunk by chunk.

        Args:
            dtype: The result's dtype.

        Returns:
            The table [rows, dim] in `dtype`.
        """
        return dequantize_table(self.weight, self.scale, dtype)

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantised embeddings of rows.

        Repeated ids are dequantised once (lookup.dequantize_gather); ids outside [0, rows) raise.

        Args:
            rows: Row ids (...) int64/int32 on the table's device.
            dtype: The embeddings' dtype (default float32).

        Returns:
            The embeddings (..., dim) in `dtype`.
        """
        return gather_fp8(self.weight, self.scale, rows, dtype, self.out_pool)

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, dim={self.dim}, format={self.row_format.value}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantTable:
        for name in ("weight", "scale"):  # as FP8Table: a dtype change takes only the device
            t = self._buffers[name]
            assert t is not None
            probe = fn(torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=t.device))
            self._buffers[name] = fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)
        return self


class FP8Table(QuantTable):
    """A frozen table of FP8 e4m3 values with one ue8m0 scale per 32 values: V4.1's own format.

    The `QuantTable` of FP8 rows: values [rows, dim], scales [rows, dim // 32]. `weight` and `scale`
    are buffers, so `.to(device)` moves them and a state_dict holds them under those names.
    `.to(torch.bfloat16)` / `.half()` / `.float()` on a parent model change the device only: the
    stored bytes stay FP8 (nn.Module would otherwise convert every floating buffer, fp8 included).

    Args:
        values: float8_e4m3fn [rows, dim], dim a multiple of 32.
        scales: float8_e8m0fnu [rows, dim // 32].
        check: Scan the bytes for ones that dequantise to NaN (one pass; a loader that scans
            them itself passes False).

    Raises:
        TypeError: A tensor has the wrong dtype.
        ValueError: The shapes disagree, or a byte dequantises to NaN.

    Examples:
        >>> import torch
        >>> from engram import FP8Table
        >>> table = FP8Table.from_float(torch.randn(100, 64))
        >>> table
        FP8Table(num_rows=100, dim=64, format=fp8)
        >>> table.scale.shape, table.gather(torch.tensor([[3, 7]])).shape
        (torch.Size([100, 2]), torch.Size([1, 2, 64]))
    """

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, *, check: bool = True) -> None:
        super().__init__(values, scales, RowFormat.FP8, what="FP8Table", check=check)

    @classmethod
    def from_float(cls, weight: torch.Tensor, fmt: RowFormat | str = RowFormat.FP8) -> FP8Table:
        """Quantise a float table to FP8 rows with `quant.quantize_rows`, in chunks.

        Args:
            weight: A float table [rows, dim] (fp32/bf16/fp16/fp64), dim a multiple of 32.
            fmt: Must be FP8 (other formats are `QuantTable.from_float`'s).

        Returns:
            The table.

        Raises:
            ValueError: `fmt` is not FP8, or `weight` is not a table of a width FP8 rows take.
        """
        if as_row_format(fmt) is not RowFormat.FP8:
            raise ValueError(
                f"an FP8Table holds fp8 rows; quantise to {fmt} with QuantTable.from_float(weight, {fmt!r})"
            )
        return cls(*quantize_table(weight, RowFormat.FP8))
