"""The reader of `engram study memorize`'s reader-patch arm: a copy of the model whose Engram readers
`engram.memory.train_reader` trained on `reader_facts` facts that no run of the seed writes (the last
ones of the seed's permutation) and on the study's training text, as "User as Engram" trains its shared
adapter once on other users. Cached per (model, seed, settings) as the readers' weights
(`<out>/runs/memorize-reader-<key>.safetensors`) and a record (its training losses, seconds and the
held-out loss of the model with it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engram.apps.study.memorize_arms import fact_subset, to_learn
from engram.apps.study.memorize_models import Subject, held_blocks
from engram.apps.study.memorize_probes import position_losses
from engram.apps.study.pretrained_report import read_record, write_atomic
from engram.memory import ReaderSettings, train_reader
from engram.memory.reader import reader_parameters

__all__ = ["reader_facts", "reader_model", "text_blocks"]

TEXT_TOKENS = 1 << 18  # of the study's training text: plenty for a reader's few passes


def reader_facts(total: int, n_reader: int, largest: int, seed: int) -> list[int] | None:
    """The record ids a seed's reader trains on: the last `n_reader` of the seed's permutation, or None
    when they would overlap the seed's `largest` facts written by a run."""
    if n_reader < 1 or largest + n_reader > total:
        return None
    return fact_subset(total, total, seed)[-n_reader:]


def text_blocks(s: Subject, text: str, block_len: int) -> torch.Tensor:
    """The training text's first `TEXT_TOKENS` as blocks (`held_blocks`), for the readers' LM loss."""
    return held_blocks(s, text, TEXT_TOKENS, block_len, "training")


def reader_model(
    s: Subject,
    records: list[dict[str, Any]],
    ids: list[int],
    settings: ReaderSettings,
    text: torch.Tensor,
    path: Path,
    say: Callable[[str], None],
    progress: Callable[[int, float], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """(a copy of `s.model` with readers trained on records `ids`, its record); from `path` (the record;
    the weights beside it, `.safetensors`) when a finished one is there, else trained now and written."""
    model = copy.deepcopy(s.model)
    layers = s.layers(model)
    weights = path.with_suffix(".safetensors")
    rec = read_record(path, 1)
    names = {f"{lid}.{n}": p for lid, ps in reader_parameters(layers).items() for n, p in ps}
    if rec is not None and weights.is_file():
        state = load_file(str(weights))
        if state.keys() == names.keys():
            with torch.no_grad():
                for k, p in names.items():
                    p.copy_(state[k])
            return model, rec
    say(f"{s.name}: training the readers on {len(ids)} other facts")
    facts = [to_learn(records[i]) for i in ids]
    r = train_reader(model, s.tokenizer, facts, settings, text=text, progress=progress, hasher=s.hasher)
    held = float(position_losses(s.logits(model), s.held, 8).mean())
    save_file({k: p.detach().contiguous().cpu() for k, p in names.items()}, str(weights))
    rec = {
        "version": 1,
        "facts": len(ids),
        "losses": r.losses,
        "text_losses": r.text_losses,
        "seconds": r.seconds,
        "changed": {str(k): v for k, v in r.changed.items()},
        "held_out_loss": held,
    }
    write_atomic(path, json.dumps(rec, indent=1))
    return model, rec
