"""The hooks `add_engram` installs: pre/post hooks on the module that runs the decoder layers (the
`model.model` of a Llama: rows for the call, from `engram.hf.rows.RowSource`), one pre-hook per
Engram decoder layer (Engram's output added to the hidden states entering it), a pre-hook on the
model itself that takes a collator's `engram_rows` out of its kwargs, and the model's
`_reorder_cache` (beam search reorders the hash state with the KV cache). `remove_hooks` undoes them.

The rows are computed on the decoder stack, not on the outer model, because wrappers such as peft
call the outer model's `forward` directly (no hooks), while the stack is always called as a module.

The hooks are small objects holding the attachment, not closures, so `copy.deepcopy(model)` gives
a copy whose hooks drive the copy's own Engram modules.

Under `torch.compile` the hooks on the model and the stack run outside the graph
(`engram.model.graph_break.outside_graph`: hashing is numpy/numba work on the host, and the decode
states are keyed by cache objects), as do each Engram layer's table gather and kernel gate (`engram.model.module`);
the layer hook and Engram's projection and gate are traced. So `fullgraph=True` cannot hold: it
raises `torch._dynamo.exc.Unsupported` at the first of these hooks (the stack's pre-hook under
`torch.compile(model)`). The gather's break falls inside the stack's loop over layers, so dynamo
runs that loop in Python and compiles each decoder layer, its Engram hook with it, as a frame.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from engram.model.graph_break import outside_graph

__all__ = ["install_hooks", "remove_hooks"]

_CACHE_NAMES = ("cache", "past_key_values")


class _TakeRows:
    """Before the outer model's forward: keep a collator's `engram_rows` for the stack's hook (the
    outer forward may not pass unknown kwargs down)."""

    def __init__(self, att: Any) -> None:
        self.att = att

    @outside_graph  # per-call state on the host, read by the stack's pre-hook
    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self.att.rows.given = kwargs.pop("engram_rows", None)
        return args, kwargs


class _ModelPreHook:
    """Before the decoder stack's forward: compute this call's rows (or take the given ones)."""

    def __init__(self, att: Any, names: list[str]) -> None:
        self.att, self.names = att, names

    @outside_graph  # host work: hashing (numpy / numba), the decode states of caches
    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if module.training and torch.is_grad_enabled():
            self.att.check_adapter_training(module)
        rows = kwargs.pop("engram_rows", None)
        if rows is None:
            rows, self.att.rows.given = self.att.rows.given, None
        call = dict(zip(self.names, args, strict=False))
        call.update(kwargs)
        cache = next((call[k] for k in _CACHE_NAMES if call.get(k) is not None), None)
        self.att.rows.begin(
            input_ids=call.get("input_ids"),
            attention_mask=call.get("attention_mask"),
            position_ids=call.get("position_ids"),
            cache=cache,
            inputs_embeds=call.get("inputs_embeds"),
            rows=rows,
        )
        prefetch = getattr(self.att.table_sync, "prefetch", None)  # row-sharded tables across processes
        if prefetch is not None and self.att.rows.current is not None:
            prefetch(self.att.rows.current[0])
        return args, kwargs


class _ModelPostHook:
    def __init__(self, att: Any) -> None:
        self.att = att

    @outside_graph  # host work: a cache the model made gets its decode state
    def __call__(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.att.rows.end(output)


class _LayerHook:
    """Before decoder layer `layer_id`: hidden states h -> Engram(h, this layer's rows)."""

    def __init__(self, att: Any, layer_id: int) -> None:
        self.att, self.layer_id = att, layer_id
        self.index = att.config.layer_index(layer_id)
        self.key = str(layer_id)  # its name in att.layers, made here: dynamo cannot trace str(int)

    def __call__(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        current = self.att.rows.current
        if current is None:
            raise RuntimeError(
                f"Engram layer {self.layer_id} ran without rows: call the model that add_engram returned (its "
                "forward hashes the input ids), not one of its submodules"
            )
        rows, dead = current
        h = args[0] if args else kwargs["hidden_states"]
        if rows.shape[:2] != h.shape[:2]:
            raise ValueError(
                f"Engram rows cover {tuple(rows.shape[:2])} (batch, tokens) but layer {self.layer_id}'s hidden "
                f"states are {tuple(h.shape[:2])}"
            )
        if rows.device != h.device:  # moved once per call, for every Engram layer on that device
            rows, dead = rows.to(h.device), None if dead is None else dead.to(h.device)
            self.att.rows.current = (rows, dead)
        new = self.att.layers[self.key](h.unsqueeze(2), rows[:, :, self.index], dead).squeeze(2)
        if args:
            return (new, *args[1:]), kwargs
        kwargs["hidden_states"] = new
        return args, kwargs


class _ReorderCache:
    """The model's `_reorder_cache`, which generate() calls in beam search when a model has one."""

    def __init__(self, att: Any, previous: Any) -> None:
        self.att, self.previous = att, previous

    def __call__(self, cache: Any, beam_idx: torch.Tensor) -> Any:
        self.att.rows.reorder(cache, beam_idx)
        if self.previous is not None:
            return self.previous(cache, beam_idx)
        cache.reorder_cache(beam_idx)
        return cache


def install_hooks(model: nn.Module, owner: nn.Module, att: Any, decoder: list[nn.Module]) -> None:
    """Install the hooks of attachment `att` (an EngramAttachment) on `model`, on `owner` (the module
    whose forward runs the `decoder` layers) and on the layers."""
    params = inspect.signature(owner.forward).parameters
    if "input_ids" not in params:  # an unusual stack: hash at the outer model
        owner, params = model, inspect.signature(model.forward).parameters
    names = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    handles = [
        owner.register_forward_pre_hook(_ModelPreHook(att, names), with_kwargs=True),
        owner.register_forward_hook(_ModelPostHook(att), with_kwargs=True),
    ]
    if owner is not model:
        handles.append(model.register_forward_pre_hook(_TakeRows(att), with_kwargs=True))
    for lid in att.config.layer_ids:
        handles.append(decoder[lid].register_forward_pre_hook(_LayerHook(att, lid), with_kwargs=True))
    att.handles = handles
    model._reorder_cache = _ReorderCache(att, getattr(model, "_reorder_cache", None))


def remove_hooks(model: nn.Module, att: Any) -> None:
    """Remove the hooks `install_hooks` put on `model` (and its `_reorder_cache`)."""
    for h in att.handles:
        h.remove()
    att.handles = []
    model.__dict__.pop("_reorder_cache", None)
