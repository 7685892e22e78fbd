"""Where an Engram table's bytes live (SPEC §5: hot rows on the device, warm in DRAM, the tail on SSD).

`Placement` is an enum (`DEVICE`, `HOST`, `HOST_UVA`, `SSD`), `CacheIndex` where a hot-row cache keeps
its index (`HOST`, `DEVICE`); `as_placement`, `as_cache_index` and `as_device` check a user's value and name the choices when it is wrong; `check_device_memory` refuses an allocation larger
than a CUDA device's free memory, naming both. Knows nothing of tables. Design: docs/systems.md.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["CacheIndex", "Placement", "as_cache_index", "as_device", "as_placement", "check_device_memory"]


class Placement(enum.StrEnum):
    """Where a `TieredTable`'s stored rows live; a hot-row cache on the device is separate.

    Attributes:
        DEVICE: The whole table resident on the compute device: no fetching at all.
        HOST: An in-memory table in host DRAM; rows staged (pinned on CUDA) and copied over.
        HOST_UVA: A pinned FP8 table in host DRAM that the CUDA gather kernel reads in place (UVA).
        SSD: A memory-mapped table file: rows read from the file's pages as touched.
    """

    DEVICE = "device"  # the whole FP8 table resident on the compute device: no fetching at all
    HOST = "host"  # an in-memory FP8Table in host DRAM; rows staged (pinned on CUDA) and copied over
    HOST_UVA = "host-uva"  # a pinned FP8Table in host DRAM that the CUDA gather kernel reads in place (UVA)
    SSD = "ssd"  # a memory-mapped MmapFP8Table: rows read from the file's pages as touched


class CacheIndex(enum.StrEnum):
    """Where a hot-row cache keeps its row -> slot index (the cached bytes are on the compute device).

    Attributes:
        HOST: `RowCache`: numba index on the host, exact policies (lru, clock, lfu, pinned ...).
        DEVICE: `DeviceRowCache`: set-associative LRU, index on the device, lookups without a host sync.
    """

    HOST = "host"  # RowCache: numba index on the host, exact policies (lru, clock, lfu, pinned ...)
    DEVICE = "device"  # DeviceRowCache: set-associative LRU, index on the device, lookups without a host sync


def as_cache_index(value: CacheIndex | str) -> CacheIndex:
    """`value` as a CacheIndex; raises ValueError naming the choices for anything else."""
    if isinstance(value, CacheIndex):
        return value
    if isinstance(value, str):
        try:
            return CacheIndex(value.lower())
        except ValueError:
            pass
    raise ValueError(
        f"cache_index={value!r} is not a CacheIndex; use 'host' or 'device' (or None: chosen for you)"
    )


def as_placement(value: Placement | str) -> Placement:
    """`value` as a Placement; raises ValueError naming the choices for anything else."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        try:
            return Placement(value.lower())
        except ValueError:
            pass
    choices = ", ".join(repr(p.value) for p in Placement)
    raise ValueError(
        f"placement={value!r} is not a Placement; use Placement.DEVICE/HOST/HOST_UVA/SSD or one of {choices}"
    )


def as_device(value: torch.device | str | None) -> torch.device:
    """`value` as a torch.device (None: the CPU); raises for a CUDA device this machine lacks."""
    if value is None:
        return torch.device("cpu")
    if not isinstance(value, torch.device | str):
        raise TypeError(
            f"device must be a torch.device or a string like 'cuda:0', got {type(value).__name__}"
        )
    try:
        device = torch.device(value)
    except RuntimeError as e:
        raise ValueError(f"device={value!r} is not a device name ({e}); use e.g. 'cpu' or 'cuda:0'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r} but CUDA is not available here; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={value!r} but only {torch.cuda.device_count()} CUDA device(s) exist here"
            )
    elif device.type != "cpu":
        raise ValueError(f"device={value!r}: tiered tables compute on 'cpu' or 'cuda' devices")
    return device


def check_device_memory(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse `nbytes` of new memory on a CUDA `device` when they exceed its free memory now
    (torch.cuda.mem_get_info), naming both numbers, `what` asks for them and `fix`. A CPU passes."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:,.2f} GiB ({nbytes:,} bytes) on {device}, but only "
            f"{free / 2**30:,.2f} GiB of its {total / 2**30:,.2f} GiB are free; {fix}"
        )
