"""Prototype: vLLM's Llama with engram.model.module.Engram at chosen decoder layers' entrance.

Rows under continuous batching: one int32 token id per KV-cache slot (`self._slot_ids`), written
from the step's slot_mapping; a request's look-back ids before its chunk start are read through
its block-table row, as vLLM's own DeepSeek-V4.1 Engram (models/deepseek_v41/common/engram.py).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from engram.addressing.compression import TokenizerCompression
from engram.addressing.hashing import NgramHasher
from engram.config import EngramConfig
from engram.model.module import Engram

_LOG = os.environ.get("ENGRAM_PROTO_LOG")


def _log(**kw) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(kw) + "\n")


class _Rows:
    """The rows of the current forward, shared by the Engram layers (eager mode only)."""

    rows: torch.Tensor | None = None


class EngramLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", **kw) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kw)
        self.layer_id = extract_layer_index(prefix)
        self._engram: tuple | None = None  # (Engram, layer index, _Rows); not a submodule

    def forward(self, positions, hidden_states, residual, **kw):
        if self._engram is not None and self._engram[2].rows is not None:
            mod, index, holder = self._engram
            # the residual stream entering the layer: vLLM keeps it split as hidden + residual
            h = hidden_states if residual is None else hidden_states + residual
            t = h.shape[0]
            hidden_states = mod(h[None, :, None, :], holder.rows[None, :t, index], None)[0, :, 0]
            residual = None  # input_layernorm(x) with residual None == fused add + norm
        return super().forward(positions, hidden_states, residual, **kw)


class EngramLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=EngramLlamaDecoderLayer)
        hf = vllm_config.model_config.hf_config
        self.ecfg = EngramConfig.from_dict(hf.engram)
        self.hasher = NgramHasher(self.ecfg, TokenizerCompression.identity(self.ecfg.vocab_size))
        dtype = vllm_config.model_config.dtype
        self.engram = nn.Module()
        self.engram.layers = nn.ModuleDict(
            {str(lid): Engram(self.ecfg, lid, dtype=dtype) for lid in self.ecfg.layer_ids}
        )
        self._holder = _Rows()
        for lid in self.ecfg.layer_ids:
            self.model.layers[lid]._engram = (
                self.engram.layers[str(lid)], self.ecfg.layer_index(lid), self._holder)
        self.block_size = vllm_config.cache_config.block_size
        self._cache_config = vllm_config.cache_config  # get_current_vllm_config() is unset in forward
        self.lookback = self.ecfg.max_ngram_size - 1
        self._attn_name = self.model.layers[0].self_attn.attn.layer_name
        self._slot_ids = torch.full((0,), -1, dtype=torch.int32)

    # ---------------------------------------------------------------- rows
    def _rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata if is_forward_context_available() else None
        if isinstance(md, list):
            md = md[0]
        if not isinstance(md, dict) or self._attn_name not in md:  # profile / dummy run
            _log(kind="dummy", tokens=int(input_ids.shape[0]))
            return torch.from_numpy(self.hasher.hash(input_ids.cpu().numpy()))
        m = md[self._attn_name]
        if not getattr(self, "_shape_logged", False):
            self._shape_logged = True
            kv = self.model.layers[0].self_attn.attn.kv_cache
            cc = self._cache_config
            _log(kind="kv", kv_type=type(kv).__name__, kv_shape=list(kv.shape) if hasattr(kv, "shape") else
                 [list(x.shape) for x in kv], num_gpu_blocks=cc.num_gpu_blocks, block_size=cc.block_size,
                 md_type=type(m).__name__, bt_shape=list(m.block_table.shape), keys=list(md)[:3])
        n = int(m.num_actual_tokens)
        qsl = m.query_start_loc.tolist()
        bt, sm = m.block_table, m.slot_mapping[:n].to(torch.int64)
        ids = input_ids[:n].to(torch.int64)
        pos = positions[:n].to(torch.int64)
        need = int(sm.max()) + 1 if n else 0
        if need > self._slot_ids.numel():  # grow (a real plugin sizes it from the KV cache once)
            grown = torch.full((max(need, 2 * self._slot_ids.numel()),), -1, dtype=torch.int32)
            grown[: self._slot_ids.numel()] = self._slot_ids
            self._slot_ids = grown
        B = self.block_size
        out = torch.zeros((input_ids.shape[0], self.ecfg.n_layers, self.ecfg.rows_per_token), dtype=torch.int64)
        # Write this step's ids first: a request may hit the prefix cache on blocks another request
        # of the same step is filling (the scheduler caches blocks when it schedules them).
        self._slot_ids[sm] = ids.to(torch.int32)
        stats = {"reqs": len(qsl) - 1, "tokens": n, "from_slots": 0, "chunk_starts": []}
        for r in range(len(qsl) - 1):
            s, e = qsl[r], qsl[r + 1]
            if e <= s:
                continue
            start = int(pos[s])
            q = pos[s:e]
            slots = bt[r, q // B].to(torch.int64) * B + q % B
            assert torch.equal(slots, sm[s:e]), "block table / slot mapping disagree"
            k = min(start, self.lookback)
            back = torch.arange(start - k, start, dtype=torch.int64)
            prev = self._slot_ids[bt[r, back // B].to(torch.int64) * B + back % B].to(torch.int64)
            assert bool((prev >= 0).all()), f"unwritten look-back slot at position {start}"
            seg = torch.cat([prev, ids[s:e]]).numpy()
            out[s:e] = torch.from_numpy(self.hasher.hash(seg)[k:])
            stats["from_slots"] += k
            if e - s > 1 or start == 0:
                stats["chunk_starts"].append([start, e - s])
        _log(kind="step", **stats)
        return out

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        self._holder.rows = self._rows(input_ids, positions)
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            self._holder.rows = None

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ours: dict[str, torch.Tensor] = {}

        def backbone():
            for name, w in weights:
                if name.startswith("engram."):
                    ours[name] = w
                else:
                    yield name, w

        loaded = set(super().load_weights(backbone()))
        params = dict(self.named_parameters())
        for name, w in ours.items():
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded
