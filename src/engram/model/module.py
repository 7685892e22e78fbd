"""The Engram module (SPEC §6): lookup, projection, context gate, write into the residual streams.

`Engram(config, layer_id)` maps residual streams h (B, T, hc, dim) and this layer's rows
(B, T, heads) to the updated streams, in the `deepseek-v4.1` variant (fused `wkv`, signed-sqrt
gate, no conv; the Triton gate on CUDA) or the paper's `demo-v1` (separate projections and
`ShortConv`). Works on one device and knows nothing of tiers, prefetch or sharding: those wrap
it from outside by swapping its `table`. Design: docs/model.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram import kernels
from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout
from engram.config import EngramConfig, Variant
from engram.kernels.reference import gate, signed_sqrt_gate
from engram.model.table import EngramTable, TrainableTable

__all__ = ["Engram", "ShortConv", "signed_sqrt_gate"]


class ShortConv(nn.Module):
    """The demo's short causal conv over (B, T, hc, dim): per-stream RMSNorm, depthwise conv of
    `kernel_size` taps spaced `dilation` apart (causal: left padding only), SiLU."""

    def __init__(self, dim: int, hc: int, kernel_size: int = 4, dilation: int = 1, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.hc, self.kernel_size, self.dilation = dim, hc, kernel_size, dilation
        self.norms = nn.ModuleList(nn.RMSNorm(dim, eps=eps) for _ in range(hc))
        channels = hc * dim
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hc, dim = x.shape
        normed = torch.cat([self.norms[m](x[:, :, m]) for m in range(hc)], dim=-1)  # (B, T, hc*dim)
        pad = (self.kernel_size - 1) * self.dilation
        y = self.conv(F.pad(normed.transpose(1, 2), (pad, 0)))  # (B, hc*dim, T), causal
        return F.silu(y).transpose(1, 2).reshape(b, t, hc, dim)


class Engram(nn.Module):
    """One Engram layer of `config` at `layer_id` (a member of `config.layer_ids`).

    On CUDA with triton installed, the V4.1 gate after `wkv` runs as the fused kernel
    `engram.kernels.fused_gate` (its eager twin is `engram.kernels.reference.gate`); set
    `use_kernels = False` on a module to keep the eager path.
    """

    use_kernels: bool = True

    def __init__(
        self,
        config: EngramConfig,
        layer_id: int,
        *,
        table: EngramTable | None = None,
        hasher: NgramHasher | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        config.layer_index(layer_id)  # raises for a layer without Engram
        self.config, self.layer_id = config, layer_id
        self.hc, self.dim = config.hc_mult, config.hidden_size
        self.heads = config.rows_per_token
        rows = Layout(config).layer(layer_id).num_embeddings
        if table is None:
            table = TrainableTable(rows, config.head_dim, dtype=dtype, device=device)
        if table.dim != config.head_dim:
            raise ValueError(
                f"table rows are {table.dim} wide but config {config.name!r} has head_dim={config.head_dim}"
            )
        if table.num_rows < rows:
            raise ValueError(
                f"layer {layer_id}'s table has {table.num_rows} rows but its hash layout addresses {rows}; "
                "the table was made for another config"
            )
        self.table = table
        if hasher is not None and hasher.config.replace(name=config.name) != config.replace(name=config.name):
            raise ValueError(
                f"the hasher was made for config {hasher.config.name!r}, not for {config.name!r}"
            )
        self.hasher = hasher  # optional: lets forward() take token ids instead of rows
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        d_in = config.engram_dim
        if config.variant is Variant.V4_1:
            self.wkv = nn.Linear(d_in, (self.hc + 1) * self.dim, bias=False, **kw)
            self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim, **kw))
            self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim, **kw))
        else:
            self.value_proj = nn.Linear(d_in, self.dim, **kw)
            self.key_projs = nn.ModuleList(nn.Linear(d_in, self.dim, **kw) for _ in range(self.hc))
            # nn.RMSNorm's default eps (the dtype's machine epsilon), as the demo leaves it
            self.key_norms = nn.ModuleList(nn.RMSNorm(self.dim, **kw) for _ in range(self.hc))
            self.query_norms = nn.ModuleList(nn.RMSNorm(self.dim, **kw) for _ in range(self.hc))
            self.short_conv = ShortConv(self.dim, self.hc, config.kernel_size, config.max_ngram_size).to(**kw)

    # ------------------------------------------------------------------ checks
    def _check(self, h: torch.Tensor, rows: torch.Tensor, dead_mask: torch.Tensor | None) -> None:
        if h.dim() != 4 or h.shape[2] != self.hc or h.shape[3] != self.dim:
            raise ValueError(
                f"h must be the residual streams [B, T, hc={self.hc}, dim={self.dim}], got shape {tuple(h.shape)}"
                + (" (add the stream axis with h.unsqueeze(2) for hc=1)" if h.dim() == 3 else "")
            )
        if rows.shape != (*h.shape[:2], self.heads):
            hint = ""
            if rows.dim() == 4:
                hint = f"; select this layer's rows: rows[:, :, config.layer_index({self.layer_id})]"
            raise ValueError(
                f"rows must have shape [B, T, {self.heads}] = {(*h.shape[:2], self.heads)}, got "
                f"{tuple(rows.shape)}{hint}"
            )
        if not h.is_floating_point():
            raise TypeError(f"h must be floating point, got {h.dtype}")
        if dead_mask is not None and (dead_mask.dtype != torch.bool or dead_mask.shape != h.shape[:2]):
            raise ValueError(
                f"dead_mask must be bool [B, T] = {tuple(h.shape[:2])}, got "
                f"{dead_mask.dtype} {tuple(dead_mask.shape)}"
            )

    # ------------------------------------------------------------------ forward
    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, T, heads) rows -> (B, T, heads * head_dim) embeddings in `dtype`."""
        return self.table.gather(rows, dtype).flatten(-2)

    def rows_for(self, token_ids: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's rows (B, T, heads) for token ids (B, T), hashed on the CPU (a sync point:
        in production, hash ahead of the forward pass and pass rows)."""
        if self.hasher is None:
            raise ValueError(
                "this Engram module has no hasher: pass rows, or build it with hasher=NgramHasher(...)"
            )
        rows = self.hasher.hash(token_ids, dead_mask)
        return rows[..., self.config.layer_index(self.layer_id), :]

    def forward(
        self,
        h: torch.Tensor,
        rows: torch.Tensor | None = None,
        dead_mask: torch.Tensor | None = None,
        *,
        token_ids: torch.Tensor | None = None,
        return_gates: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, hc, dim), rows (B, T, heads) or token_ids (B, T), dead_mask (B, T) True = dead.

        Returns the updated streams (B, T, hc, dim); with `return_gates`, also the gates (B, T, hc).
        Dead positions pass through unchanged (their gate is 0).
        """
        if (rows is None) == (token_ids is None):
            raise ValueError("pass exactly one of rows (B, T, heads) and token_ids (B, T)")
        if rows is None:
            rows = self.rows_for(token_ids, dead_mask).to(h.device)
        self._check(h, rows, dead_mask)
        e = self.lookup(rows, h.dtype)  # (B, T, heads*head_dim)
        if self.config.variant is Variant.V4_1:
            out, gates = self._forward_v41(h, e, dead_mask)
        else:
            out, gates = self._forward_demo(h, e, dead_mask)
        return (out, gates) if return_gates else out

    def _forward_v41(
        self, h: torch.Tensor, e: torch.Tensor, dead_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = h.shape[:2]
        kv = self.wkv(e).view(b, t, self.hc + 1, self.dim)  # (B, T, hc+1, dim)
        key, v = kv[:, :, : self.hc], kv[:, :, self.hc]  # (B, T, hc, dim), (B, T, dim)
        eps = self.config.norm_eps
        w = self.q_weight * self.k_weight  # (hc, dim)
        if self.use_kernels and kernels.use_triton(h, kv):  # CUDA + triton: the gate as one fused kernel
            return kernels.fused_gate(h, key, v, w, dead_mask, eps, self.config.gate_clamp)
        return gate(h, key, v, w, dead_mask, eps, self.config.gate_clamp)  # the eager twin

    def _forward_demo(
        self, h: torch.Tensor, e: torch.Tensor, dead_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gates = []
        for m in range(self.hc):
            key = self.key_norms[m](self.key_projs[m](e))  # (B, T, dim)
            query = self.query_norms[m](h[:, :, m])
            gates.append(signed_sqrt_gate((key * query).sum(-1) * self.dim**-0.5, self.config.gate_clamp))
        g = torch.stack(gates, dim=2)  # (B, T, hc)
        if dead_mask is not None:
            g = g.masked_fill(dead_mask[..., None], 0.0)
        value = g[..., None] * self.value_proj(e)[:, :, None, :]  # (B, T, hc, dim)
        out = value + self.short_conv(value)
        if dead_mask is not None:  # the conv would carry earlier values into a dead position
            out = out.masked_fill(dead_mask[..., None, None], 0.0)
        return h + out, g
