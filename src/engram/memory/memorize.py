"""Writing facts into Engram rows: `memorize(model, tokenizer, facts)` -> a `MemoryPatch`.

Each fact's rows are chosen (`engram.memory.choose`); only those rows are optimised, through an
overlay that adds a trainable change to them in each layer's gather (the table itself, the backbone,
`wkv`, the gate and every other row stay frozen and unchanged): Adam on the changes, cross-entropy on
the target tokens only, `steps` full passes over the facts in batches. The patch holds the new rows
(the original plus the change, in the table's row format) and what it fits; the model is left as it
was. A model whose Engram adds nothing yet (a fresh `add_engram`, value projection zero) cannot be
taught through its rows: refused.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.device import Precision, autocast, check_precision
from engram.memory.apply import EngramLayers, layer_rows, reader_signature, table_row_format
from engram.memory.choose import FactTokens, RowChoice, fact_rows, merge_rows, rows_read, shared_rows
from engram.memory.facts import Fact, check_facts
from engram.memory.patch import LayerRows, MemoryPatch, rows_as_float, rows_in_format
from engram.model.lm import EngramLM
from engram.model.table import EngramTable

__all__ = [
    "MemorizeResult",
    "MemorizeSettings",
    "NoRowsWarning",
    "batch_of",
    "encode_facts",
    "memorize",
    "target_loss",
]


@dataclasses.dataclass(frozen=True)
class MemorizeSettings:
    """How facts are written: `choice` of rows, at most `rows_per_fact` a layer (None: all chosen),
    `steps` passes over the facts in batches of `batch_size`, Adam at `lr` on the rows' changes."""

    choice: RowChoice = RowChoice.BOTH
    rows_per_fact: int | None = 16
    steps: int = 30
    lr: float = 1.0  # large: a trained reader maps rows to values through small weights (docs/memory.md)
    batch_size: int = 32
    seed: int = 0
    precision: Precision = Precision.FLOAT32  # bf16: forwards under autocast (rows and changes stay float32)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choice", RowChoice(self.choice))
        object.__setattr__(self, "precision", Precision(self.precision))
        for name in ("steps", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rows_per_fact is not None and self.rows_per_fact < 1:
            raise ValueError(
                f"rows_per_fact must be >= 1 (or None: every chosen row), got {self.rows_per_fact}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class MemorizeResult:
    patch: MemoryPatch
    losses: list[float]  # the mean target loss of each pass
    seconds: float
    rows_per_fact: list[int]  # rows each fact was given (all layers), in the facts' order
    facts_without_rows: list[Fact]  # facts every row of which another fact or the reference reads


class NoRowsWarning(UserWarning):
    """Some facts have no row of their own (every row they could use is another fact's or the
    reference's): the patch cannot carry them."""


class _RowOverlay(EngramTable):
    """A table's gather plus a trainable change [R, dim] on rows `rows` (sorted): what memorize trains."""

    def __init__(self, base: EngramTable, rows: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["base"] = base  # not a submodule: the model's parameters stay the same set
        self.num_rows, self.dim = base.num_rows, base.dim
        self.rows = rows
        self.delta = nn.Parameter(torch.zeros(rows.numel(), base.dim, device=rows.device))

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.base.gather(rows, torch.float32)  # (..., dim)
        idx = torch.searchsorted(self.rows, rows.contiguous()).clamp(max=self.rows.numel() - 1)
        hit = (self.rows[idx] == rows).unsqueeze(-1)
        out = out + self.delta[idx] * hit  # only the chosen rows change
        return out if dtype is None else out.to(dtype)


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


def _check_reads(layers: EngramLayers) -> None:
    for lid, m in layers.modules.items():
        wkv = getattr(m, "wkv", None)
        w = wkv.weight[m.config.hc_mult * m.config.hidden_size :] if wkv is not None else m.value_proj.weight
        if not bool(w.detach().ne(0).any()):
            raise ValueError(
                f"layer {lid}'s Engram adds nothing yet (its value projection is zero: a fresh add_engram), "
                "so no row can carry a fact; train Engram on the model first (engram hf-train), then memorize"
            )


def memorize(
    model: nn.Module,
    tokenizer: Any,
    facts: Sequence[Fact],
    settings: MemorizeSettings | None = None,
    *,
    reference: Sequence[Sequence[int]] | None = None,
    name: str = "",
    progress: Callable[[int, float], None] | None = None,
    hasher: NgramHasher | None = None,
) -> MemorizeResult:
    """Write `facts` into the rows of `model`'s Engram tables (module docstring); returns the patch.
        `reference`: token sequences (e.g. held-out text) whose rows are left out of every fact's
        choice, so that text reads none of the patch. `progress(pass, loss)` after each pass. `hasher`: the
    demo's `EngramLM` hashes its rows outside the model (`load_generator` returns its hasher)."""
    s = settings or MemorizeSettings()
    facts = check_facts(facts)
    layers = EngramLayers.of(model, hasher)
    _check_reads(layers)
    formats = {lid: table_row_format(m.table, f"layer {lid}") for lid, m in layers.modules.items()}
    cfg = getattr(model, "config", None)
    max_len = (
        cfg.max_seq_len if isinstance(model, EngramLM) else getattr(cfg, "max_position_embeddings", None)
    )
    encoded = encode_facts(tokenizer, facts, max_len)
    # rows other text reads (the reference), or facts with other answers choose too, are nobody's
    everything = [fact_rows(layers.hasher, f, s.choice) for f in encoded]
    common = shared_rows(everything, [f.target for f in facts])
    if reference:
        common = merge_rows(common, rows_read(layers.hasher, list(reference)))
    per_fact = [
        fact_rows(layers.hasher, f, s.choice, common=common, max_rows=s.rows_per_fact) for f in encoded
    ]
    chosen = {
        lid: torch.from_numpy(np.unique(np.concatenate([pf[lid] for pf in per_fact])))
        for lid in layers.modules
    }
    chosen = {lid: r for lid, r in chosen.items() if r.numel()}
    counts = [sum(int(v.size) for v in pf.values()) for pf in per_fact]
    without = [f for f, n in zip(facts, counts, strict=True) if n == 0]
    if without and chosen:
        shown = "; ".join(f"{f.where or repr(f.prompt)}" for f in without[:3])
        warnings.warn(
            f"{len(without)} of {len(facts)} facts have no row of their own ({shown}{'; ...' if len(without) > 3 else ''}): "
            "every row they could use is read by a fact with another answer or by the reference text, so the "
            "patch cannot carry them; give them a subject, or write them in a patch of their own",
            NoRowsWarning,
            stacklevel=2,
        )
    if not chosen:
        raise ValueError(
            "no row is left to carry the facts: every chosen row is read by the reference text; give less "
            "reference text, or another row choice"
        )
    pad = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    device = next(model.parameters()).device
    check_precision(s.precision, device, "precision")
    start = time.perf_counter()
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    overlays: dict[int, _RowOverlay] = {}
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for lid, rows in chosen.items():
            m = layers.modules[lid]
            overlays[lid] = _RowOverlay(m.table, rows.to(device))
            m.table = overlays[lid]
        model.eval()  # no dropout: the rows are fitted to the model as it runs
        params = [o.delta for o in overlays.values()]
        opt = torch.optim.Adam(params, lr=s.lr)
        g = torch.Generator().manual_seed(s.seed)
        losses = []
        for step in range(s.steps):
            order = torch.randperm(len(encoded), generator=g).tolist()
            total, count = 0.0, 0
            for b in range(0, len(order), s.batch_size):
                part = [encoded[i] for i in order[b : b + s.batch_size]]
                ids, mask, labels = (t.to(device) for t in batch_of(part, pad))
                with autocast(device, s.precision):
                    loss = target_loss(model, layers, ids, mask, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(part)
                count += len(part)
            losses.append(total / count)
            if progress is not None:
                progress(step + 1, losses[-1])
        patch_layers = {}
        for lid, o in overlays.items():
            m_table = o.base
            before = layer_rows(m_table, o.rows, formats[lid])
            base_f = rows_as_float(before.values, before.scales, formats[lid])
            new_v, new_s = rows_in_format(base_f + o.delta.detach().cpu(), formats[lid])
            patch_layers[lid] = LayerRows(o.rows.cpu().clone(), new_v, new_s, before.before)
    finally:
        for lid, o in overlays.items():
            layers.modules[lid].table = o.base
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    some = layers.modules[next(iter(chosen))]
    patch = MemoryPatch(
        patch_layers,
        formats[next(iter(chosen))],
        some.table.dim,
        {lid: layers.modules[lid].table.num_rows for lid in patch_layers},
        layers.layout,
        layers.tokenizer,
        {lid: reader_signature(layers.modules[lid]) for lid in patch_layers},
        len(facts),
        name,
    )
    return MemorizeResult(patch, losses, time.perf_counter() - start, counts, without)
