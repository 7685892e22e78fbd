"""Unified virtual addressing: a CUDA tensor that aliases pinned host memory, so a kernel reads host rows.

Under UVA (every 64-bit CUDA platform), memory that CUDA pinned (`tensor.pin_memory()`, i.e.
cudaHostAlloc) is mapped into the device's address space at the same address: a kernel may load from
the host pointer, each access crossing PCIe / NVLink-C2C. Torch refuses CPU tensors in CUDA ops and
exposes no cudaHostGetDevicePointer, so `uva_view` builds the CUDA tensor the documented way: an object
with `__cuda_array_interface__` (the pinned address, as numba's `mapped_array` publishes it) given to
`torch.as_tensor(..., device=...)`, which aliases it (from_blob) and keeps the host tensor alive.
Triton's launcher resolves the address with cuPointerGetAttribute, so the FP8 gather kernel runs
unchanged on such a view: the tier is a pointer, not a code path. `check_uva_table` refuses what
cannot work (no CUDA, pageable or non-contiguous tables) with the fix. Design: docs/systems.md.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_uva_table", "uva_view"]


class _PinnedBytes:
    """The `__cuda_array_interface__` of a pinned host tensor's bytes (version 2: no stream to wait on)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive by the view: torch holds this object until the view is freed
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (host.numel() * host.element_size(),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def check_uva_table(values: torch.Tensor, scales: torch.Tensor, device: torch.device) -> None:
    """Refuse, naming the fix, tables a CUDA kernel on `device` cannot read in place over UVA."""
    if device.type != "cuda":
        raise ValueError(
            f"placement HOST_UVA lets a CUDA kernel read the pinned host table in place; the compute device "
            f"is {device}, which has no such reads: use placement HOST (rows copied to the device), or a "
            "CUDA device"
        )
    for name, t in (("values", values), ("scales", scales)):
        if t.device.type != "cpu":
            raise ValueError(
                f"placement HOST_UVA reads a table in host memory, but its {name} are on {t.device}; "
                "move the table to the host and pin it: FP8Table(w.cpu().pin_memory(), s.cpu().pin_memory())"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"placement HOST_UVA needs contiguous {name} (a kernel indexes row * width), got strides "
                f"{t.stride()} for shape {tuple(t.shape)}; pass t.contiguous().pin_memory()"
            )
        if not t.is_pinned():
            nbytes = t.numel() * t.element_size()
            raise ValueError(
                f"placement HOST_UVA needs the table's {name} in pinned (page-locked) host memory, but these "
                f"{nbytes:,} bytes are pageable: a CUDA kernel cannot address pageable memory. Pin the table "
                "first: FP8Table(table.weight.pin_memory(), table.scale.pin_memory()) (a copy), or use "
                "placement HOST (rows staged through a pinned buffer)"
            )


def uva_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on `device` aliasing the pinned, contiguous host tensor `host` (same shape and dtype).

    No copy: kernels reading the view load the host bytes over the bus. The view keeps `host` alive.
    Raises RuntimeError if torch copied instead of aliasing (the view would be a snapshot, not a tier).
    """
    check_uva_table(host, host, device)
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    flat = torch.as_tensor(_PinnedBytes(host), device=device)  # (nbytes,) uint8, from_blob on the address
    if flat.data_ptr() != host.data_ptr() or flat.device != device:
        raise RuntimeError(
            f"torch.as_tensor made a copy on {flat.device} (address {flat.data_ptr():#x}) instead of aliasing "
            f"the pinned host memory at {host.data_ptr():#x} for {device}: this torch build does not map "
            "pinned memory for that device; use placement HOST"
        )
    return flat.view(host.dtype).view(host.shape)
