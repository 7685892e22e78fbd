"""Probes beyond perplexity for a causal LM on held-out text (`engram study pretrained`).

(a) Memory against generalisation: next-token accuracy on held-out blocks, split by whether the
position's n-gram (the `n - 1` tokens up to the position and the target) occurred in the training
text (`seen_mask`, `split_accuracy`). (b) A cloze test on fixed phrases: frequent n-grams of the
training text that recur in the held-out text (`cloze_phrases`), each held-out occurrence asked with
its preceding context, the phrase's last token(s) completed greedily (`cloze_items`, `cloze_accuracy`).
Token ids in, numbers out: any model whose forward takes `input_ids` and returns `.logits`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ClozeItems",
    "cloze_accuracy",
    "cloze_items",
    "cloze_phrases",
    "greedy_predictions",
    "greedy_predictions_and_loss",
    "ngram_set",
    "seen_mask",
    "split_accuracy",
]

SEEN, UNSEEN, NO_NGRAM = 1, 0, -1  # seen_mask's values


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n-gram length {n!r}: give a whole number >= 1")


def _ngrams(ids: Sequence[int], n: int) -> Iterable[tuple[int, ...]]:
    ids = list(ids)
    return (tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))


def ngram_set(streams: Iterable[Sequence[int]], n: int) -> set[tuple[int, ...]]:
    """Every n-gram (a tuple of `n` ids) of the token streams (n-grams do not cross streams)."""
    _check_n(n)
    out: set[tuple[int, ...]] = set()
    for s in streams:
        out.update(_ngrams(s, n))
    return out


def seen_mask(blocks: torch.Tensor, seen: set[tuple[int, ...]], n: int) -> torch.Tensor:
    """[B, T-1] int8 for the targets `blocks[:, 1:]`: SEEN (1) when the n-gram ending at the target
    (the n-1 tokens up to the position, then the target) is in `seen`, UNSEEN (0) when not, NO_NGRAM
    (-1) where the block starts too close to hold n tokens."""
    _check_n(n)
    if blocks.dim() != 2:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)}: give [blocks, tokens]")
    b, t = blocks.shape
    out = torch.full((b, max(0, t - 1)), NO_NGRAM, dtype=torch.int8)
    rows = blocks.tolist()
    for i, row in enumerate(rows):
        for j in range(max(0, n - 2), t - 1):  # target j + 1, n-gram row[j + 2 - n : j + 2]
            out[i, j] = SEEN if tuple(row[j + 2 - n : j + 2]) in seen else UNSEEN
    return out


def split_accuracy(pred: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Next-token accuracy of `pred` ([B, T-1], the predicted `blocks[:, 1:]`): over every target, and
    split by `mask` (seen_mask's): `memory` (the n-gram occurred in training) and `generalisation`
    (it did not), each with its count (accuracy None when a split is empty)."""
    target = blocks[:, 1:]
    if pred.shape != target.shape or mask.shape != target.shape:
        raise ValueError(
            f"predictions {tuple(pred.shape)}, mask {tuple(mask.shape)} and targets {tuple(target.shape)} "
            "differ: give one prediction and one mask value per target"
        )
    right = pred == target

    def acc(sel: torch.Tensor) -> tuple[float | None, int]:
        k = int(sel.sum())
        return (float(right[sel].float().mean()) if k else None), k

    a_all, n_all = acc(torch.ones_like(right))
    a_mem, n_mem = acc(mask == SEEN)
    a_gen, n_gen = acc(mask == UNSEEN)
    return {
        "accuracy": a_all,
        "tokens": n_all,
        "memory": a_mem,
        "memory_tokens": n_mem,
        "generalisation": a_gen,
        "generalisation_tokens": n_gen,
    }


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def greedy_predictions(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """[B, T-1]: the model's argmax next token at every position but the last of each block."""
    return greedy_predictions_and_loss(model, blocks, batch_size)[0]


@torch.no_grad()
def greedy_predictions_and_loss(
    model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8
) -> tuple[torch.Tensor, dict[str, float]]:
    """`greedy_predictions` and, from the same forward passes, the mean next-token cross-entropy of
    `blocks[:, 1:]` (nats/token), its perplexity and the tokens counted."""
    was = model.training
    model.eval()
    out, total, count = [], 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        ids = blocks[i : i + batch_size].to(_device(model))
        logits = model(input_ids=ids).logits[:, :-1]
        out.append(logits.argmax(-1).cpu())
        total += float(
            torch.nn.functional.cross_entropy(
                logits.double().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
            )
        )
        count += ids[:, 1:].numel()
    model.train(was)
    pred = torch.cat(out) if out else torch.zeros((0, max(0, blocks.shape[1] - 1)), dtype=torch.int64)
    loss = total / count if count else math.nan
    return pred, {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}


def cloze_phrases(
    train: Sequence[int],
    held: Sequence[int],
    n: int,
    *,
    min_count: int = 5,
    max_phrases: int = 50,
    exclude: Iterable[int] = (),
) -> list[tuple[int, ...]]:
    """Fixed phrases: the n-grams occurring at least `min_count` times in the training stream and at
    least once in the held-out one, none holding an id of `exclude` (EOS, say), the `max_phrases` most
    frequent in training (ties by id order: deterministic)."""
    _check_n(n)
    if n < 2:
        raise ValueError(f"cloze phrases of {n} token: give n >= 2 (a context and a token to complete)")
    bad = set(exclude)
    counts = Counter(g for g in _ngrams(train, n) if not bad.intersection(g))
    in_held = set(_ngrams(held, n))
    found = [(c, g) for g, c in counts.items() if c >= min_count and g in in_held]
    found.sort(key=lambda cg: (-cg[0], cg[1]))
    return [g for _, g in found[:max_phrases]]


@dataclass(frozen=True)
class ClozeItems:
    """Cloze questions: `prompts` [N, context + n - blank] (the context, then the phrase less its last
    `blank` ids), `answers` [N, blank], `phrase` [N] (the phrase's index)."""

    prompts: torch.Tensor
    answers: torch.Tensor
    phrase: torch.Tensor

    def __len__(self) -> int:
        return self.prompts.shape[0]


def cloze_items(
    held: Sequence[int],
    phrases: Sequence[tuple[int, ...]],
    *,
    context: int = 16,
    blank: int = 1,
    max_per_phrase: int = 5,
) -> ClozeItems:
    """Every held-out occurrence of a phrase with `context` tokens before it (the first
    `max_per_phrase` of each phrase, in stream order), the phrase's last `blank` ids to complete."""
    if not phrases:
        raise ValueError("no cloze phrases: give a larger corpus or a smaller min_count")
    n = len(phrases[0])
    if any(len(p) != n for p in phrases):
        raise ValueError("cloze phrases of different lengths: give phrases of one length")
    if not 1 <= blank < n:
        raise ValueError(f"blank {blank}: give 1 to {n - 1} (the phrase's last tokens; one stays as a cue)")
    index = {p: i for i, p in enumerate(phrases)}
    taken: Counter[int] = Counter()
    prompts, answers, which = [], [], []
    ids = list(held)
    for s in range(context, len(ids) - n + 1):
        k = index.get(tuple(ids[s : s + n]))
        if k is None or taken[k] >= max_per_phrase:
            continue
        taken[k] += 1
        prompts.append(ids[s - context : s + n - blank])
        answers.append(ids[s + n - blank : s + n])
        which.append(k)
    width = context + n - blank
    return ClozeItems(
        torch.tensor(prompts, dtype=torch.int64).view(-1, width),
        torch.tensor(answers, dtype=torch.int64).view(-1, blank),
        torch.tensor(which, dtype=torch.int64),
    )


@torch.no_grad()
def cloze_accuracy(model: torch.nn.Module, items: ClozeItems, batch_size: int = 16) -> dict[str, Any]:
    """Greedy completion of every item (one token at a time, each fed back): `accuracy` the share of
    items completed exactly, `token_accuracy` of the blanked tokens, `phrases` how many phrases asked."""
    was = model.training
    model.eval()
    blank = items.answers.shape[1]
    got = []
    for i in range(0, len(items), batch_size):
        ids = items.prompts[i : i + batch_size].to(_device(model))
        for _ in range(blank):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        got.append(ids[:, -blank:].cpu())
    model.train(was)
    if not got:
        return {"accuracy": None, "token_accuracy": None, "items": 0, "phrases": 0}
    right = torch.cat(got) == items.answers
    return {
        "accuracy": float(right.all(dim=1).float().mean()),
        "token_accuracy": float(right.float().mean()),
        "items": len(items),
        "phrases": int(items.phrase.unique().numel()),
    }
