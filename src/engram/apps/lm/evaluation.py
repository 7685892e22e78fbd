"""Held-out evaluation: mean next-token loss (nats/token), overall and per text category, with the
pieces the distributed evaluation shares. Knows the model's forward and `TokenStream`, not training.
Design: docs/training.md.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engram.apps.lm.data import TokenStream
from engram.device import Precision, autocast, to_device
from engram.model.lm import EngramLM

__all__ = ["MAX_LOSS", "eval_summary", "evaluate", "perplexity", "score_windows", "window_rows"]

# The largest mean loss (nats/token) whose perplexity float64 holds: log(1.8e308) = 709.78. Past it
# the model gives the true tokens a probability below any float64: training has diverged.
MAX_LOSS = math.log(sys.float_info.max)


def perplexity(loss: float) -> float:
    """exp(loss); inf for a loss past MAX_LOSS (a diverged model), NaN for NaN."""
    return math.inf if loss > MAX_LOSS else math.exp(loss)


def window_rows(rows: torch.Tensor | None, starts: np.ndarray, seq_len: int) -> torch.Tensor | None:
    """The Engram rows (B, T, layers, heads) of the windows at `starts` from a stream's rows (N, ...)."""
    if rows is None:
        return None
    return rows[torch.from_numpy(starts[:, None] + np.arange(seq_len))]  # (B, T, layers, heads)


@torch.no_grad()
def evaluate(
    model: EngramLM,
    stream: TokenStream,
    rows: torch.Tensor | None,
    seq_len: int,
    *,
    max_tokens: int | None = None,
    batch_size: int = 32,
    engram_scale: float = 1.0,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """Mean next-token loss (nats) over non-overlapping windows of `stream`, overall and per category,
    on the model's device (`precision` bf16: the forwards under autocast, the losses summed in float64).
    `max_tokens`: score a fixed sample of about that many tokens, windows spread over every document
    (`TokenStream.sample_starts`: the periodic evaluation's estimate of the full one); None: all."""
    was_training = model.training
    model.eval()
    starts = stream.eval_starts(seq_len, max_tokens)
    n_cat = len(stream.categories)
    loss_sum = torch.zeros(n_cat, dtype=torch.float64)
    count = torch.zeros(n_cat, dtype=torch.float64)
    use_rows = rows if model.needs_rows else None
    device = next(model.parameters()).device
    with autocast(device, precision):
        for i in range(0, len(starts), batch_size):
            s = starts[i : i + batch_size]
            score_windows(model, stream, use_rows, s, seq_len, loss_sum, count, engram_scale, device)
    model.train(was_training)
    return eval_summary(stream, loss_sum, count)


def score_windows(
    model: EngramLM,
    stream: TokenStream,
    rows: torch.Tensor | None,
    starts: np.ndarray,
    seq_len: int,
    loss_sum: torch.Tensor,
    count: torch.Tensor,
    engram_scale: float = 1.0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Add the next-token losses of the windows at `starts` into loss_sum / count (float64, one slot
    per text category); return the batch's logits (B, T, vocab) on the model's device. One evaluation
    batch; `evaluate`, the distributed evaluation and `engram quantise-check` share it."""
    x, y = stream.windows(starts, seq_len)
    r = window_rows(rows, starts, seq_len)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    if device is not None:
        xt, yt = to_device(xt, device), to_device(yt, device)
        r = None if r is None else to_device(r, device)
    logits = model(xt, r, engram_scale=engram_scale)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), yt.flatten(), reduction="none")
    cats = torch.from_numpy(stream.category_ids[starts[:, None] + 1 + np.arange(seq_len)].astype(np.int64))
    losses = losses.to(loss_sum.device)  # sync point on CUDA: the sums live on the host
    loss_sum.index_add_(0, cats.flatten(), losses.double())
    count.index_add_(0, cats.flatten(), torch.ones_like(losses, dtype=torch.float64))
    return logits


def eval_summary(stream: TokenStream, loss_sum: torch.Tensor, count: torch.Tensor) -> dict[str, Any]:
    """evaluate()'s result from per-category loss sums and token counts (float64)."""
    total = float(loss_sum.sum() / count.sum())
    per_cat = {c: float(loss_sum[j] / count[j]) for j, c in enumerate(stream.categories) if count[j] > 0}
    return {"loss": total, "ppl": perplexity(total), "tokens": int(count.sum()), "per_category": per_cat}
