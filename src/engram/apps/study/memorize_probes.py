"""The measurements of `engram study memorize` (engram.apps.study.memorize), on any causal LM given as
`Logits`: a function of right-padded (ids [B, T], attention mask [B, T]) -> logits [B, T, V].

- `score`: does greedy decoding after a prompt produce the whole target (checked teacher-forced: the
  argmax at every target position is the target's token, which is what greedy decoding needs), and
  the target's log-probability (summed over its tokens);
- `greedy`: the next k greedy tokens after each prompt (the neighbour prompts' check);
- `position_losses`: next-token cross-entropy at every position of held-out blocks;
- `locality`: the same blocks without and with a memory patch, per batch, comparing the logits bit
  for bit before each block's first position that reads a patched row.
Right padding is safe for both models: attention is causal and Engram's n-grams look back only, so
the pads after a sequence change nothing before them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engram.memory.choose import FactTokens

__all__ = ["Logits", "greedy", "locality", "padded", "position_losses", "score"]

Logits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def padded(seqs: Sequence[Sequence[int]], pad: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [B, max len + extra]: the sequences right-padded with `pad` (mask 0 there)."""
    n = max(len(s) for s in seqs) + extra
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def score(
    logits: Logits, items: Sequence[FactTokens], pad: int, batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """(exact [N] bool, logprob [N] float64): greedy decoding after each item's prompt gives its whole
    target; the target's log-probability in nats (sum over its tokens)."""
    exact, logprob = [], []
    for b in range(0, len(items), batch_size):
        part = items[b : b + batch_size]
        ids, mask = padded([f.ids for f in part], pad)
        labels = torch.full_like(ids, -100)
        for i, f in enumerate(part):
            labels[i, f.prompt_len : len(f.ids)] = ids[i, f.prompt_len : len(f.ids)]
        out = logits(ids, mask)[:, :-1].float()  # (B, T-1, V): position t predicts t + 1
        nxt = labels[:, 1:]
        valid = nxt != -100
        at = out[valid]  # (K, V): the target positions only (a 49K vocabulary makes the rest costly)
        want = nxt[valid]
        lp = torch.zeros(valid.shape, dtype=torch.float64)
        lp[valid] = F.log_softmax(at.double(), -1).gather(-1, want[:, None])[:, 0]
        hit = torch.ones(valid.shape, dtype=torch.bool)
        hit[valid] = at.argmax(-1) == want
        logprob.append(lp.sum(1).numpy())
        exact.append(hit.all(1).numpy())
    return np.concatenate(exact), np.concatenate(logprob)


@torch.no_grad()
def greedy(
    logits: Logits, prompts: Sequence[Sequence[int]], k: int, pad: int, batch_size: int = 32
) -> list[list[int]]:
    """The next `k` greedy tokens after each prompt (k forward passes a batch, no cache)."""
    out: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        part = prompts[b : b + batch_size]
        ids, mask = padded(part, pad, extra=k)
        ends = torch.tensor([len(p) for p in part])
        rows = torch.arange(len(part))
        got = []
        for _ in range(k):
            nxt = logits(ids, mask)[rows, ends - 1].argmax(-1)  # (B,)
            ids[rows, ends] = nxt
            mask[rows, ends] = 1
            got.append(nxt)
            ends = ends + 1
        out.extend(torch.stack(got, 1).tolist())
    return out


def _nll(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1) float64 next-token cross-entropy of logits `out` (B, T, V) on `ids` (B, T)."""
    lp = F.log_softmax(out[:, :-1].double(), -1)
    return -lp.gather(-1, ids[:, 1:, None])[..., 0]


@torch.no_grad()
def position_losses(logits: Logits, blocks: torch.Tensor, batch_size: int = 8) -> np.ndarray:
    """[B, T-1] float64: the loss at every position of the held-out blocks [B, T]."""
    out = []
    for b in range(0, blocks.shape[0], batch_size):
        x = blocks[b : b + batch_size]
        out.append(_nll(logits(x, torch.ones_like(x)), x).numpy())
    return np.concatenate(out) if out else np.zeros((0, max(0, blocks.shape[1] - 1)))


@torch.no_grad()
def locality(
    logits: Logits,
    blocks: torch.Tensor,
    hits: np.ndarray,
    apply: Callable[[], Any],
    remove: Callable[[], Any],
    batch_size: int = 8,
) -> dict[str, Any]:
    """The held-out blocks [B, T] without and with a patch (`apply` / `remove` it around each batch's
    second pass). `hits` [B, T]: the positions that read a patched row (`engram.memory.patch_hits`).
    Returns the patched blocks' mean loss, the hits (count, per 1,000 tokens), the mean change of the
    loss at hit positions (|change| and signed) and at the positions after a block's first hit that
    read none (what attention carries), and the positions before each block's first hit with the count
    of those whose logits are bit-equal (every one, if a patch is local)."""
    before = equal = 0
    base_l, new_l = [], []
    for b in range(0, blocks.shape[0], batch_size):
        x = blocks[b : b + batch_size]
        ones = torch.ones_like(x)
        base = logits(x, ones).float()
        apply()
        try:
            new = logits(x, ones).float()
        finally:
            remove()
        same = (base.view(torch.int32) == new.view(torch.int32)).all(-1)  # (B, T): bit for bit
        for i in range(x.shape[0]):
            h = hits[b + i]
            first = int(np.argmax(h)) if h.any() else x.shape[1]
            before += first
            equal += int(same[i, :first].sum())
        base_l.append(_nll(base, x).numpy())
        new_l.append(_nll(new, x).numpy())
    lb, ln = np.concatenate(base_l), np.concatenate(new_l)
    change = ln - lb  # (B, T-1)
    at = hits[:, :-1]  # the loss at position t is read from position t's hidden state
    after = np.cumsum(hits, axis=1)[:, :-1] > 0
    later = after & ~at

    def mean(v: np.ndarray) -> float | None:
        return float(v.mean()) if v.size else None

    tokens = int(hits.size)
    return {
        "held_out_loss": float(ln.mean()),
        "base_loss": float(lb.mean()),
        "tokens": tokens,
        "hits": int(hits.sum()),
        "hits_per_1000": 1000.0 * float(hits.sum()) / max(tokens, 1),
        "hit_abs_change": mean(np.abs(change[at])),
        "hit_change": mean(change[at]),
        "later_positions": int(later.sum()),
        "later_abs_change": mean(np.abs(change[later])),
        "before_first_hit": before,
        "bit_equal": equal,
    }
