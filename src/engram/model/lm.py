"""A small decoder-only language model with Engram, sized for CPUs (the demo's and tests' model).

`EngramLM` (configured by `LMConfig`): embedding -> `hc` residual streams -> blocks (attention,
SwiGLU MLP or top-k routed `MoE` experts, mixed across streams by `HyperConnection` when hc > 1) ->
LM head, with an `Engram` module at the entrance of the blocks the config names. Knows nothing of
hashing: rows are hashed outside the model and passed in as `engram_rows` [B, T, n_engram_layers,
heads]; `engram_scale=0` masks Engram's output (ablation). `EngramMode` holds the studies' other
uses of the same rows: the gate fixed at 1, and a plain hashed n-gram input embedding (the
Over-Tokenized / SCONE family's baseline). Design: docs/model.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram.addressing.layout import Layout
from engram.config import EngramConfig, Variant
from engram.model.ffn import MoE, SwiGLU
from engram.model.module import Engram
from engram.model.table import EngramTable, TrainableTable

__all__ = ["EngramLM", "EngramMode", "HyperConnection", "LMConfig"]


class EngramMode(enum.StrEnum):
    """What the model does with its Engram config's rows."""

    GATED = "gated"  # the Engram module: lookup, projection, context gate (the default)
    FIXED_GATE = "fixed-gate"  # the module with its gate fixed at 1: h + v (ablation; v4.1 variant)
    # No Engram module: per order, the token's K head rows concatenated (K * head_dim == dim), the
    # orders averaged, added to the token embedding; no gate, no projection (a baseline).
    INPUT_EMBEDDING = "input-embedding"


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 512  # SwiGLU hidden width
    max_seq_len: int = 256
    hc: int = 1  # residual streams; 1 = plain residual
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    sinkhorn_iters: int = 8
    engram_zero_init: bool = True  # Engram's value projection starts at zero (identity at init)
    engram: EngramConfig | None = field(default=None)
    engram_mode: EngramMode = EngramMode.GATED
    # feed-forward: moe_experts = 0 is the dense SwiGLU of mlp_hidden; else top-k routed experts of
    # moe_hidden each (None: mlp_hidden // moe_top_k, the dense MLP's activated width)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_hidden: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "engram_mode", EngramMode(self.engram_mode))
        except ValueError:
            raise ValueError(
                f"engram_mode={self.engram_mode!r}: use one of {', '.join(repr(m.value) for m in EngramMode)}"
            ) from None
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "mlp_hidden", "max_seq_len", "hc"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMConfig.{name}={getattr(self, name)} must be >= 1")
        if self.moe_experts < 0:
            raise ValueError(f"moe_experts={self.moe_experts} must be >= 0 (0: the dense SwiGLU MLP)")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} must be in [1, moe_experts={self.moe_experts}]")
        if self.moe_experts and self.expert_hidden < 1:
            raise ValueError(
                f"moe_hidden={self.moe_hidden} (mlp_hidden={self.mlp_hidden} // moe_top_k={self.moe_top_k}) "
                "must be >= 1"
            )
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of even width")
        for name, high in (("rope_theta", 1e12), ("norm_eps", 1.0), ("init_std", 1.0)):
            v = getattr(self, name)  # NaN passes a `<= 0` check: finite and in range, said as such
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (math.isfinite(v) and 0 < v <= high)
            ):
                raise ValueError(f"LMConfig.{name}={v!r} must be a finite number in (0, {high:g}]")
        e = self.engram
        if e is not None:
            problems = []
            if e.hidden_size != self.dim:
                problems.append(f"engram hidden_size={e.hidden_size} but the model's dim={self.dim}")
            if e.hc_mult != self.hc:
                problems.append(f"engram hc_mult={e.hc_mult} but the model has hc={self.hc} streams")
            if e.vocab_size != self.vocab_size:
                problems.append(
                    f"engram vocab_size={e.vocab_size} but the model's vocab_size={self.vocab_size}"
                )
            if max(e.layer_ids) >= self.n_layers:
                problems.append(f"engram layer_ids={e.layer_ids} but the model has {self.n_layers} layers")
            if self.engram_mode is EngramMode.FIXED_GATE and e.variant is not Variant.V4_1:
                problems.append(f"engram_mode='fixed-gate' needs the v4.1 variant, not {e.variant.value!r}")
            if self.engram_mode is EngramMode.INPUT_EMBEDDING and e.n_heads * e.head_dim != self.dim:
                problems.append(
                    f"engram_mode='input-embedding' concatenates an order's {e.n_heads} heads of {e.head_dim} "
                    f"into the {self.dim}-wide embedding: n_heads * head_dim must equal dim"
                )
            if problems:
                raise ValueError("LMConfig and its EngramConfig disagree: " + "; ".join(problems))

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one MoE expert."""
        return self.moe_hidden if self.moe_hidden is not None else self.mlp_hidden // self.moe_top_k

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def without_engram(self) -> LMConfig:
        """The identical backbone with no Engram modules (the baseline)."""
        return LMConfig(**{**self.__dict__, "engram": None})

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "engram"}
        d["engram"] = None if self.engram is None else self.engram.to_dict()
        d["engram_mode"] = self.engram_mode.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LMConfig:
        d = dict(d)
        e = d.pop("engram", None)
        if e is not None and "engram_layer_ids" in e:
            raise ValueError(
                "this LM config holds its Engram settings as Hugging Face engram_* keys (engram-lm 0.1 checkpoints); retrain, or read them with engram.checkpoint.hf_config.from_hf_dict"
            )
        return cls(**d, engram=None if e is None else EngramConfig.from_dict(e))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim. x (B, H, T, hd); cos/sin (T, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.head_dim
        self.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )  # (B, H, T, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class HyperConnection(nn.Module):
    """Residual connection over hc streams x (B, T, hc, D) around one sublayer f:
    u = sum_m a_m x_m (a = softmax); x <- M x + b * f(u), M doubly stochastic (Sinkhorn)."""

    def __init__(self, hc: int, iters: int = 8) -> None:
        super().__init__()
        self.hc, self.iters = hc, iters
        self.read_logits = nn.Parameter(torch.zeros(hc))
        self.mix_logits = nn.Parameter(torch.eye(hc) * 4.0)  # near identity at init
        self.write = nn.Parameter(torch.ones(hc))

    def mix_matrix(self) -> torch.Tensor:
        """(hc, hc) doubly-stochastic matrix (rows and columns sum to 1)."""
        log_m = self.mix_logits
        for _ in range(self.iters):
            log_m = log_m - log_m.logsumexp(dim=1, keepdim=True)
            log_m = log_m - log_m.logsumexp(dim=0, keepdim=True)
        return log_m.exp()

    def read(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btmd,m->btd", x, self.read_logits.softmax(0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (B, T, hc, D) streams, y (B, T, D) sublayer output -> new streams."""
        return torch.einsum("nm,btmd->btnd", self.mix_matrix(), x) + self.write[:, None] * y[:, :, None, :]


