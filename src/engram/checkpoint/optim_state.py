"""Optimizer state as flat tensors (for a safetensors file) plus JSON (param groups, scalars), so
training checkpoints need no pickle. Holds `optimizers_to_tensors` and `optimizers_from_tensors`,
which checks every stored tensor against its parameter (name, shape, kind of dtype) before loading:
torch's Adam loads a misshaped `exp_avg` without a word and fails at the next step."""

from __future__ import annotations

from typing import Any

import torch

from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn

__all__ = ["OptimizerStateError", "optimizers_from_tensors", "optimizers_to_tensors"]

# What a stored state tensor's dtype must be: floating, integer, or either (a step count).
_KINDS = {
    "float": lambda d: d.is_floating_point,
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
    "real": lambda d: not d.is_complex and d != torch.bool,
}


class OptimizerStateError(ValueError):
    """Stored optimizer state that does not fit this run's optimizers. `tensor`: the name of the
    offending tensor (None: the param groups, which state.json holds), so a caller can name its file."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


def optimizers_to_tensors(
    opts: dict[str, torch.optim.Optimizer | None],
) -> tuple[dict[str, torch.Tensor], dict]:
    """Every state tensor of the named optimizers, keyed `name.param_index.field`, plus a
    JSON-ready dict of their param groups and non-tensor state (for `state.json`)."""
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, Any] = {}
    for name, opt in opts.items():
        if opt is None:
            continue
        # SparseSinkhorn keeps its active rows only; a checkpoint holds its momentum per row (zeros
        # where inactive), so that row-sharded runs gather, slice and reshard it like any row state
        sd = opt.row_state_dict() if isinstance(opt, SparseSinkhorn) else opt.state_dict()
        groups[name] = {"param_groups": sd["param_groups"], "scalars": {}}
        for idx, st in sd["state"].items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor):
                    tensors[f"{name}.{idx}.{key}"] = val.detach().contiguous().clone()
                else:
                    groups[name]["scalars"][f"{idx}.{key}"] = val
    return tensors, groups


def _expected_state(
    opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor
) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Field -> (shape, dtype kind) of every state tensor `opt` keeps for parameter `p` (of saved param
    group `group`) once it has stepped; None for an optimizer not known here (not checked)."""
    if isinstance(opt, SparseSinkhorn):  # stored per row (`row_state_dict`)
        return {"momentum": (tuple(p.shape), "float")}
    if isinstance(opt, SparseRowAdam | SparseRowAdagrad):
        return {
            k: (shape, "float" if dtype.is_floating_point else "int")
            for k, (shape, dtype) in opt.expected_state(p).items()
        }
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        full = (tuple(p.shape), "float")
        fields = {"step": ((), "real"), "exp_avg": full, "exp_avg_sq": full}
        if group.get("amsgrad"):
            fields["max_exp_avg_sq"] = full
        return fields
    return None


def _check_state(
    name: str,
    opt: torch.optim.Optimizer,
    saved_groups: list[dict[str, Any]],
    state: dict[int, dict[str, Any]],
    keys: dict[tuple[int, str], str],
) -> None:
    """Refuse stored state (`state`: param id -> field -> value; `keys`: the tensor name of each
    (id, field)) that does not fit the parameters of optimizer `name`, before torch loads it."""
    saved = [(g, pid) for g in saved_groups for pid in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    if len(saved) != len(params):
        raise OptimizerStateError(
            f"optimizer_groups holds {len(saved)} parameters of the {name} optimizer, this model has "
            f"{len(params)}: the checkpoint is of another model or damaged; resume from another checkpoint"
        )
    owner = {pid: (g, p) for (g, pid), p in zip(saved, params, strict=True)}
    for pid, fields in state.items():
        if pid not in owner:
            key = next((keys[pid, f] for f in fields if (pid, f) in keys), None)
            raise OptimizerStateError(
                f"{'tensor ' + repr(key) if key else 'state'} is of parameter {pid}, which the {name} "
                f"optimizer does not have (its parameters: {sorted(owner)}); the checkpoint is damaged: "
                "resume from another checkpoint",
                key,
            )
        group, p = owner[pid]
        expected = _expected_state(opt, group, p)
        if expected is None:
            continue
        if set(fields) != set(expected):
            raise OptimizerStateError(
                f"parameter {pid} of the {name} optimizer has stored state {sorted(fields)}, but "
                f"{type(opt).__name__} keeps {sorted(expected)}; the checkpoint is damaged or of another "
                "optimizer: resume from another checkpoint",
                next((keys[pid, f] for f in sorted(fields) if (pid, f) in keys), None),
            )
        for field, (shape, kind) in expected.items():
            value, key = fields[field], keys.get((pid, field))
            if not isinstance(value, torch.Tensor):
                raise OptimizerStateError(
                    f"state {field!r} of parameter {pid} of the {name} optimizer is {value!r}, not a "
                    "tensor; the checkpoint is damaged: resume from another checkpoint"
                )
            if tuple(value.shape) != shape or not _KINDS[kind](value.dtype):
                raise OptimizerStateError(
                    f"tensor {key!r} has shape {tuple(value.shape)} and dtype {value.dtype}, but parameter "
                    f"{pid} of the {name} optimizer (shape {tuple(p.shape)}) needs a {kind} tensor of shape "
                    f"{shape}; the checkpoint is damaged or of another model: resume from another "
                    "checkpoint or retrain",
                    key,
                )


def optimizers_from_tensors(
    opts: dict[str, torch.optim.Optimizer | None], tensors: dict[str, torch.Tensor], groups: dict
) -> None:
    """Load what `optimizers_to_tensors` wrote back into the same optimizers (None entries skipped).
    Every tensor is checked against its parameter first (its name `optimizer.param_index.field`, the
    fields the optimizer keeps, their shapes and kinds of dtype); OptimizerStateError names the tensor."""
    for key in tensors:
        owner, _, rest = key.partition(".")
        idx, _, field_name = rest.partition(".")
        if owner not in opts or not idx.isdigit() or not field_name:
            raise OptimizerStateError(
                f"tensor {key!r} is not named <optimizer>.<parameter index>.<field> for one of this "
                f"run's optimizers ({', '.join(opts)}); the checkpoint is damaged or of another "
                "version: resume from another checkpoint",
                key,
            )
    for name, opt in opts.items():
        if opt is None:
            continue
        if name not in groups:
            raise OptimizerStateError(f"optimizer_groups has no state for the {name} optimizer")
        state: dict[int, dict[str, Any]] = {}
        keys: dict[tuple[int, str], str] = {}
        for key, val in tensors.items():
            owner, idx, field_name = key.split(".", 2)
            if owner == name:
                state.setdefault(int(idx), {})[field_name] = val
                keys[int(idx), field_name] = key
        for key, val in groups[name]["scalars"].items():
            idx, field_name = key.split(".", 1)
            state.setdefault(int(idx), {})[field_name] = val
        _check_state(name, opt, groups[name]["param_groups"], state, keys)
        saved = {"state": state, "param_groups": groups[name]["param_groups"]}
        try:
            if isinstance(opt, SparseSinkhorn):
                opt.load_row_state_dict(saved)
            else:
                opt.load_state_dict(saved)
        except ValueError as e:  # the optimizer's own checks (hyperparameters, finite state)
            raise OptimizerStateError(
                f"the {name} optimizer's stored state does not load: {e}; resume from another checkpoint"
            ) from None
