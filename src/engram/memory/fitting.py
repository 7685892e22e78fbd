"""What `memorize` and `train_reader` share: the rows each fact may change (`choose_rows`), an overlay
that adds a trainable change to those rows in each layer's gather (`RowOverlay`, `overlaid`), and the
passes over the facts that train it (`run_passes`: Adam, batches of facts in a seeded order, the
target tokens' cross-entropy). The tables themselves are never written here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from engram.device import Precision, autocast
from engram.memory.apply import EngramLayers
from engram.memory.batches import batch_of, target_loss
from engram.memory.choose import (
    FactTokens,
    RowChoice,
    fact_rows,
    hash_fact,
    merge_rows,
    rows_read,
    shared_rows,
)
from engram.model.lm import EngramLM
from engram.model.table import EngramTable

__all__ = [
    "ChosenRows",
    "RowOverlay",
    "choose_rows",
    "frozen",
    "model_device",
    "model_max_len",
    "model_pad",
    "overlaid",
    "run_passes",
]


class RowOverlay(EngramTable):
    """A table's gather plus a trainable change [R, dim] on rows `rows` (sorted)."""

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


class ChosenRows:
    """The rows of every layer that the facts may change (`rows`: {layer id: sorted int64 tensor}, layers
    with none left out) and how many each fact was given, all layers together (`counts`)."""

    def __init__(self, rows: dict[int, torch.Tensor], counts: list[int]) -> None:
        self.rows, self.counts = rows, counts


def choose_rows(
    layers: EngramLayers,
    encoded: Sequence[FactTokens],
    targets: Sequence[str],
    choice: RowChoice,
    rows_per_fact: int | None,
    reference: Sequence[Sequence[int]] | None = None,
) -> ChosenRows:
    """Each fact's rows (`engram.memory.choose`), leaving out those facts with other `targets` share and
    those the `reference` token sequences read, at most `rows_per_fact` a layer."""
    hashed = [hash_fact(layers.hasher, f) for f in encoded]
    everything = [fact_rows(layers.hasher, f, choice, hashed=h) for f, h in zip(encoded, hashed, strict=True)]
    common = shared_rows(everything, list(targets))
    if reference:
        common = merge_rows(common, rows_read(layers.hasher, list(reference)))
    per_fact = [
        fact_rows(layers.hasher, f, choice, common=common, max_rows=rows_per_fact, hashed=h)
        for f, h in zip(encoded, hashed, strict=True)
    ]
    rows = {
        lid: torch.from_numpy(np.unique(np.concatenate([pf[lid] for pf in per_fact])))
        for lid in layers.modules
    }
    counts = [sum(int(v.size) for v in pf.values()) for pf in per_fact]
    return ChosenRows({lid: r for lid, r in rows.items() if r.numel()}, counts)


@contextlib.contextmanager
def overlaid(
    layers: EngramLayers, rows: dict[int, torch.Tensor], device: torch.device
) -> Iterator[dict[int, RowOverlay]]:
    """Each layer of `rows` reads through a `RowOverlay` of its table for the block; the tables are put
    back however it ends."""
    overlays: dict[int, RowOverlay] = {}
    try:
        for lid, r in rows.items():
            m = layers.modules[lid]
            overlays[lid] = RowOverlay(m.table, r.to(device))
            m.table = overlays[lid]
        yield overlays
    finally:
        for lid, o in overlays.items():
            layers.modules[lid].table = o.base


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Every parameter of `model` without gradients and the model in eval mode (no dropout: rows are
    fitted to the model as it runs) for the block; both as they were after it."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def run_passes(
    model: nn.Module,
    layers: EngramLayers,
    encoded: Sequence[FactTokens],
    opt: torch.optim.Optimizer,
    *,
    passes: int,
    batch_size: int,
    seed: int,
    pad: int,
    device: torch.device,
    precision: Precision,
    progress: Callable[[int, float], None] | None = None,
    extra_loss: Callable[[torch.Generator], torch.Tensor] | None = None,
) -> list[float]:
    """`passes` passes over the facts in batches of `batch_size` (a seeded order each pass), one `opt`
    step a batch on the target tokens' mean cross-entropy (plus `extra_loss(generator)`, e.g. a text's
    LM loss); returns the mean target loss of each pass. `progress(pass, loss)` after each."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(passes):
        order = torch.randperm(len(encoded), generator=g).tolist()
        total, count = 0.0, 0
        for b in range(0, len(order), batch_size):
            part = [encoded[i] for i in order[b : b + batch_size]]
            ids, mask, labels = (t.to(device) for t in batch_of(part, pad))
            with autocast(device, precision):
                loss = target_loss(model, layers, ids, mask, labels)
                total_loss = loss if extra_loss is None else loss + extra_loss(g)
            opt.zero_grad(set_to_none=True)
            total_loss.backward()
            opt.step()
            total += float(loss.detach()) * len(part)
            count += len(part)
        losses.append(total / count)
        if progress is not None:
            progress(step + 1, losses[-1])
    return losses


def model_pad(model: nn.Module) -> int:
    """The pad id batches of facts use: the model's `pad_token_id`, else 0 (a left pad is masked)."""
    return getattr(getattr(model, "config", None), "pad_token_id", None) or 0


def model_max_len(model: nn.Module) -> int | None:
    """The longest sequence the model takes: an `EngramLM`'s `max_seq_len`, an HF model's
    `max_position_embeddings` (None where its config has none)."""
    cfg = getattr(model, "config", None)
    return cfg.max_seq_len if isinstance(model, EngramLM) else getattr(cfg, "max_position_embeddings", None)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
