"""Wrap a model's Engram tables in tiers and feed it batches whose rows are already being fetched.

`offload_engram` swaps the `table` of every `Engram` module in a model for a `TieredTable`, in
place, touching no model code; `Prefetcher` yields batches whose next `depth` batches are already
hashed and prefetching, so each table's `gather` finds its rows on the device. Knows models and
hashers only through those attributes. Design and an example: docs/systems.md.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.checkpoint.files import save_tensors
from engram.checkpoint.mmap_table import MmapFP8Table, MmapQuantTable
from engram.model.module import Engram
from engram.model.table import FP8Table, QuantTable, TrainableTable, quantize_table
from engram.rowformat.formats import RowFormat, as_row_format
from engram.systems.background import PrefetchHandle
from engram.systems.placement import CacheIndex, Placement, as_placement
from engram.systems.tiered import TieredTable

__all__ = ["PrefetchedBatch", "Prefetcher", "engram_modules", "offload_engram"]


def engram_modules(model: nn.Module) -> dict[int, Engram]:
    """Every Engram module in a model (the model itself included), by layer.

    Args:
        model: A model holding `engram.model.module.Engram` modules, or one such module.

    Returns:
        {layer_id: module}, in layer order.

    Raises:
        ValueError: Two modules for one layer, or none at all.
    """
    found: dict[int, Engram] = {}
    for name, m in model.named_modules():
        if isinstance(m, Engram):
            if m.layer_id in found:
                raise ValueError(f"two Engram modules for layer {m.layer_id} (the second at {name!r})")
            found[m.layer_id] = m
    if not found:
        raise ValueError(f"{type(model).__name__} holds no engram.model.module.Engram module to offload")
    return dict(sorted(found.items()))


def _in_memory(values: torch.Tensor, scales: torch.Tensor, fmt: RowFormat) -> QuantTable:
    """The in-memory table of `fmt` over values / scales: an FP8Table for FP8, else a QuantTable."""
    return FP8Table(values, scales) if fmt is RowFormat.FP8 else QuantTable(values, scales, fmt)


def _as_stored(table: Any, layer_id: int, quantize: bool, fmt: RowFormat) -> QuantTable | MmapQuantTable:
    if isinstance(table, QuantTable | MmapQuantTable):  # FP8Table / MmapFP8Table included
        return table
    if isinstance(table, TieredTable):
        raise ValueError(f"layer {layer_id}'s table is already a TieredTable; offload a model once")
    if isinstance(table, TrainableTable):
        if not quantize:
            raise TypeError(
                f"layer {layer_id}'s table is a float TrainableTable ({table.weight.dtype}); tiered tables are "
                "frozen quantised tables (inference only): pass quantize=True to quantise it (lossy: FP8 e4m3 + "
                "ue8m0 scales, or row_format='int8' / 'int4')"
            )
        return _in_memory(*quantize_table(table.weight.detach().cpu(), fmt), fmt)
    raise TypeError(f"layer {layer_id}'s table is a {type(table).__name__}, not an FP8Table / MmapFP8Table")


def offload_engram(
    model: nn.Module,
    placement: Placement | str,
    cache_rows: int = 0,
    device: torch.device | str | None = None,
    *,
    quantize: bool = False,
    ssd_dir: str | os.PathLike[str] | None = None,
    max_inflight: int = 2,
    fetch_threads: int | None = None,
    row_format: RowFormat | str = RowFormat.FP8,
    cache_index: CacheIndex | str | None = None,
) -> dict[int, TieredTable]:
    """Swap every Engram module's table in a model for a TieredTable, in place, touching no model code.

    Everything is checked before any table is swapped. Inference only: tiered tables are frozen.

    Args:
        model: A model holding Engram modules (or one module).
        placement: Where the stored rows live: a `Placement` or its value ("device", "host",
            "host-uva", "ssd"). HOST with an MmapFP8Table reads the file into memory; HOST_UVA also
            pins it (a pinned copy of a pageable table: TieredTable itself refuses pageable tables).
        cache_rows: Hot-row cache slots per table (HOST / SSD); 0: no cache.
        device: Where the model computes (default: the table's device for DEVICE, else the CPU).
        quantize: Quantise a float (trainable) table to `row_format` (lossy); without it such a
            table is refused. A table already quantised keeps its format.
        ssd_dir: For SSD: where an in-memory table is first written, as
            `ssd_dir/engram_layer{L}.safetensors` (an MmapFP8Table / MmapQuantTable is used as is).
        max_inflight: Prefetches in flight at once, per table.
        fetch_threads: Threads of the host gather (None: 1 below 2048 rows, every core above).
        row_format: The format `quantize` writes: FP8 by default, or "int8", "int8-row", "int4".
        cache_index: As `TieredTable` takes it.

    Returns:
        The new tables, by layer id.

    Raises:
        TypeError: A float table without `quantize`, or a table of another kind.
        ValueError: A bad `placement`, `cache_rows` or `row_format`; a table offloaded already; SSD
            without a file or `ssd_dir`; HOST_UVA without CUDA.

    Examples:
        >>> import torch
        >>> from engram import Engram, EngramConfig, NgramHasher
        >>> from engram.systems import Prefetcher, offload_engram
        >>> config = EngramConfig.preset("tiny").replace(vocab_size=1000, compressed_vocab_size=1000)
        >>> engram = Engram(config, layer_id=1)
        >>> tables = offload_engram(engram, "host", cache_rows=4096, quantize=True)
        >>> tables
        {1: TieredTable(num_rows=33048, dim=32, format=fp8, placement=host, device=cpu, cache_rows=4096, ...)}
        >>> batches = [torch.randint(0, 1000, (2, 8)) for _ in range(3)]
        >>> for batch in Prefetcher(batches, NgramHasher(config), engram, depth=1):
        ...     h = torch.zeros(2, 8, config.hc_mult, config.hidden_size)
        ...     out = engram(h, batch.rows[:, :, 0])  # this layer's rows, already fetched
        >>> tables[1].stats()["prefetch_hits"]
        3
    """
    where = as_placement(placement)
    if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 0:
        raise ValueError(f"cache_rows={cache_rows!r} must be an int >= 0 (0: no cache)")
    fmt = as_row_format(row_format, "row_format")
    modules = engram_modules(model)
    plans: dict[int, QuantTable | MmapQuantTable] = {}
    for lid, m in modules.items():  # check everything before changing anything
        table = _as_stored(m.table, lid, quantize, fmt)
        if where is Placement.SSD and not isinstance(table, MmapQuantTable) and ssd_dir is None:
            raise ValueError(
                f"placement SSD needs the table of layer {lid} in a file: pass ssd_dir=<folder> to write it "
                "there, or give the module an MmapFP8Table"
            )
        plans[lid] = table
    out: dict[int, TieredTable] = {}
    for lid, table in plans.items():
        if where is Placement.SSD and not isinstance(table, MmapQuantTable):
            assert ssd_dir is not None
            path = Path(ssd_dir) / f"engram_layer{lid}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_tensors(path, {"weight": table.weight, "scale": table.scale})
            fp8 = table.row_format is RowFormat.FP8
            table = (
                MmapFP8Table(path, "weight", "scale")
                if fp8
                else MmapQuantTable(path, "weight", "scale", table.row_format)
            )
        elif where in (Placement.HOST, Placement.HOST_UVA):
            if isinstance(table, MmapQuantTable):
                table = _in_memory(table.weight.clone(), table.scale.clone(), table.row_format)
            elif table.weight.device.type != "cpu":
                table = _in_memory(table.weight.cpu(), table.scale.cpu(), table.row_format)
            if where is Placement.HOST_UVA and not table.weight.is_pinned():
                if not torch.cuda.is_available():
                    raise ValueError(
                        "placement HOST_UVA reads a pinned host table from CUDA kernels, but CUDA is not "
                        "available here; use placement HOST"
                    )
                table = _in_memory(table.weight.pin_memory(), table.scale.pin_memory(), table.row_format)
        target = (
            device if device is not None else (table.weight.device if where is Placement.DEVICE else "cpu")
        )
        tiered = TieredTable(
            table,
            where,
            device=target,
            cache_rows=cache_rows,
            max_inflight=max_inflight,
            fetch_threads=fetch_threads,
            cache_index=cache_index if cache_rows else None,
        )
        modules[lid].table = tiered
        out[lid] = tiered
    return out


class PrefetchedBatch(NamedTuple):
    """One batch from a `Prefetcher`.

    Attributes:
        token_ids: As the iterable gave it: (B, T) torch or numpy.
        rows: (B, T, n_layers, heads) int64 on the host, the hasher's layer order.
        handles: layer_id -> the prefetch of that layer's rows (`rows[:, :, index of that layer]`).
    """

    token_ids: Any  # as the iterable gave it: (B, T) torch or numpy
    rows: torch.Tensor  # (B, T, n_layers, heads) int64 on the host, the hasher's layer order
    handles: dict[int, PrefetchHandle]  # layer_id -> the prefetch of rows[:, :, index of that layer]


class Prefetcher:
    """Iterate over batches with the next `depth` batches hashed and their rows being prefetched.

    Each batch is a `PrefetchedBatch` (token ids, rows (B, T, n_layers, heads), the prefetch handles
    by layer); each table's `gather` then finds its rows fetched. The iteration is single-use, like a
    generator. See `offload_engram` for an example.

    Args:
        batches: Token-id batches, (B, T) torch or numpy.
        hasher: The hasher of the model's config.
        model: The offloaded model (or a bare Engram module) whose TieredTables serve the batches;
            each table prefetches its own layer's rows.
        depth: Batches prefetched ahead (0: none).
        dead_masks: Optional bool (B, T) masks, one per batch, passed to the hasher.
        dtype: Also dequantise in the background into the dtype the model gathers in (its
            activations' dtype), worth it on a CPU compute device (see `TieredTable.prefetch`).

    Raises:
        TypeError: `hasher` is not an NgramHasher, or a table is not a TieredTable (offload first).
        ValueError: `depth` is negative or more than a table's `max_pending` allows, or a layer is
            not the hasher's.
    """

    def __init__(
        self,
        batches: Iterable[Any],
        hasher: NgramHasher,
        model: nn.Module,
        depth: int = 1,
        *,
        dead_masks: Iterable[Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth={depth!r} must be an int >= 0 (batches prefetched ahead; 0: none)")
        if not isinstance(hasher, NgramHasher):
            raise TypeError(
                f"hasher must be an engram.addressing.hashing.NgramHasher, got {type(hasher).__name__}"
            )
        self.tables: dict[int, TieredTable] = {}
        self.layer_index: dict[int, int] = {}
        for lid, m in engram_modules(model).items():
            if not isinstance(m.table, TieredTable):
                raise TypeError(
                    f"layer {lid}'s table is a {type(m.table).__name__}: wrap the model with "
                    "offload_engram(model, placement, ...) first"
                )
            self.tables[lid] = m.table
            self.layer_index[lid] = hasher.config.layer_index(lid)  # raises for a layer the hasher lacks
            if depth + 1 > m.table.max_pending:
                raise ValueError(
                    f"depth={depth} keeps {depth + 1} prefetches per table pending but layer {lid}'s table "
                    f"remembers max_pending={m.table.max_pending}; lower depth or raise max_pending"
                )
        self.hasher, self.depth, self.dtype = hasher, depth, dtype
        self._batches = iter(batches)
        self._masks = None if dead_masks is None else iter(dead_masks)

    def _start(self, token_ids: Any, dead_mask: Any) -> PrefetchedBatch:
        """Hash one batch on the host (numba, multi-threaded) and start each layer's prefetch."""
        host_ids = token_ids.cpu() if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
        if isinstance(dead_mask, torch.Tensor):
            dead_mask = dead_mask.cpu()
        rows = self.hasher.hash(host_ids, dead_mask)  # (B, T, n_layers, heads)
        rows = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(rows)
        if rows.dim() != 4:
            raise ValueError(f"token-id batches must be (B, T), got shape {tuple(host_ids.shape)}")
        handles = {
            lid: t.prefetch(rows[:, :, self.layer_index[lid]], self.dtype) for lid, t in self.tables.items()
        }
        return PrefetchedBatch(token_ids, rows, handles)

    def _next_mask(self, index: int) -> Any:
        """The dead mask of batch `index` (None without dead_masks); ValueError when they ran out."""
        if self._masks is None:
            return None
        try:
            return next(self._masks)
        except StopIteration:
            raise ValueError(
                f"dead_masks ran out at batch {index}: it gave {index} mask(s) but the batches go on; "
                "give one (B, T) bool mask per batch, or dead_masks=None"
            ) from None

    def __iter__(self) -> Iterator[PrefetchedBatch]:
        """Yield the batches, each with the next `depth` already prefetching.

        Yields:
            One `PrefetchedBatch` per batch, in order.

        Raises:
            ValueError: A batch is not (B, T), or `dead_masks` ran out before the batches.
        """
        ahead: collections.deque[PrefetchedBatch] = collections.deque()
        exhausted = False
        index = 0  # of the next batch to start
        while True:
            while not exhausted and len(ahead) <= self.depth:  # the current batch + `depth` ahead
                try:
                    ids = next(self._batches)
                except StopIteration:
                    exhausted = True
                    break
                ahead.append(self._start(ids, self._next_mask(index)))
                index += 1
            if not ahead:
                return
            yield ahead.popleft()
