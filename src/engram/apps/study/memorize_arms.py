"""The facts and arms of `engram study memorize` (engram.apps.study.memorize): the fact records and
each seed's subset of them, the in-prompt arm's context, LoRA's and the last layer's training (Adam
on their parameters exactly as `memorize` trains rows: the same passes, batches, order and target-only
loss), and every question of a record asked of a model (`answers`, scored by `metrics`).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engram.apps.study.memorize_models import Subject, encode_text
from engram.apps.study.memorize_probes import greedy, padded, score
from engram.memory import Fact
from engram.memory.memorize import target_loss

__all__ = [
    "LORA_RANKS",
    "PATCH_ARMS",
    "READER_ARMS",
    "answers",
    "fact_subset",
    "fit",
    "in_prompt",
    "metrics",
    "nbytes",
    "question",
    "read_records",
    "to_learn",
    "trainable",
]

LORA_RANKS = {"lora-r1": 1, "lora-r8": 8}
PATCH_ARMS = ("patch", "reader-patch", "reader-patch-ref")  # the arms that write a memory patch
READER_ARMS = ("reader-patch", "reader-patch-ref")  # those written through the trained readers

# ------------------------------------------------------------------------------------------- facts
_NEEDS = {
    "prompt": str,
    "target": str,
    "subject": str,
    "paraphrases": list,
    "indirect": dict,
    "neighbours": list,
}


def _text(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _questions(qs: list[Any]) -> bool:
    return bool(qs) and all(
        isinstance(q, dict) and _text(q.get("prompt")) and _text(q.get("target")) for q in qs
    )


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The study's fact records (one JSON object a line, as `facts_gen` writes them)."""
    p = Path(path)
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not a JSON object ({e}); write one record a line") from None
        bad = [k for k, t in _NEEDS.items() if not isinstance(r.get(k) if isinstance(r, dict) else None, t)]
        if not bad:  # each question {"prompt", "target"}; neighbours: prompts
            bad = [
                k
                for k, qs in (("paraphrases", r["paraphrases"]), ("indirect", [r["indirect"]]))
                if not _questions(qs)
            ]
            bad += [] if r["neighbours"] and all(_text(q) for q in r["neighbours"]) else ["neighbours"]
        if bad:
            raise ValueError(
                f"{p}:{n}: no {bad[0]!r} of the right kind; each record needs {', '.join(_NEEDS)} "
                "(python -m engram.apps.study.facts_gen writes the shipped file)"
            )
        r.setdefault("id", f"line{n}")
        out.append(r)
    if not out:
        raise ValueError(f"{p}: no fact records")
    return out