class Block(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(c.dim, eps=c.norm_eps), nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attn = Attention(c)
        self.mlp: nn.Module = (
            MoE(c.dim, c.expert_hidden, c.moe_experts, c.moe_top_k)
            if c.moe_experts
            else SwiGLU(c.dim, c.mlp_hidden)
        )
        self.hc = c.hc
        if c.hc > 1:
            self.attn_hc, self.mlp_hc = (
                HyperConnection(c.hc, c.sinkhorn_iters),
                HyperConnection(c.hc, c.sinkhorn_iters),
            )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.hc == 1:  # x (B, T, 1, D): a plain residual
            h = x[:, :, 0]
            h = h + self.attn(self.attn_norm(h), cos, sin)
            h = h + self.mlp(self.mlp_norm(h))
            return h[:, :, None]
        x = self.attn_hc(x, self.attn(self.attn_norm(self.attn_hc.read(x)), cos, sin))
        return self.mlp_hc(x, self.mlp(self.mlp_norm(self.mlp_hc.read(x))))


class EngramLM(nn.Module):
    """Decoder LM; Engram modules (if configured) sit at the entrance of their blocks.

    `table_factory(engram_config, layer_id) -> EngramTable` gives each Engram layer its table
    (default: a `TrainableTable`); systems code uses it to build tables that never exist whole on
    one process (e.g. `engram.distributed`'s row-sharded tables) without this class knowing them.
    """

    def __init__(
        self,
        config: LMConfig,
        *,
        table_factory: Callable[[EngramConfig, int], EngramTable] | None = None,
    ) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.head = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.collapse_logits = nn.Parameter(torch.zeros(c.hc)) if c.hc > 1 else None
        self.engrams = nn.ModuleDict()
        self.ngram_embed: TrainableTable | None = None
        self.reset_parameters()  # the backbone draws first: with or without Engram, same initial weights
        if c.engram is not None and c.engram_mode is EngramMode.INPUT_EMBEDDING:
            rows = Layout(c.engram).layer(c.engram.layer_ids[0]).num_embeddings
            self.ngram_embed = TrainableTable(rows, c.engram.head_dim, init_std=c.init_std)
        elif c.engram is not None:
            for lid in c.engram.layer_ids:
                table = None if table_factory is None else table_factory(c.engram, lid)
                self.engrams[str(lid)] = Engram(c.engram, lid, table=table)
            self._init_engram()
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        freqs = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float32), inv)  # (T, hd/2)
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    def reset_parameters(self) -> None:
        """Initialise the backbone (Engram modules keep their own initialisation)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.startswith("engrams.") or p.dim() < 2:
                continue  # Engram modules and norms/mixing keep their own init
            scale = (
                1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
            )
            nn.init.normal_(p, std=std * scale)

    def _init_engram(self) -> None:
        if not self.config.engram_zero_init:
            return
        # Engram starts as the identity: its value projection is zero, so the untrained table's
        # random rows add no noise to the streams; the keys (and so the gates) still get gradients.
        with torch.no_grad():
            for module in self.engrams.values():
                if hasattr(module, "wkv"):
                    module.wkv.weight[self.config.hc * self.config.dim :].zero_()
                else:
                    module.value_proj.weight.zero_()
                    module.value_proj.bias.zero_()

    @property
    def needs_rows(self) -> bool:
        """Whether forward needs `engram_rows` (an Engram module or the n-gram input embedding)."""
        return bool(self.engrams) or self.ngram_embed is not None

    def num_params(self) -> dict[str, int]:
        """Total parameters; Engram table rows and MoE experts not chosen for a token are not
        activated: `activated` counts the rows a token reads and its top-k experts."""
        c = self.config
        total = sum(p.numel() for p in self.parameters())
        tables = [m.table for m in self.engrams.values()]
        if self.ngram_embed is not None:
            tables.append(self.ngram_embed)
        table = sum(t.weight.numel() for t in tables)
        heads = c.engram.rows_per_token * c.engram.head_dim if c.engram else 0
        idle_experts = sum(
            (b.mlp.num_experts - b.mlp.top_k) * b.mlp.expert_params()
            for b in self.blocks
            if isinstance(b.mlp, MoE)
        )
        return {
            "total": total,
            "engram_tables": table,
            "moe_idle_experts": idle_experts,
            "activated": total - table + heads * len(tables) - idle_experts,
        }

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE blocks' load-balancing losses of the last forward, summed (None: no MoE)."""
        losses = [
            b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None

    def forward(
        self,
        input_ids: torch.Tensor,
        engram_rows: torch.Tensor | None = None,
        *,
        dead_mask: torch.Tensor | None = None,
        engram_scale: float = 1.0,
        return_gates: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids (B, T) -> logits (B, T, vocab). engram_rows (B, T, n_engram_layers, heads).

        `engram_scale` multiplies what Engram adds to the streams (0 masks it: the paper's ablation).
        With `return_gates`, also {layer_id: gates (B, T, hc)}.
        """
        b, t = input_ids.shape
        c = self.config
        if t > c.max_seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than max_seq_len={c.max_seq_len}")
        if self.needs_rows and engram_rows is None:
            raise ValueError(
                "this model has Engram layers: pass engram_rows (hash the input ids with NgramHasher)"
            )
        emb = self.embed(input_ids)
        if self.ngram_embed is not None:
            e = c.engram
            rows = self.ngram_embed.gather(engram_rows[:, :, 0], emb.dtype)  # (B, T, orders*K, hd)
            emb = emb + engram_scale * rows.reshape(b, t, len(e.orders), c.dim).mean(2)
        x = emb[:, :, None].expand(b, t, c.hc, c.dim)  # streams start as copies
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        gates: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            if str(i) in self.engrams:
                module = self.engrams[str(i)]
                rows = engram_rows[:, :, c.engram.layer_index(i)]
                if c.engram_mode is EngramMode.FIXED_GATE:
                    new, g = self._fixed_gate(module, x, rows)
                else:
                    new, g = module(x, rows, dead_mask, return_gates=True)
                x = new if engram_scale == 1.0 else x + engram_scale * (new - x)
                gates[i] = g
            x = block(x, cos, sin)
        if c.hc == 1:
            h = x[:, :, 0]
        else:
            h = torch.einsum("btmd,m->btd", x, self.collapse_logits.softmax(0))
        h = self.norm(h)
        logits = self.head(h) if self.head is not None else h @ self.embed.weight.T
        return (logits, gates) if return_gates else logits

    @staticmethod
    def _fixed_gate(module: Engram, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The v4.1 Engram `module` with its gate fixed at 1: x + v on every stream (the keys are
        computed by the fused projection but unused). x (B, T, hc, D), rows (B, T, heads)."""
        b, t, hc, dim = x.shape
        v = module.wkv(module.lookup(rows, x.dtype)).view(b, t, hc + 1, dim)[:, :, hc]  # (B, T, D)
        return x + v[:, :, None], torch.ones(b, t, hc, dtype=x.dtype, device=x.device)
