"""What a loaded checkpoint's tensors hold: NaN / Inf scans (float and FP8 bytes) shared by every loader,
in chunks; tables over `SCAN_LIMIT_BYTES` only when asked. Knows no checkpoint formats, configs or
models. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = [
    "SCAN_LIMIT_BYTES",
    "UnscannedTableWarning",
    "check_finite",
    "check_fp8_table",
    "scan_table",
]

SCAN_LIMIT_BYTES = 256 * 2**20
_CHUNK_BYTES = 64 * 2**20  # bytes scanned at a time
_FIX = "the file is damaged: re-copy it, or resume / convert from an intact checkpoint"


class UnscannedTableWarning(UserWarning):
    """A table was loaded without scanning it for NaN / Inf (it is larger than SCAN_LIMIT_BYTES)."""


def _chunks(flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(start, piece) over a 1-D tensor, about _CHUNK_BYTES each."""
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
    return [(a, flat[a : a + step]) for a in range(0, flat.numel(), step)]


def _count(flat: torch.Tensor, test: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int]:
    """(how many, flat index of the first) of the values of 1-D `flat` where `test` is True, chunk by chunk
    (bounded temporaries); (0, -1) when none."""
    bad, first = 0, -1
    for start, piece in _chunks(flat):
        hit = test(piece)
        if bool(hit.any()):  # sync point (a loader's check, not a hot path)
            idx = torch.nonzero(hit).reshape(-1)
            if first < 0:
                first = start + int(idx[0])
            bad += idx.numel()
    return bad, first


def _position(index: int, shape: torch.Size) -> str:
    """A flat index as a position: "row 3, column 7" for a matrix, "[i, j, k]" otherwise."""
    pos = []
    for size in reversed(shape):
        pos.append(index % size)
        index //= size
    pos.reverse()
    if len(pos) == 2:
        return f"row {pos[0]}, column {pos[1]}"
    return f"position {pos}" if pos else "its only value"


def check_finite(t: torch.Tensor, where: str) -> None:
    """ValueError unless every value of `t` is finite (integer and bool tensors always are); `where` names
    the tensor (e.g. "model.safetensors: tensor 'wkv.weight'")."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    flat = t.detach().reshape(-1)
    bad, first = _count(flat, lambda piece: ~torch.isfinite(piece))
    if bad:
        value = float(flat[first])
        raise ValueError(
            f"{where}: {bad} of its {flat.numel()} values are NaN or Inf (the first, {value}, at "
            f"{_position(first, t.shape)}); {_FIX}"
        )


def check_fp8_table(weight: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    """ValueError if an FP8 table's values (float8_e4m3fn [rows, dim]) hold a NaN byte (0x7F / 0xFF) or its
    scales (float8_e8m0fnu [rows, dim // 32]) the NaN byte 255; reads every byte (`scan_table` decides)."""
    for t, name, test, nan in (
        (weight, "values", lambda b: (b & 0x7F) == 0x7F, "0x7F / 0xFF, NaN in e4m3"),
        (scale, "scales", lambda b: b == 0xFF, "255, NaN in ue8m0"),
    ):
        flat = t.reshape(-1).view(torch.uint8)
        bad, first = _count(flat, test)
        if bad:
            raise ValueError(
                f"{where}: {bad} of its {flat.numel()} {name} are the byte {nan} (the first at "
                f"{_position(first, t.shape)}); {_FIX}"
            )


def scan_table(nbytes: int, verify: bool, where: str) -> bool:
    """Whether to scan a table of `nbytes` bytes: always with `verify`, else up to SCAN_LIMIT_BYTES. When
    not, warn (`UnscannedTableWarning`) naming the table and how to scan it."""
    if verify or nbytes <= SCAN_LIMIT_BYTES:
        return True
    warnings.warn(
        f"{where} ({nbytes / 2**30:.1f} GiB) was not scanned for NaN / Inf: tables over "
        f"{SCAN_LIMIT_BYTES // 2**20} MiB are scanned only with --verify (verify=True)",
        UnscannedTableWarning,
        stacklevel=3,
    )
    return False
