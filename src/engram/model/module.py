"""The Engram module (SPEC §6): lookup, projection, context gate, write into the residual streams.

`Engram(config, layer_id)` maps residual streams h (B, T, hc, dim) and this layer's rows
(B, T, heads) to the updated streams, in the `deepseek-v4.1` variant (fused `wkv`, signed-sqrt
gate, no conv; the Triton gate on CUDA), the paper's `demo-v1` (separate projections and
`ShortConv`) or Qwen4-Exp's PLE (`qwen4-exp-ple`: one key projection normed per stream, a dilated
depthwise conv whose state a caller carries for incremental decoding). Works on one device and
knows nothing of tiers, prefetch or sharding: those wrap it from outside by swapping its `table`.
Design: docs/model.md.
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram import kernels
from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout
from engram.config import EngramConfig, Variant
from engram.kernels.reference import gate, signed_sqrt_gate
from engram.model.graph_break import outside_graph
from engram.model.table import EngramTable, TrainableTable

__all__ = ["Engram", "GroupRMSNorm", "ShortConv", "signed_sqrt_gate"]


@functools.cache
def _cpu_gate() -> ModuleType:
    """`engram.kernels.cpu_gate`, imported (with numba) on the first CPU forward that can use it."""
    return importlib.import_module("engram.kernels.cpu_gate")


class GroupRMSNorm(nn.Module):
    """RMSNorm over groups of `group_size` of the last axis (one per residual stream), scaled by
    (1 + weight), computed in float32 and cast back (Qwen4-Exp's PLE norms; weight 0 = identity)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6, **kw: Any) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim={dim} is not a multiple of group_size={group_size}")
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.zeros(dim, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.float().unflatten(-1, (-1, self.group_size))
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * (1.0 + self.weight.float())).type_as(x)


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
    """One Engram layer of `config` at `layer_id`: lookup, projection, context gate, residual write.

    On CUDA with triton installed, the V4.1 gate after `wkv` runs as the fused kernel
    `engram.kernels.fused_gate`, and on the CPU without gradients as the numba kernel
    `engram.kernels.cpu_gate.gate` (their eager twin, which CPU training uses, is
    `engram.kernels.reference.gate`); set `use_kernels = False` on a module to keep the eager path.

    Args:
        config: The config.
        layer_id: A member of `config.layer_ids`.
        table: The layer's table; None makes a `TrainableTable` of the layout's rows (padded as
            the config asks). Offload and sharding swap it for another `EngramTable` later.
        hasher: Optional: lets `forward` take token ids instead of rows; it must have been made
            for this config.
        dtype: The parameters' dtype.
        device: The parameters' device.

    Raises:
        ValueError: The layer has no Engram module in the config, the table's width or rows do
            not fit the layout, or the hasher was made for another config.

    Examples:
        >>> import torch
        >>> from engram import Engram, EngramConfig, NgramHasher
        >>> config = EngramConfig.preset("tiny").replace(vocab_size=1000, compressed_vocab_size=1000)
        >>> engram = Engram(config, layer_id=1, hasher=NgramHasher(config))
        >>> h = torch.randn(2, 4, config.hc_mult, config.hidden_size)  # (B, T, hc, dim)
        >>> engram(h, token_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])).shape
        torch.Size([2, 4, 2, 64])
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
        layout = Layout(config).layer(layer_id)
        if table is None:  # padded rows (Qwen4-Exp: to a multiple of 128)
            table = TrainableTable(layout.table_rows, config.head_dim, dtype=dtype, device=device)
        if table.dim != config.head_dim:
            raise ValueError(
                f"table rows are {table.dim} wide but config {config.name!r} has head_dim={config.head_dim}"
            )
        if table.num_rows < layout.num_embeddings:
            raise ValueError(
                f"layer {layer_id}'s table has {table.num_rows} rows but its hash layout addresses "
                f"{layout.num_embeddings}; "
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
        elif config.variant is Variant.QWEN4_EXP_PLE:
            width = self.hc * self.dim  # the streams side by side, as transformers' hidden states
            eps = config.norm_eps
            self.key_proj = nn.Linear(d_in, width, bias=False, **kw)
            self.value_proj = nn.Linear(d_in, self.dim, bias=False, **kw)
            self.norm_key = GroupRMSNorm(width, self.dim, eps, **kw)
            self.norm_query = GroupRMSNorm(width, self.dim, eps, **kw)
            self.norm_conv = GroupRMSNorm(width, self.dim, eps, **kw)
            self.conv_dilation = config.max_ngram_size
            self.conv_state_len = (config.kernel_size - 1) * self.conv_dilation
            self.conv1d = nn.Conv1d(
                width, width, config.kernel_size, groups=width, dilation=self.conv_dilation, bias=False, **kw
            )
            nn.init.zeros_(self.conv1d.weight)  # as Qwen4-Exp initialises it: the conv starts silent
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
    # Outside torch.compile's graph (a graph break; eager and compiled run the same gather): every
    # table checks its row ids on the host (`check_rows`: a sync on the ids' range), a trainable
    # table's torch.unique has a data-dependent shape and its sparse gradient is a layout AOTAutograd
    # cannot trace, and the stored tables gather with numba / memory-mapped files. The projection and
    # gate after it compile.
    @outside_graph
    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The table's embeddings of rows, concatenated per position (outside torch.compile's graph).

        Args:
            rows: (B, T, heads) row ids.
            dtype: The embeddings' dtype.

        Returns:
            (B, T, heads * head_dim) embeddings in `dtype`.
        """
        return self.table.gather(rows, dtype).flatten(-2)

    def rows_for(self, token_ids: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's rows for token ids, hashed with the module's hasher.

        Hashed on the CPU (a sync point: in production, hash ahead of the forward pass and pass
        rows), or on the device for CUDA ids with triton. In `qwen4-exp-ple` the dead mask does not
        enter the hash (transformers hashes padding like any token).

        Args:
            token_ids: (B, T) token ids.
            dead_mask: (B, T) bool, True at dead positions.

        Returns:
            (B, T, heads) rows.

        Raises:
            ValueError: The module has no hasher.
        """
        if self.hasher is None:
            raise ValueError(
                "this Engram module has no hasher: pass rows, or build it with hasher=NgramHasher(...)"
            )
        if self.config.variant is Variant.QWEN4_EXP_PLE:
            dead_mask = None
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
        conv_state: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Add this layer's memory to the residual streams.

        Dead positions pass through unchanged (their gate is 0), except in `qwen4-exp-ple`, which
        does as transformers' `conv_mask` does: a dead position's gated value and conv input are 0,
        its conv output still sees the positions before it.

        Args:
            h: (B, T, hc, dim) residual streams.
            rows: (B, T, heads) this layer's rows; give exactly one of `rows` and `token_ids`.
            dead_mask: (B, T) bool, True at dead positions.
            token_ids: (B, T) token ids, hashed with the module's hasher (see `rows_for`).
            return_gates: Also return the gates.
            conv_state: `qwen4-exp-ple` only (from `new_conv_state(B)`): the conv's look-back,
                read and updated in place, for incremental decoding: start a state, run the prompt
                (rows from `HashStream.feed`), then one token at a time (rows from
                `HashStream.step`, T = 1), each call with the same state. Without it, h is a whole
                sequence from its start.

        Returns:
            The updated streams (B, T, hc, dim); with `return_gates`, the pair (streams, gates),
                gates (B, T, hc).

        Raises:
            ValueError: Both or neither of `rows` and `token_ids`, a shape that does not fit, or
                `conv_state` for another variant.
            TypeError: `h` is not floating point.
        """
        if (rows is None) == (token_ids is None):
            raise ValueError("pass exactly one of rows (B, T, heads) and token_ids (B, T)")
        if rows is None:
            rows = self.rows_for(token_ids, dead_mask).to(h.device)
        self._check(h, rows, dead_mask)
        e = self.lookup(rows, h.dtype)  # (B, T, heads*head_dim)
        if conv_state is not None and self.config.variant is not Variant.QWEN4_EXP_PLE:
            raise ValueError(
                f"conv_state is for variant 'qwen4-exp-ple'; this module is {self.config.variant.value!r}"
            )
        if self.config.variant is Variant.V4_1:
            out, gates = self._forward_v41(h, e, dead_mask)
        elif self.config.variant is Variant.QWEN4_EXP_PLE:
            out, gates = self._forward_ple(h, e, dead_mask, conv_state)
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
        clamp = self.config.gate_clamp
        # CPU training never takes a kernel: checked here, in traced code, so a compiled training
        # step keeps wkv and the gate in one graph
        grads = torch.is_grad_enabled() and any(x.requires_grad for x in (h, key, v, w))
        if self.use_kernels and not (h.is_cpu and grads):
            out = self._kernel_gate(h, key, v, w, dead_mask, eps, clamp)
            if out is not None:
                return out
        return gate(h, key, v, w, dead_mask, eps, clamp)  # the eager twin

    # Outside torch.compile's graph, so a compiled model runs the kernel eager mode runs and gives
    # the same bits (numba cannot be traced; the Triton gate is an autograd.Function around a
    # hand-written kernel). Where no kernel applies (CPU training), the twin is traced and compiled.
    @outside_graph
    def _kernel_gate(
        self,
        h: torch.Tensor,
        key: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        dead_mask: torch.Tensor | None,
        eps: float,
        clamp: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The V4.1 gate by a kernel (numba on the CPU without gradients, Triton on CUDA), or None."""
        if h.is_cpu:
            cpu_gate = _cpu_gate()
            if cpu_gate.applies(h, key, v, w):  # no gradients: one numba pass over the positions
                return cpu_gate.gate(h, key, v, w, dead_mask, eps, clamp)
        elif kernels.use_triton(h, key):  # CUDA + triton: the gate as one fused kernel
            return kernels.fused_gate(h, key, v, w, dead_mask, eps, clamp)
        return None

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

    # ------------------------------------------------------------------ Qwen4-Exp PLE
    def new_conv_state(
        self, batch_size: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """A zero conv look-back for incremental decoding (`qwen4-exp-ple`).

        Reorder it with index_select for beam search, like the rows' HashStream.

        Args:
            batch_size: B.
            dtype: Default: the conv weight's.
            device: Default: the conv weight's.

        Returns:
            Zeros (B, hc*dim, (kernel_size-1)*max_ngram_size), to pass as `forward`'s `conv_state`.

        Raises:
            ValueError: The module is not `qwen4-exp-ple`.
        """
        if self.config.variant is not Variant.QWEN4_EXP_PLE:
            raise ValueError(f"variant {self.config.variant.value!r} has no conv state to carry")
        w = self.conv1d.weight
        return torch.zeros(
            batch_size,
            self.hc * self.dim,
            self.conv_state_len,
            dtype=w.dtype if dtype is None else dtype,
            device=w.device if device is None else device,
        )

    def _forward_ple(
        self,
        h: torch.Tensor,
        e: torch.Tensor,
        dead_mask: torch.Tensor | None,
        conv_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = h.shape[:2]
        width = self.hc * self.dim
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.hc, self.dim))
        value = self.value_proj(e)  # (B, T, dim), shared by the streams
        query = self.norm_query(h.reshape(b, t, width)).unflatten(-1, (self.hc, self.dim))
        dot = (key * query).sum(-1, keepdim=True) / math.sqrt(self.dim)  # (B, T, hc, 1)
        # sign(0) = 0 here (transformers' form), where signed_sqrt_gate's copysign keeps +-clamp
        gates = torch.sigmoid(dot.abs().clamp_min(self.config.gate_clamp).sqrt() * dot.sign())
        gated = gates * value.unsqueeze(-2)  # (B, T, hc, dim)
        normed = self.norm_conv(gated.flatten(-2))
        gated = gated.flatten(-2)
        if dead_mask is not None:
            keep = (~dead_mask)[..., None]
            gated, normed = gated * keep, normed * keep
        out = gated + self._ple_conv(normed, conv_state)
        return h + out.view(b, t, self.hc, self.dim), gates.squeeze(-1)

    def _ple_conv(self, x: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """SiLU of the causal dilated depthwise conv of x (B, T, hc*dim), after `state` if given."""
        x = x.transpose(1, 2)  # (B, C, T)
        n = self.conv_state_len
        if state is None:
            full = F.pad(x, (n, 0))
        else:
            if state.shape != (x.shape[0], x.shape[1], n):
                raise ValueError(
                    f"conv_state must have shape {(x.shape[0], x.shape[1], n)} (from new_conv_state), "
                    f"got {tuple(state.shape)}"
                )
            full = torch.cat([state.to(x.dtype), x], dim=-1)
            state.copy_(full[..., full.shape[-1] - n :].detach())
        return F.silu(self.conv1d(full)).transpose(1, 2)
