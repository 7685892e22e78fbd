"""Facts as tokens and batches: `encode_facts` (prompt as generation encodes it, then the target),
`batch_of` (left-padded, labels on the target tokens only) and `target_loss` (their mean cross-entropy,
logits for the last positions only), for an HF model or the demo's `EngramLM`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram.memory.apply import EngramLayers
from engram.memory.choose import FactTokens
from engram.memory.facts import Fact
from engram.model.lm import EngramLM

__all__ = ["batch_of", "encode_facts", "target_loss"]


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    if hasattr(tokenizer, "encode") and not hasattr(tokenizer, "encode_batch"):  # transformers'
        return list(tokenizer.encode(text, add_special_tokens=special))
    return list(tokenizer.encode(text, add_special_tokens=special).ids)  # tokenizers'


def _subject_span(tokenizer: Any, prompt: str, subject: str, n_prompt: int) -> tuple[int, int]:
    """The prompt's token positions [start, stop) that hold the subject, from the token counts of the
    text before it and up to its end. One token before it is included: a byte-level BPE writes the
    space before a word into the word's token, so the text before " Talven" ends with a space token
    that the whole prompt does not have."""
    at = prompt.index(subject)
    first = len(_encode(tokenizer, "", True))  # a BOS the tokenizer adds
    start = max(len(_encode(tokenizer, prompt[:at], True)) - 1, first) if at else first
    stop = len(_encode(tokenizer, prompt[: at + len(subject)], True))
    return (min(start, n_prompt - 1), min(max(stop, start + 1), n_prompt))


def encode_facts(tokenizer: Any, facts: Sequence[Fact], max_len: int | None = None) -> list[FactTokens]:
    """Each fact as `FactTokens`: the prompt encoded as generation encodes it (with the tokenizer's
    special tokens), the target after it without; ValueError naming a fact longer than `max_len`."""
    out = []
    for f in facts:
        p = _encode(tokenizer, f.prompt, True)
        t = _encode(tokenizer, f.target, False)
        if not t:
            raise ValueError(
                f"{f.where or 'a fact'}: its target {f.target!r} is no tokens; give it some text"
            )
        if max_len is not None and len(p) + len(t) > max_len:
            raise ValueError(
                f"{f.where or 'a fact'}: prompt and target are {len(p) + len(t)} tokens, more than the model's "
                f"context of {max_len}; shorten the prompt"
            )
        span = None if f.subject is None else _subject_span(tokenizer, f.prompt, f.subject, len(p))
        out.append(FactTokens(p + t, len(p), span))
    return out


def batch_of(facts: list[FactTokens], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and labels (-100 but on target tokens), left-padded: every target
    ends at the last column, so only the last few positions need logits (`target_loss`)."""
    n = max(len(f.ids) for f in facts)
    ids = torch.full((len(facts), n), pad, dtype=torch.long)
    mask = torch.zeros((len(facts), n), dtype=torch.long)
    labels = torch.full((len(facts), n), -100, dtype=torch.long)
    for i, f in enumerate(facts):
        ids[i, n - len(f.ids) :] = torch.tensor(f.ids)
        mask[i, n - len(f.ids) :] = 1
        labels[i, n - len(f.ids) + f.prompt_len :] = torch.tensor(f.ids[f.prompt_len :])
    return ids, mask, labels


def target_loss(
    model: nn.Module, layers: EngramLayers, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of the labelled tokens of a left-padded batch (`batch_of`). An HF model
    computes logits for the last positions only (the LM head is a fifth of SmolLM2's work a token), at
    positions counted from each row's first real token; the demo's `EngramLM` takes rows hashed here
    (padding dead: it enters no n-gram window). Both use rotary positions, which only differences of
    positions reach, so the padding in front changes nothing."""
    labelled = (labels != -100).any(0).nonzero()
    keep = ids.shape[1] - int(labelled[0]) + 1 if labelled.numel() else 1  # the first target's predictor on
    if isinstance(model, EngramLM):
        dead = mask == 0
        rows = torch.as_tensor(np.asarray(layers.hasher.hash(ids.cpu().numpy(), dead.cpu().numpy())))
        rows = rows.to(ids.device)
        logits = model(ids, rows, dead_mask=dead)[:, -keep:]
    else:
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
    targets = labels[
        :, ids.shape[1] - keep + 1 :
    ]  # (B, keep - 1): what each kept position but the last predicts
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
