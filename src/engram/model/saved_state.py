"""What a table optimizer accepts, from its constructor and from a saved state alike: `check_number`
(one hyperparameter against its allowed range), `saved_param_states` (a `state_dict()`'s structure:
its param groups, each checked by the optimizer's own group check, and its parameter ids) and
`first_bad_row` (NaN, Inf or a negative value in a state tensor, found in chunks) and
`check_active_state` (a state kept for the active rows only); at step time, `check_state_device` (the
state where its table is). Knows optimizer state dicts, nothing of any one optimizer's update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["check_active_state", "check_number", "check_state_device", "first_bad_row", "saved_param_states"]

_ACTIVE_KEYS = ("rows", "momentum")

_CHUNK = 1 << 20  # elements scanned at a time by first_bad_row (isfinite: a 4 MiB float temporary + bools)


def check_number(
    name: str,
    value: Any,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    where: str = "",
) -> None:
    """Refuse `value` unless it is a finite int or float in [lo, hi] (an end open where asked); the
    message names `where` (e.g. "saved param group 0"), `name`, the value and the range."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        hi_s = "" if hi == math.inf else f" and {'<' if hi_open else '<='} {hi}"
        at = f"{where}: " if where else ""
        raise ValueError(f"{at}{name} must be a finite number {lo_s}{hi_s}, got {value!r}")


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def saved_param_states(
    opt_name: str,
    state_dict: Any,
    param_groups: list[dict[str, Any]],
    hyperparameters: Iterable[str],
    check_group: Callable[[dict[str, Any], str], None],
) -> list[tuple[int, torch.Tensor, Any]]:
    """(saved id, this optimizer's parameter, its saved state or None) for every parameter, once
    `state_dict` is known to be a `state_dict()` of this optimizer's shape: as many groups and
    parameters per group as `param_groups`, every hyperparameter present and accepted by `check_group`
    (the constructor's check, given "saved param group i" for its messages), distinct int ids, and
    state only under those ids. Changes nothing; the state entries themselves are the caller's."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list | tuple):
        raise ValueError(
            "not an optimizer state_dict (no 'state' dict and 'param_groups' list): pass optimizer.state_dict()"
        )
    if len(groups) != len(param_groups):
        raise ValueError(
            f"the saved state has {len(groups)} param groups, this {opt_name} {len(param_groups)}: was it saved "
            "for another model?"
        )
    out = []
    for i, (saved, group) in enumerate(zip(groups, param_groups, strict=True)):
        where = f"saved param group {i}"
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list | tuple):
            raise ValueError(f"{where} is {type(saved).__name__} without a 'params' list: a damaged state")
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"{where} has {len(ids)} parameters, this {opt_name}'s group {i} {len(group['params'])}: was "
                "it saved for another model?"
            )
        missing = sorted(k for k in hyperparameters if k not in saved)
        if missing:
            raise ValueError(
                f"{where} has no {', '.join(missing)}: it was saved by another optimizer, not {opt_name}"
            )
        check_group(saved, where)
        for pid, p in zip(ids, group["params"], strict=True):
            if not _is_id(pid):
                raise ValueError(f"{where} lists parameter id {pid!r} ({type(pid).__name__}), not an int")
            out.append((pid, p))
    ids = [pid for pid, _ in out]
    if len(set(ids)) != len(ids):
        twice = sorted({pid for pid in ids if ids.count(pid) > 1})
        raise ValueError(f"the saved param groups list parameter ids {twice} more than once: a damaged state")
    known = set(ids)
    for key in state:
        if not _is_id(key) or key not in known:
            raise ValueError(
                f"the saved state holds parameter {key!r} ({type(key).__name__}), which no saved param group "
                f"lists (they list {ids}): a damaged state, or one of another optimizer; nothing was loaded"
            )
    return [(pid, p, state.get(pid)) for pid, p in out]


def first_bad_row(x: torch.Tensor, nonnegative: bool = False) -> int | None:
    """The first index along dim 0 of `x` holding NaN or Inf (or, with `nonnegative`, a value < 0);
    None if there is none. Scanned in chunks: no temporary the size of `x`. # sync point on CUDA"""
    if x.numel() == 0:  # a table owner's empty shard (engram.distributed: a rank without rows)
        return None
    if x.dim() == 0:
        x = x.reshape(1)
    flat = x.reshape(x.shape[0], -1)
    step = max(1, _CHUNK // max(1, flat.shape[1]))
    for lo in range(0, flat.shape[0], step):
        part = flat[lo : lo + step]
        bad = ~torch.isfinite(part)  # all False for integers
        if nonnegative:
            bad |= part < 0
        rows = bad.any(dim=1).nonzero()
        if rows.numel():
            return lo + int(rows[0, 0])
    return None


def check_active_state(opt_name: str, pid: int, saved: Any, p: torch.Tensor, kept: torch.dtype) -> None:
    """Refuse a saved active-row state (SparseSinkhorn's: "rows" (A,) the sorted distinct ids of the
    active rows, "momentum" (A, dim) theirs, finite) that does not fit the table p, naming what differs;
    `kept`: the momentum's dtype once loaded. {} is no state (a table that has not stepped)."""
    if not isinstance(saved, dict):
        raise ValueError(
            f"saved state of parameter {pid} is a {type(saved).__name__}, {opt_name} keeps a dict of "
            f"{list(_ACTIVE_KEYS)}: the saved state is damaged or of another optimizer"
        )
    if not saved:
        return
    if set(saved) != set(_ACTIVE_KEYS):
        raise ValueError(
            f"saved state of parameter {pid} has keys {sorted(map(repr, saved))}, {opt_name} keeps "
            f"{list(_ACTIVE_KEYS)}: was it saved by another optimizer?"
        )
    rows, mom = saved["rows"], saved["momentum"]
    for key, value in (("rows", rows), ("momentum", mom)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"saved state {key!r} of parameter {pid} is a {type(value).__name__}, not a tensor: the saved "
                "state is damaged or of another optimizer"
            )
    if rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"saved state 'rows' of parameter {pid} has dtype {rows.dtype}, {opt_name} keeps it as "
            "torch.int64 (int32 loads too): the saved state is damaged or of another optimizer"
        )
    # an int32 momentum would load cast, as other numbers; a complex one would lose its imaginary part
    if not mom.is_floating_point():
        raise ValueError(
            f"saved state 'momentum' of parameter {pid} has dtype {mom.dtype}, {opt_name} keeps it as "
            f"{kept} (any floating dtype loads): the saved state is damaged or of another optimizer"
        )
    if rows.dim() != 1:
        raise ValueError(
            f"saved state 'rows' of parameter {pid} has shape {tuple(rows.shape)}, {opt_name} keeps 1-D "
            "row ids: a damaged state"
        )
    if tuple(mom.shape) != (rows.numel(), p.shape[1]):
        raise ValueError(
            f"saved state 'momentum' of parameter {pid} has shape {tuple(mom.shape)}, a table of shape "
            f"{tuple(p.shape)} with {rows.numel()} active rows needs ({rows.numel()}, {p.shape[1]}): does the "
            "table size match?"
        )
    if rows.numel():
        r = rows.to(torch.int64)
        if int(r.min()) < 0 or int(r.max()) >= p.shape[0]:
            raise ValueError(
                f"saved state 'rows' of parameter {pid} holds rows outside [0, {p.shape[0]}) (a table of "
                f"shape {tuple(p.shape)}): does the table size match?"
            )
        if r.numel() > 1 and not bool((r[1:] > r[:-1]).all()):
            raise ValueError(
                f"saved state 'rows' of parameter {pid} is not sorted and distinct: a damaged state"
            )
        bad = first_bad_row(mom)
        if bad is not None:
            raise ValueError(
                f"saved state 'momentum' of parameter {pid} holds NaN or Inf at its entry {bad} (row "
                f"{int(r[bad])}): a damaged state"
            )


def check_state_device(opt_name: str, p: torch.Tensor, state: dict[str, Any]) -> None:
    """Refuse a step whose state is on another device than its table [num_rows, dim] (the model moved
    after the optimizer made its state): ValueError naming both devices and the fix, before anything
    changes. Compares devices only: no sync point."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.device != p.device:
            raise ValueError(
                f"{opt_name}: state {key!r} of the {p.shape[0]} x {p.shape[1]} table is on {value.device}, "
                f"the table on {p.device} (the model moved after the optimizer made its state); move the "
                "state with it, optimizer.load_state_dict(optimizer.state_dict()) after model.to(device) "
                "(a load puts the state where its parameters are), or build the optimizer after the move"
            )
