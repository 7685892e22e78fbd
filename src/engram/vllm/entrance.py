"""The Engram layer inside vLLM's compiled model: one opaque op, `torch.ops.engram.vllm_entrance`.

vLLM compiles each backbone's decoder stack (`LlamaModel` and the others, `fullgraph=True`; Inductor
on the CPU). Engram cannot be traced there: its gather checks row ids on the host and tiered tables
read memory-mapped files. So the layer is a registered custom op with a fake implementation (an
empty tensor of the stream's shape): torch.compile treats it as one opaque call, and the same op
runs in eager mode (`enforce_eager=True`), one code path for both. The op finds its layer by name in
vLLM's forward context (`no_compile_layers`, vLLM's `static_forward_context`), the way vLLM's own
attention op finds its layer, and its rows in the step the model's forward computed before entering
the compiled stack (host work: slot tokens, hashing, prefetch stay outside it). Under CUDA graphs the
op is one of the graph's splitting ops (`register_splitting_op`). Imported in vLLM's workers only.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from vllm.forward_context import get_forward_context, is_forward_context_available

__all__ = ["OP_NAME", "Entrance", "Served", "Step", "register_splitting_op"]

OP_NAME = "engram::vllm_entrance"


class Step(threading.local):
    """The rows of the forward in progress, [tokens, n_layers, heads] (None between forwards)."""

    rows: torch.Tensor | None = None


class Served:
    """One Engram layer as the op finds it in the forward context: the module and where its rows are."""

    def __init__(self, name: str, module: nn.Module, step: Step, layer_id: int, index: int) -> None:
        self.name, self.module, self.step, self.layer_id, self.index = name, module, step, layer_id, index

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        rows = self.step.rows
        if rows is None:
            raise RuntimeError(
                f"Engram layer {self.layer_id} ran without rows: the model's forward computes them; call it, "
                "not its decoder layers"
            )
        t = h.shape[0]
        return self.module(h[None, :, None, :], rows[None, :t, self.index], None)[0, :, 0]


def _served(name: str) -> Served:
    layer = get_forward_context().no_compile_layers.get(name) if is_forward_context_available() else None
    if not isinstance(layer, Served):
        raise RuntimeError(
            f"{OP_NAME} ran for {name!r} outside a forward of the model that registered it (vLLM sets the "
            "forward context around each model run)"
        )
    return layer


@torch.library.custom_op(OP_NAME, mutates_args=())
def vllm_entrance(h: torch.Tensor, name: str) -> torch.Tensor:
    """h [tokens, hidden] (the residual stream entering an Engram decoder layer) -> Engram(h)."""
    return _served(name)(h)


@vllm_entrance.register_fake
def _(h: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(h)


class Entrance:
    """Pre-hook of an Engram decoder layer: (positions, hidden, residual) -> (positions, Engram(h), None),
    h = hidden + residual (vLLM keeps the stream split; a norm without residual is the fused add + norm)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        positions, hidden, residual, *rest = args
        h = hidden if residual is None else hidden + residual
        return (positions, torch.ops.engram.vllm_entrance(h, self.name), None, *rest), kwargs


def register_splitting_op(compilation_config: Any) -> None:
    """Make the op split vLLM's compiled graph where CUDA graphs are captured (it runs host code)."""
    ops = getattr(compilation_config, "splitting_ops", None)
    if isinstance(ops, list) and OP_NAME not in ops:
        ops.append(OP_NAME)
