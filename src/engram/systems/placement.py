"""Where an Engram table's bytes live (SPEC §5: hot rows on the device, warm in DRAM, the tail on SSD).

`Placement` is an enum (`DEVICE`, `HOST`, `SSD`); `as_placement` and `as_device` check a user's
value and name the choices when it is wrong. Knows nothing of tables. Design: docs/systems.md.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Placement", "as_device", "as_placement"]


class Placement(enum.StrEnum):
    """Where a `TieredTable`'s FP8 rows are stored; a hot-row cache on the device is separate."""

    DEVICE = "device"  # the whole FP8 table resident on the compute device: no fetching at all
    HOST = "host"  # an in-memory FP8Table in host DRAM; rows staged (pinned on CUDA) and copied over
    SSD = "ssd"  # a memory-mapped MmapFP8Table: rows read from the file's pages as touched


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
        f"placement={value!r} is not a Placement; use Placement.DEVICE/HOST/SSD or one of {choices}"
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
