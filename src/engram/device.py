"""Where a run computes and in what precision, checked before any work starts.

Holds `resolve_device` (`auto`, `cpu`, `cuda` or `cuda:N` -> a torch.device, refusing a GPU that
is not visible), `Precision` (float32, or bf16: autocast mixed precision over float32 master
weights and optimizer state) with `check_precision` (bf16 where the device has bfloat16
arithmetic), the `autocast` context a forward runs under, and `to_device`, the one host-to-device
copy of a batch (pinned, non-blocking on CUDA: no sync point). Plain functions, no argparse: the
commands (`engram.cli.options`) and the programs call them. Knows nothing of models.
Design: docs/training.md.
"""

from __future__ import annotations

import contextlib
import enum
import re

import torch

__all__ = [
    "DEVICE_HELP",
    "Precision",
    "autocast",
    "check_precision",
    "cpu_has_bf16",
    "cuda_devices",
    "resolve_device",
    "to_device",
]

DEVICE_HELP = "auto (the GPU when there is one), cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


class Precision(enum.StrEnum):
    """The arithmetic of forwards and backwards; weights and optimizer state stay float32 either way,
    so checkpoints are the same files, and a run resumes in either precision."""

    FLOAT32 = "float32"
    BF16 = "bf16"  # torch.autocast to bfloat16: matmuls in bf16, reductions and the loss in float32


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str | torch.device, what: str = "--device") -> torch.device:
    """The torch.device of `device`: 'auto' (cuda:0 when a CUDA device is visible, else the CPU), 'cpu',
    'cuda' (cuda:0) or 'cuda:N', or a torch.device of those types. Raises ValueError naming the value
    (`what`: how the caller spells the option) and the fix: a malformed one, CUDA where none is visible,
    or an index past the visible devices. Checks visibility only: nothing is allocated."""
    if isinstance(device, torch.device):
        kind, index, text = device.type, device.index, str(device)
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"{what} {text}: engram trains on cpu or cuda; give {DEVICE_HELP}")
    else:
        text = str(device)
        m = _DEVICE.fullmatch(text.strip().lower())
        if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
            raise ValueError(f"{what} {text!r}: not a device; give {DEVICE_HELP}")
        kind, index = m.group(1), None if m.group(2) is None else int(m.group(2))
    count = cuda_devices()
    if kind == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not count:
        raise ValueError(
            f"{what} {text}: no CUDA device is visible (torch.cuda.is_available() is False); "
            f"use {what} cpu (or auto)"
        )
    index = 0 if index is None else index
    if index >= count:
        raise ValueError(
            f"{what} {text}: this machine has {count} visible CUDA device{'s' if count > 1 else ''} "
            f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''}); give one of those, or cuda"
        )
    return torch.device("cuda", index)


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bfloat16 natively (oneDNN's bf16 kernels: AVX-512 BF16, AMX or AVX-512
    core on x86, BF16 on Arm); elsewhere torch emulates it, slower than float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_precision(precision: Precision | str, device: torch.device, what: str = "--dtype") -> Precision:
    """`precision` as a Precision, where `device` can run it: bf16 needs a GPU of compute capability
    8.0 or more (Ampere on) or a CPU with bfloat16 arithmetic (`cpu_has_bf16`). Raises ValueError
    naming the value and the fix."""
    try:
        p = Precision(precision)
    except ValueError:
        choices = ", ".join(x.value for x in Precision)
        raise ValueError(f"{what} {precision!r}: give one of {choices}") from None
    if p is Precision.FLOAT32:
        return p
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"{what} bf16: {device} ({name}, compute capability {major}.{minor}) has no bfloat16 "
                f"arithmetic (it needs 8.0 or more); use {what} float32"
            )
    elif device.type == "cpu" and not cpu_has_bf16():
        raise ValueError(
            f"{what} bf16: this CPU has no bfloat16 arithmetic (torch.ops.mkldnn._is_mkldnn_bf16_supported() "
            f"is False), so bf16 would be emulated, slower than float32; use {what} float32 (or a GPU: "
            "--device cuda)"
        )
    return p


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """The context a forward (and its loss) runs under: torch.autocast to bfloat16 for bf16, nothing
    for float32. The backward runs outside it, as torch.autocast asks."""
    if precision is Precision.BF16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: itself on the CPU; on CUDA staged in pinned memory (torch's caching
    host allocator) and copied without blocking, so a step's batch is no sync point."""
    if device.type != "cuda" or t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True)
