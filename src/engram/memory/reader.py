"""Teaching a model to read memory patches: `train_reader(model, tokenizer, facts)`.

A patch changes rows only; what a changed row does is decided by the Engram layer's other weights
(V4.1: `wkv` and the gate's; the demo: its projections, norms and conv), its *reader*. A reader that
`hf-train` trained briefly from zero keeps a value projection of small, low-rank weights, so rows
must move far and in few directions: 16 rows a layer held 0 of 20 facts on SmolLM2 (docs/memory.md).
As "User as Engram" pairs its row edits with one shared adapter trained once, here the readers are
trained once, jointly with throw-away row changes for a set of *training* facts (the same rows, passes
and loss `memorize` uses), optionally with the LM loss on a text so that the model's other behaviour
stays. The training facts' row changes are then dropped: the tables are left bit for bit as they were,
the readers keep their new weights. Facts written afterwards by `memorize` (other facts) use the
trained readers; a patch records the reader it was written for, so it fits only a model with it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.device import Precision, autocast, check_precision
from engram.memory.apply import EngramLayers
from engram.memory.batches import encode_facts
from engram.memory.choose import RowChoice
from engram.memory.facts import Fact, check_facts
from engram.memory.fitting import (
    choose_rows,
    frozen,
    model_device,
    model_max_len,
    model_pad,
    overlaid,
    run_passes,
)
from engram.model.lm import EngramLM

__all__ = ["ReaderResult", "ReaderSettings", "reader_parameters", "train_reader"]


@dataclasses.dataclass(frozen=True)
class ReaderSettings:
    """How `train_reader` trains the readers.

    `passes` over the training facts in batches of `batch_size`, Adam at `lr` on the readers and at
    `row_lr` on the facts' rows (`choice`, at most `rows_per_fact` a layer: as `memorize` writes
    them), plus `text_weight` times the LM loss of `text_batch` blocks of the text (when one is
    given) each step.

    Args:
        passes: Passes over the training facts.
        lr: Adam's learning rate on the readers' weights.
        row_lr: Adam's learning rate on the training facts' row changes (dropped afterwards).
        choice: Which rows carry a fact (`RowChoice`, or its value).
        rows_per_fact: At most this many rows a fact in each layer; None: every chosen row.
        batch_size: Facts a batch (one Adam step each).
        text_weight: The weight of the text's LM loss in each step's loss; 0: the text is not used.
        text_batch: Blocks of the text drawn at random each step.
        seed: Seeds the order of the facts in each pass and the text blocks drawn.
        precision: The forwards' arithmetic (`Precision`, or its value).

    Raises:
        ValueError: `passes`, `batch_size`, `text_batch` or `rows_per_fact` is < 1, `lr` or
            `row_lr` is not a finite number > 0, `text_weight` is not a finite number >= 0, or
            `choice` or `precision` is not one of its values.
    """

    passes: int = 10
    lr: float = 1e-3
    row_lr: float = 1.0
    choice: RowChoice = RowChoice.BOTH
    rows_per_fact: int | None = 16
    batch_size: int = 32
    text_weight: float = 1.0
    text_batch: int = 4
    seed: int = 0
    precision: Precision = Precision.FLOAT32

    def __post_init__(self) -> None:
        object.__setattr__(self, "choice", RowChoice(self.choice))
        object.__setattr__(self, "precision", Precision(self.precision))
        for name in ("passes", "batch_size", "text_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rows_per_fact is not None and self.rows_per_fact < 1:
            raise ValueError(
                f"rows_per_fact must be >= 1 (or None: every chosen row), got {self.rows_per_fact}"
            )
        for name in ("lr", "row_lr"):
            v = getattr(self, name)
            if not (v > 0 and np.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        if not (self.text_weight >= 0 and np.isfinite(self.text_weight)):
            raise ValueError(f"text_weight must be a finite number >= 0, got {self.text_weight}")


@dataclasses.dataclass(frozen=True)
class ReaderResult:
    """What `train_reader` returns: how the training went and how far the readers moved.

    Args:
        losses: The training facts' mean target loss in each pass.
        text_losses: The text's mean LM loss in each pass (empty without a text, or with
            `text_weight` 0).
        seconds: The time the training took (after the rows were chosen).
        facts: The training facts (each prompt once).
        changed: Per layer id, the readers' weights' relative change: L2 of the change over L2 of
            the weights before (inf for weights that were all zero).
    """

    losses: list[float]
    text_losses: list[float]
    seconds: float
    facts: int
    changed: dict[int, float]


def reader_parameters(layers: EngramLayers) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """Each Engram layer's reader: its named parameters but the table's."""
    return {
        lid: [(n, p) for n, p in m.named_parameters() if not n.startswith("table.")]
        for lid, m in layers.modules.items()
    }


def _text_loss(model: nn.Module, layers: EngramLayers, blocks: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of token blocks (B, L) read from their start."""
    if isinstance(model, EngramLM):
        rows = torch.as_tensor(np.asarray(layers.hasher.hash(blocks.cpu().numpy()))).to(blocks.device)
        logits = model(blocks, rows)
    else:
        logits = model(input_ids=blocks).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), blocks[:, 1:].flatten())


