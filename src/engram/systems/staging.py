"""The device side of a fetch: the block a gather dequantises, and the pinned staging that feeds a GPU.

`FetchedBlock` is a fetch's distinct rows on the compute device with their inverse index and
ready event; `Staging` a reusable (pinned for CUDA) host buffer; `assemble_cpu` and
`assemble_cuda` build a block from the cache's hits and the misses' bytes, on CUDA through ONE
non_blocking copy on the fetch stream. Knows bytes, the cache and streams, nothing of which rows
a model asks for. Design: docs/systems.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from engram.rowformat.formats import RowFormat
from engram.systems.cache import RowCache

__all__ = [
    "ALIGN",
    "FetchPlan",
    "FetchedBlock",
    "Staging",
    "align",
    "assemble_cpu",
    "assemble_cuda",
    "block_views",
    "cpu_block_bytes",
]

ALIGN = 64  # byte alignment of each region of a staging buffer (int64 views need 8)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class FetchedBlock(NamedTuple):
    """Distinct rows' stored bytes on the compute device, ready for `dequantize_gather`.

    Attributes:
        values: (U, width) in the row format's value dtype (FP8: (U, dim) float8_e4m3fn).
        scales: (U, scales a row) in its scale dtype (FP8: (U, dim // 32) float8_e8m0fnu).
        inverse: rows.shape int64: each requested row's position in the block.
        ready: Recorded on the fetch stream when the block is complete (CUDA); else None.
        out: (*rows.shape, dim) already dequantised, for `prefetch(rows, dtype)`; else None.
    """

    values: torch.Tensor  # (U, width) in the row format's value dtype (FP8: (U, dim) float8_e4m3fn)
    scales: torch.Tensor  # (U, scales a row) in its scale dtype (FP8: (U, dim // 32) float8_e8m0fnu)
    inverse: torch.Tensor  # rows.shape int64: each requested row's position in the block
    ready: torch.cuda.Event | None  # recorded on the fetch stream when the block is complete (CUDA)
    out: torch.Tensor | None = None  # (*rows.shape, dim) already dequantised, for prefetch(rows, dtype)


class FetchPlan(NamedTuple):
    """What one fetch moves: the distinct rows' split into cache misses and hits, and the index back."""

    miss_rows: torch.Tensor  # (M,) int64 rows to read from the backing tier, ascending
    inverse: np.ndarray  # (n,) each requested row's position in the block [misses; hits]
    hit_slots: np.ndarray  # (H,) cache slots of the hits
    ins_slots: np.ndarray  # (I,) cache slots the first I misses are admitted to
    u: int  # distinct rows: M + H
    shape: torch.Size  # the requested rows' shape (of the inverse index)


class Staging:
    """A growable host buffer of bytes (pinned for a CUDA compute device) and the event of its last copy."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.copied: torch.cuda.Event | None = None  # the H2D copy that last read `buf`

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the buffer, after the previous copy out of it finished (a host wait, rare)."""
        if self.copied is not None:
            self.copied.synchronize()  # sync point: only if that copy (two fetches ago) still runs
        if self.buf.numel() < nbytes:  # grow by 1.5x: pinned allocation is slow, do it rarely
            size = align(max(nbytes, self.buf.numel() * 3 // 2))
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        return self.buf[:nbytes]


def cpu_block_bytes(u: int, dim: int, fmt: RowFormat = RowFormat.FP8) -> int:
    """Bytes of a CPU block of u rows of `fmt`: values (u, value bytes) | scales (u, scale bytes), 64-aligned
    regions (FP8: (u, dim) | (u, dim // 32))."""
    return align(u * fmt.value_bytes(dim)) + u * fmt.scale_bytes(dim)


def block_views(buf: torch.Tensor, rows: int, vb: int, sb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (rows, vb), scales (rows, sb)) of the bytes `buf` laid out as values | scales, the scales
    64-aligned (the layout `cpu_block_bytes` counts)."""
    off_s = align(rows * vb)
    return buf[: rows * vb].view(rows, vb), buf[off_s : off_s + rows * sb].view(rows, sb)


def assemble_cpu(
    buf: torch.Tensor,
    cache: RowCache | None,
    gather_misses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    plan: FetchPlan,
    dim: int,
    fmt: RowFormat = RowFormat.FP8,
) -> FetchedBlock:
    """The block [misses; hits] (U rows) in host bytes `buf` (>= cpu_block_bytes(u, dim, fmt)); arguments
    as `assemble_cuda`."""
    miss_rows, inverse, hit_slots, ins_slots, u, shape = plan
    vb, sb, m = fmt.value_bytes(dim), fmt.scale_bytes(dim), miss_rows.numel()
    values, scales = block_views(buf, u, vb, sb)  # (U, value bytes), (U, scale bytes): [misses; hits]
    gather_misses(miss_rows, values[:m], scales[:m])
    if cache is not None:
        if hit_slots.shape[0]:
            cache.read(torch.from_numpy(hit_slots), values[m:], scales[m:])
        if ins_slots.shape[0]:
            k = ins_slots.shape[0]
            cache.write(torch.from_numpy(ins_slots), values[:k], scales[:k])
    inv = torch.from_numpy(inverse).view(shape)
    return FetchedBlock(values.view(fmt.value_dtype), scales.view(fmt.scale_dtype), inv, None)


def assemble_cuda(
    staging: Staging,
    stream: torch.cuda.Stream,
    device: torch.device,
    cache: RowCache | None,
    gather_misses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    plan: FetchPlan,
    dim: int,
    fmt: RowFormat = RowFormat.FP8,
) -> FetchedBlock:
    """The block [misses; hits] (U rows of row format `fmt`) on `device` (see docs/systems.md).

    miss_rows (M,) are gathered by `gather_misses(rows, out_values, out_scales)` straight into the
    pinned staging; inverse (n,) indexes the block; hit_slots (H,) are read from `cache`; the first
    len(ins_slots) misses are written to the cache at ins_slots.
    """
    miss_rows, inverse, hit_slots, ins_slots, u, shape = plan
    vb, sb, m, n = fmt.value_bytes(dim), fmt.scale_bytes(dim), miss_rows.numel(), inverse.shape[0]
    h, k = hit_slots.shape[0], ins_slots.shape[0]
    # staging layout (bytes, each region 64-aligned): miss values | miss scales | inverse | hits | admits
    off_s = align(m * vb)
    off_i = align(off_s + m * sb)
    nbytes = off_i + 8 * (n + h + k)
    buf = staging.take(nbytes)  # pinned host bytes
    gather_misses(miss_rows, *block_views(buf, m, vb, sb))
    idx = buf[off_i:nbytes].view(torch.int64)  # (n + h + k,)
    idx[:n] = torch.from_numpy(inverse)
    idx[n : n + h] = torch.from_numpy(hit_slots)
    idx[n + h :] = torch.from_numpy(ins_slots)
    with torch.cuda.stream(stream):
        dev = buf.to(device, non_blocking=True)  # the one host -> device copy
        staging.copied = torch.cuda.Event()
        staging.copied.record(stream)
        miss_v, miss_s = block_views(dev, m, vb, sb)
        dev_idx = dev[off_i:nbytes].view(torch.int64)
        inv = dev_idx[:n].view(shape)
        if h == 0:  # no hits: the misses are the block as copied
            values, scales = miss_v, miss_s
        else:
            assert cache is not None
            values = torch.empty(
                (u, vb), dtype=torch.uint8, device=device
            )  # (U, value bytes): [misses; hits]
            scales = torch.empty((u, sb), dtype=torch.uint8, device=device)
            values[:m].copy_(miss_v)
            scales[:m].copy_(miss_s)
            cache.read(dev_idx[n : n + h], values[m:], scales[m:])
        if k:
            assert cache is not None
            cache.write(dev_idx[n + h :], miss_v[:k], miss_s[:k])
        ready = torch.cuda.Event()
        ready.record(stream)
    return FetchedBlock(values.view(fmt.value_dtype), scales.view(fmt.scale_dtype), inv, ready)
