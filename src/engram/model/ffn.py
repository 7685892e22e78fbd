"""The feed-forward layers of `EngramLM`'s blocks: the dense `SwiGLU` MLP and `MoE`, top-k routed
SwiGLU experts with a Switch/GShard load-balancing loss. Plain PyTorch on one device; knows nothing
of Engram. Design: docs/model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "SwiGLU", "load_balancing_loss"]


class SwiGLU(nn.Module):
    """w2(silu(x W3) * (x W1)) with W1, W3 fused in `w13`: dim -> hidden -> dim."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * a)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss num_experts * sum_i f_i * P_i, where f_i is the fraction of the
    N * k routing slots given to expert i and P_i the mean router probability of expert i.
    probs (N, E) softmax over all experts; chosen (N, k) expert ids. 1.0 when routing is uniform;
    gradients reach the router through P (f counts, it has none)."""
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).to(probs.dtype)  # (E,)
    fraction = counts / chosen.numel()
    return num_experts * (fraction * probs.mean(0)).sum()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts: a linear router scores the experts, each token goes to its k
    best, and their outputs are summed with weights softmax(top-k router logits) (the top-k
    probabilities renormalised). `aux_loss` holds the last forward's `load_balancing_loss`, for the
    trainer to add to the training loss (a coefficient times it)."""

    aux_loss: torch.Tensor | None

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(num_experts))
        self.aux_loss = None

    def expert_params(self) -> int:
        """Parameters of one expert."""
        return sum(p.numel() for p in self.experts[0].parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        logits = self.router(flat)  # (N, E)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # route in fp32
        probs = logits.softmax(-1)
        top_logits, chosen = logits.topk(self.top_k, dim=-1)  # (N, k); ties: the lower expert id
        weights = top_logits.softmax(-1).to(x.dtype)  # (N, k)
        self.aux_loss = load_balancing_loss(probs, chosen, self.num_experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(
                as_tuple=True
            )  # tokens routed to expert e; sync point on CUDA
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(shape)
