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
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.device import Precision, check_precision
from engram.memory.apply import EngramLayers, layer_rows, reader_signature, table_row_format
from engram.memory.batches import batch_of, encode_facts, target_loss
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
from engram.memory.patch import LayerRows, MemoryPatch, rows_as_float, rows_in_format

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
    """How `memorize` writes facts: which rows, how many, and how they are trained.

    Args:
        choice: Which rows carry a fact (`RowChoice`, or its value).
        rows_per_fact: At most this many rows a fact in each layer; None: every chosen row.
        steps: Passes over the facts.
        lr: Adam's learning rate on the rows' changes; large, because a trained reader maps rows to
            values through small weights (docs/memory.md).
        batch_size: Facts a batch (one Adam step each).
        seed: Seeds the order of the facts in each pass.
        precision: The forwards' arithmetic (`Precision`, or its value); bf16: forwards under
            autocast, the rows and their changes stay float32.

    Raises:
        ValueError: `steps`, `batch_size` or `rows_per_fact` is < 1, `lr` is not > 0, or `choice`
            or `precision` is not one of its values.
    """

    choice: RowChoice = RowChoice.BOTH
    rows_per_fact: int | None = 32
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
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class MemorizeResult:
    """What `memorize` returns: the patch and how its training went.

    Args:
        patch: The facts' rows, ready for `apply_patch` or `save_patch`.
        losses: The facts' mean target loss in each pass.
        seconds: The time the training took (after the rows were chosen).
        rows_per_fact: The rows each fact was given (all layers), in the facts' order (each prompt
            once).
        facts_without_rows: The facts every row of which another fact or the reference reads: the
            patch does not carry them (`NoRowsWarning`).
    """

    patch: MemoryPatch
    losses: list[float]  # the mean target loss of each pass
    seconds: float
    rows_per_fact: list[int]  # rows each fact was given (all layers), in the facts' order
    facts_without_rows: list[Fact]  # facts every row of which another fact or the reference reads


class NoRowsWarning(UserWarning):
    """Some facts have no row of their own: the patch cannot carry them.

    Every row they could use is read by a fact with another target or by the reference text.
    """


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
    """Write facts into the rows of a model's Engram tables, as a memory patch (module docstring).

    Only the chosen rows are trained; the model is left as it was (apply the patch with
    `apply_patch`).

    Args:
        model: An HF model with a trained Engram (its tables in memory), or the demo's `EngramLM`.
        tokenizer: The model's tokenizer (a transformers tokenizer or a `tokenizers.Tokenizer`).
        facts: The facts (`read_facts`); a prompt given twice with the same target counts once.
        settings: How the facts are written; default `MemorizeSettings()`.
        reference: Token sequences (e.g. held-out text) whose rows are left out of every fact's
            choice, so that text reads none of the patch.
        name: The patch's name, recorded in its file and used in messages (not part of its
            fingerprint).
        progress: Called as `progress(pass, loss)` after each pass (counted from 1) with the pass's
            mean target loss.
        hasher: The hasher of an `EngramLM`'s rows: the demo hashes its rows outside the model
            (`load_generator` returns its hasher).

    Returns:
        The patch, the loss of each pass, the time taken, and the rows each fact was given.

    Raises:
        ValueError: The model has no Engram layers (or is an `EngramLM` and no `hasher` is given)
            or its Engram adds nothing yet (a fresh `add_engram`: train it first), a table cannot
            take a patch (memory-mapped, or wrapped), the facts are refused (none, a prompt with two
            targets, a target of no tokens, longer than the model's context), no row is left to
            carry them, or `settings.precision` is bf16 where the device has no bfloat16 arithmetic.

    Warns:
        NoRowsWarning: Some facts have no row of their own (`MemorizeResult.facts_without_rows`).
    """
    s = settings or MemorizeSettings()
    facts = check_facts(facts)
    layers = EngramLayers.of(model, hasher)
    _check_reads(layers)
    formats = {lid: table_row_format(m.table, f"layer {lid}") for lid, m in layers.modules.items()}
    max_len = model_max_len(model)
    encoded = encode_facts(tokenizer, facts, max_len)
    picked = choose_rows(layers, encoded, [f.target for f in facts], s.choice, s.rows_per_fact, reference)
    chosen, counts = picked.rows, picked.counts
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
        why = (
            "by facts with other answers or by the reference text"
            if reference
            else "by facts with other answers"
        )
        raise ValueError(
            f"no row is left to carry the facts: every row they could use is read {why}; give them subjects "
            "of their own" + (", less reference text" if reference else "") + ", or another row choice"
        )
    device = model_device(model)
    check_precision(s.precision, device, "precision")
    start = time.perf_counter()
    with frozen(model), overlaid(layers, chosen, device) as overlays:
        opt = torch.optim.Adam([o.delta for o in overlays.values()], lr=s.lr)
        losses = run_passes(
            model,
            layers,
            encoded,
            opt,
            passes=s.steps,
            batch_size=s.batch_size,
            seed=s.seed,
            pad=model_pad(model),
            device=device,
            precision=s.precision,
            progress=progress,
        )
        patch_layers = {}
        for lid, o in overlays.items():
            before = layer_rows(o.base, o.rows, formats[lid])
            base_f = rows_as_float(before.values, before.scales, formats[lid])
            new_v, new_s = rows_in_format(base_f + o.delta.detach().cpu(), formats[lid])
            patch_layers[lid] = LayerRows(o.rows.cpu().clone(), new_v, new_s, before.before)
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