def train_reader(
    model: nn.Module,
    tokenizer: Any,
    facts: Sequence[Fact],
    settings: ReaderSettings | None = None,
    *,
    text: torch.Tensor | None = None,
    progress: Callable[[int, float], None] | None = None,
    hasher: NgramHasher | None = None,
) -> ReaderResult:
    """Train the readers of a model's Engram layers in place (module docstring).

    The tables and every other weight are left bit for bit as they were; the training facts' row
    changes are dropped. Patches written afterwards by `memorize` fit the model with the new readers
    only.

    Args:
        model: An HF model with Engram, or the demo's `EngramLM`.
        tokenizer: The model's tokenizer (a transformers tokenizer or a `tokenizers.Tokenizer`).
        facts: The training facts (not the ones to memorise later); a prompt given twice with the
            same target counts once.
        settings: How the readers are trained; default `ReaderSettings()`.
        text: int64 token blocks (N, L), e.g. the corpus the model was trained on, whose LM loss
            keeps the model's other behaviour; None: the facts' loss alone.
        progress: Called as `progress(pass, loss)` after each pass (counted from 1) with the pass's
            mean target loss.
        hasher: The hasher of an `EngramLM`'s rows: the demo hashes its rows outside the model.

    Returns:
        The losses of each pass, the time taken, and how far each layer's readers moved.

    Raises:
        ValueError: `text` is not int64 blocks (N >= 1, L >= 2) or its blocks are longer than the
            model's context, the model has no Engram layers (or is an `EngramLM` and no `hasher` is
            given), the facts are refused (none, a prompt with two targets, a target of no tokens,
            longer than the model's context), no row is left to carry them, or `settings.precision`
            is bf16 where the device has no bfloat16 arithmetic.
    """
    s = settings or ReaderSettings()
    facts = check_facts(facts)
    layers = EngramLayers.of(model, hasher)
    max_len = model_max_len(model)
    if text is not None:
        if text.dim() != 2 or text.shape[0] < 1 or text.shape[1] < 2 or text.dtype != torch.long:
            raise ValueError(
                f"text must be int64 token blocks (N >= 1, L >= 2), got {tuple(text.shape)} {text.dtype}"
            )
        if max_len is not None and text.shape[1] > max_len:
            raise ValueError(f"text blocks of {text.shape[1]} tokens are longer than the model's {max_len}")
    encoded = encode_facts(tokenizer, facts, max_len)
    picked = choose_rows(layers, encoded, [f.target for f in facts], s.choice, s.rows_per_fact)
    if not picked.rows:
        raise ValueError("no row is left to carry the training facts: give facts with subjects of their own")
    device = model_device(model)
    check_precision(s.precision, device, "precision")
    readers = reader_parameters(layers)
    before = {lid: [p.detach().clone() for _, p in ps] for lid, ps in readers.items()}
    start = time.perf_counter()
    text_losses: list[float] = []
    seen: list[float] = []

    def text_term(g: torch.Generator) -> torch.Tensor:
        assert text is not None
        pick = torch.randint(text.shape[0], (s.text_batch,), generator=g)
        with autocast(device, s.precision):
            loss = _text_loss(model, layers, text[pick].to(device))
        seen.append(float(loss.detach()))
        return s.text_weight * loss

    def tick(step: int, loss: float) -> None:
        if seen:
            text_losses.append(float(np.mean(seen)))
            seen.clear()
        if progress is not None:
            progress(step, loss)

    with frozen(model), overlaid(layers, picked.rows, device) as overlays:
        weights = [p for ps in readers.values() for _, p in ps]
        for p in weights:
            p.requires_grad_(True)
        opt = torch.optim.Adam(
            [
                {"params": [o.delta for o in overlays.values()], "lr": s.row_lr},
                {"params": weights, "lr": s.lr},
            ]
        )
        losses = run_passes(
            model,
            layers,
            encoded,
            opt,
            passes=s.passes,
            batch_size=s.batch_size,
            seed=s.seed,
            pad=model_pad(model),
            device=device,
            precision=s.precision,
            progress=tick,
            extra_loss=text_term if text is not None and s.text_weight > 0 else None,
        )
    changed = {}
    for lid, ps in readers.items():
        num = sum(
            float((p.detach() - b).float().norm() ** 2) for (_, p), b in zip(ps, before[lid], strict=True)
        )
        den = sum(float(b.float().norm() ** 2) for b in before[lid])
        changed[lid] = (num / den) ** 0.5 if den > 0 else float("inf")
    return ReaderResult(losses, text_losses, time.perf_counter() - start, len(facts), changed)
