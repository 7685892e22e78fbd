"""The hooks `add_engram` installs: the model's pre/post hooks (rows for the call, from
`engram.hf.rows.RowSource`), one pre-hook per Engram decoder layer (Engram's output added to the
hidden states entering it), and the model's `_reorder_cache` (beam search reorders the hash state
with the KV cache). `remove_hooks` undoes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["install_hooks", "remove_hooks"]

_CACHE_NAMES = ("cache", "past_key_values")


def _arg_names(model: nn.Module) -> list[str]:
    params = inspect.signature(model.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def install_hooks(model: nn.Module, att: Any, decoder: list[nn.Module]) -> None:
    """Install the hooks of attachment `att` (an EngramAttachment) on `model` and its `decoder` layers."""
    names = _arg_names(model)
    source = att.rows

    def model_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        rows = kwargs.pop("engram_rows", None)
        call = dict(zip(names, args, strict=False))
        call.update(kwargs)
        cache = next((call[k] for k in _CACHE_NAMES if call.get(k) is not None), None)
        p = next(iter(att.parameters()))
        source.begin(
            input_ids=call.get("input_ids"),
            attention_mask=call.get("attention_mask"),
            position_ids=call.get("position_ids"),
            cache=cache,
            inputs_embeds=call.get("inputs_embeds"),
            rows=rows,
            device=p.device,
        )
        return args, kwargs

    def model_post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        source.end(output)

    handles = [
        model.register_forward_pre_hook(model_pre, with_kwargs=True),
        model.register_forward_hook(model_post, with_kwargs=True),
    ]
    for lid in att.config.layer_ids:
        handles.append(decoder[lid].register_forward_pre_hook(_layer_hook(att, lid), with_kwargs=True))
    att.handles = handles

    previous = getattr(model, "_reorder_cache", None)

    def reorder_cache(cache: Any, beam_idx: torch.Tensor) -> Any:
        source.reorder(cache, beam_idx)
        if previous is not None:
            return previous(cache, beam_idx)
        cache.reorder_cache(beam_idx)
        return cache

    model._reorder_cache = reorder_cache  # generate() calls it when the model has it (beam search)


def _layer_hook(att: Any, layer_id: int) -> Callable[..., Any]:
    index = att.config.layer_index(layer_id)
    module = att.module(layer_id)
    source = att.rows

    def hook(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if source.current is None:
            raise RuntimeError(
                f"Engram layer {layer_id} ran without rows: call the model that add_engram returned (its "
                "forward hashes the input ids), not one of its submodules"
            )
        rows, dead = source.current
        h = args[0] if args else kwargs["hidden_states"]
        if rows.shape[:2] != h.shape[:2]:
            raise ValueError(
                f"Engram rows cover {tuple(rows.shape[:2])} (batch, tokens) but layer {layer_id}'s hidden "
                f"states are {tuple(h.shape[:2])}"
            )
        r = rows[:, :, index]
        if r.device != h.device:
            r = r.to(h.device)
            dead = None if dead is None else dead.to(h.device)
        new = module(h.unsqueeze(2), r, dead).squeeze(2)
        if args:
            return (new, *args[1:]), kwargs
        kwargs["hidden_states"] = new
        return args, kwargs

    return hook


def remove_hooks(model: nn.Module, att: Any) -> None:
    """Remove the hooks `install_hooks` put on `model` (and its `_reorder_cache`)."""
    for h in att.handles:
        h.remove()
    att.handles = []
    model.__dict__.pop("_reorder_cache", None)
