"""Boundary checks of what the hash takes (SPEC §4 inputs): token ids, dead masks, window starts,
and device tensors checked where they are; plus `rows_like`, which hands rows back in the input's
kind. Shared by `engram.addressing.hashing` and `engram.addressing.stream`; knows no layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["check_dead_mask", "check_device_inputs", "check_starts", "check_token_ids", "rows_like"]


def check_device_inputs(ids: Any, dead_mask: Any, vocab_size: int, *, check_range: bool = True) -> None:
    """Boundary checks of token ids (and a dead mask) that stay on their device (CUDA): the dtype, and
    with `check_range` every id in [0, vocab_size) (one sync). Only an input that fails is copied to
    the host, so that the error names the bad value and its position as the CPU path does."""

    if (
        ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
        or (check_range and bool(((ids < 0) | (ids >= vocab_size)).any()))  # sync point
    ):
        check_token_ids(ids, vocab_size)  # raises with the CPU path's message
    if dead_mask is not None and (
        not isinstance(dead_mask, torch.Tensor)
        or dead_mask.dtype != torch.bool
        or dead_mask.shape != ids.shape
    ):
        check_dead_mask(dead_mask, tuple(ids.shape))  # raises with the reason


def _first_position(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def check_token_ids(token_ids: Any, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """`token_ids` as an int64 numpy array of shape [T] or [B, T], every id in [0, vocab_size).

    Raises TypeError for a non-integer dtype and ValueError for a bad shape, an empty input or an
    id out of range (naming the first such id and its position).
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(
                f"{name} must hold integer token ids, got a tensor of {token_ids.dtype}; cast with .long()"
            )
        token_ids = token_ids.detach().cpu().numpy()  # sync point on CUDA inputs
    arr = np.asarray(token_ids)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{name} must hold integer token ids, got dtype {arr.dtype}; convert with .astype(np.int64)"
        )
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape [T] or [B, T], got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape}): there is nothing to hash")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = _first_position(bad)
        raise ValueError(
            f"{name} holds id {int(arr[pos])} at position {pos}, outside the tokenizer's ids [0, {vocab_size}); "
            "was the text tokenized with the tokenizer this config was made for?"
        )
    return arr.astype(np.int64, copy=False)


def check_dead_mask(
    dead_mask: Any, shape: tuple[int, ...], name: str = "dead_mask", meaning: str = "dead position"
) -> np.ndarray | None:
    """`dead_mask` (None, or bool of `shape`: True = dead position) as a numpy array."""
    if dead_mask is None:
        return None
    if isinstance(dead_mask, torch.Tensor):
        dead_mask = dead_mask.detach().cpu().numpy()
    mask = np.asarray(dead_mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"{name} must be boolean (True = {meaning}), got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {mask.shape} but token_ids has shape {shape}; they must match")
    return mask


def check_starts(starts: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """`starts` (None, or bool of `shape`: True = a window restarts at this position) as numpy."""
    return check_dead_mask(starts, shape, "starts", "a new window starts at this position")


def rows_like(rows: np.ndarray, like: Any) -> Any:
    """`rows` as a torch tensor on `like`'s device when `like` is a tensor, else as they are."""
    if isinstance(like, torch.Tensor):
        t = torch.from_numpy(rows)
        return t if like.device.type == "cpu" else t.to(like.device)
    return rows