def fact_subset(total: int, n: int, seed: int) -> list[int]:
    """Seed `seed`'s `n` facts: the first n of a permutation of range(total) drawn with that seed (so the
    10 facts of a seed are among its 100)."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def question(r: dict[str, Any], q: dict[str, Any] | None = None, prefix: str = "") -> Fact:
    """Question `q` of record `r` (default: its direct one) after `prefix`."""
    q = q or r
    return Fact(prefix + q["prompt"], q["target"])


def to_learn(r: dict[str, Any]) -> Fact:
    """The fact every trained arm learns: the direct prompt and target, with its subject (the patch's
    row choice reads it: the subject's n-grams carry the fact)."""
    return Fact(r["prompt"], r["target"], r["subject"])


def in_prompt(r: dict[str, Any]) -> str:
    """The in-prompt arm's context: the fact as a sentence, then a space."""
    return f"{r['prompt']}{r['target']}. "


def fit(
    s: Subject,
    model: nn.Module,
    params: list[nn.Parameter],
    facts: list[Fact],
    lr: float,
    steps: int,
    batch_size: int,
    seed: int,
    tick: Callable[[int, float], None] | None = None,
) -> tuple[list[float], float]:
    """Adam on `params` as memorize trains rows: the same passes, batches and order; (losses, seconds).
    `tick(pass, loss)` after each pass."""
    start = time.perf_counter()
    encoded = s.questions(facts)
    layers = s.layers(model)
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.eval()  # no dropout, as memorize
    losses = []
    for _ in range(steps):
        order = torch.randperm(len(encoded), generator=g).tolist()
        total = 0.0
        for b in range(0, len(order), batch_size):
            part = [encoded[i] for i in order[b : b + batch_size]]
            ids, mask = padded([f.ids for f in part], s.pad)
            labels = torch.full_like(ids, -100)
            for i, f in enumerate(part):
                labels[i, f.prompt_len : len(f.ids)] = ids[i, f.prompt_len : len(f.ids)]
            loss = target_loss(model, layers, ids, mask, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(part)
        losses.append(total / len(encoded))
        if tick is not None:
            tick(len(losses), losses[-1])
    return losses, time.perf_counter() - start


def trainable(s: Subject, arm: str, seed: int) -> tuple[nn.Module, list[nn.Parameter]]:
    """A copy of the base model with the arm's parameters made trainable (the rest frozen)."""
    model = copy.deepcopy(s.model)
    for p in model.parameters():
        p.requires_grad_(False)
    if arm in LORA_RANKS:
        import peft

        r = LORA_RANKS[arm]
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=s.lora_targets(model))
        with torch.random.fork_rng():  # LoRA's A is drawn from the global generator
            torch.manual_seed(seed)
            peft.inject_adapter_in_model(cfg, model)
        params = [p for n, p in model.named_parameters() if "lora_" in n]
    else:
        params = list(s.decoder_layers(model)[-1].parameters())
    for p in params:
        p.requires_grad_(True)
    return model, params


def answers(
    s: Subject,
    model: nn.Module,
    recs: list[dict[str, Any]],
    prefix: Callable[[dict[str, Any]], str],
    batch_size: int = 32,
    neighbour_tokens: int = 3,
) -> list[dict[str, Any]]:
    """Per record: direct and indirect [exact, logprob], paraphrase [[exact, logprob], ...] and the
    neighbours' greedy tokens [[ids], ...], each question after `prefix(record)`."""
    f = s.logits(model)
    questions = {
        "direct": [[r] for r in recs],
        "paraphrase": [r["paraphrases"] for r in recs],
        "indirect": [[r["indirect"]] for r in recs],
    }
    out: list[dict[str, Any]] = [{} for _ in recs]
    for kind, qs in questions.items():
        facts = [question(r, q, prefix(r)) for r, rq in zip(recs, qs, strict=True) for q in rq]
        ok, lp = score(f, s.questions(facts), s.pad, batch_size)
        at = 0
        for o, rq in zip(out, qs, strict=True):
            got = [[bool(ok[at + j]), float(lp[at + j])] for j in range(len(rq))]
            o[kind] = got if kind == "paraphrase" else got[0]
            at += len(rq)
    prompts = [encode_text(s.tokenizer, prefix(r) + q, True) for r in recs for q in r["neighbours"]]
    tokens = greedy(f, prompts, neighbour_tokens, s.pad, batch_size)
    at = 0
    for o, r in zip(out, recs, strict=True):
        o["neighbours"] = tokens[at : at + len(r["neighbours"])]
        at += len(r["neighbours"])
    return out


def metrics(ans: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
    """Mean recall and log-prob of each kind of question, and the share of neighbour prompts whose
    greedy tokens differ from the untrained model's (`base`: its answers to the same records)."""
    m = {}
    for kind in ("direct", "paraphrase", "indirect"):
        qs = [q for a in ans for q in (a[kind] if kind == "paraphrase" else [a[kind]])]
        m[f"{kind}_recall"] = float(np.mean([q[0] for q in qs]))
        m[f"{kind}_logprob"] = float(np.mean([q[1] for q in qs]))
    changed = [
        x != y
        for a, b in zip(ans, base, strict=True)
        for x, y in zip(a["neighbours"], b["neighbours"], strict=True)
    ]
    m["neighbour_change"] = float(np.mean(changed))
    return m


def nbytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
