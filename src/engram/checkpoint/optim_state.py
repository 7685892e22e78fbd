"""Optimizer state as flat tensors (for a safetensors file) plus JSON (param groups, scalars), so
training checkpoints need no pickle. Holds `optimizers_to_tensors` and `optimizers_from_tensors`."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["optimizers_from_tensors", "optimizers_to_tensors"]


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
        sd = opt.state_dict()
        groups[name] = {"param_groups": sd["param_groups"], "scalars": {}}
        for idx, st in sd["state"].items():
            for key, val in st.items():
                if isinstance(val, torch.Tensor):
                    tensors[f"{name}.{idx}.{key}"] = val.detach().contiguous().clone()
                else:
                    groups[name]["scalars"][f"{idx}.{key}"] = val
    return tensors, groups


def optimizers_from_tensors(
    opts: dict[str, torch.optim.Optimizer | None], tensors: dict[str, torch.Tensor], groups: dict
) -> None:
    """Load what `optimizers_to_tensors` wrote back into the same optimizers (None entries skipped)."""
    for name, opt in opts.items():
        if opt is None:
            continue
        if name not in groups:
            raise ValueError(f"checkpoint has no state for the {name} optimizer")
        state: dict[int, dict[str, Any]] = {}
        for key, val in tensors.items():
            owner, idx, field_name = key.split(".", 2)
            if owner == name:
                state.setdefault(int(idx), {})[field_name] = val
        for key, val in groups[name]["scalars"].items():
            idx, field_name = key.split(".", 1)
            state.setdefault(int(idx), {})[field_name] = val
        opt.load_state_dict({"state": state, "param_groups": groups[name]["param_groups"]})
