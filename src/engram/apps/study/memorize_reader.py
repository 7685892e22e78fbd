"""The reader of `engram study memorize`'s reader-patch arm: a copy of the model whose Engram readers
`engram.memory.train_reader` trained on facts of their own (`facts_gen.READER_FACTS_PATH`: other
subjects than any fact a run writes) and on the study's training text, once a model, as "User as Engram"
trains its shared adapter once on other users and every user's rows are read through it. Cached per
(model, reader facts, settings) as the readers' weights (`<out>/runs/memorize-reader-<key>.safetensors`)
and a record (its training losses, seconds and the held-out loss of the model with it).
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

from engram.apps.study.memorize_arms import to_learn
from engram.apps.study.memorize_models import Subject, held_blocks
from engram.apps.study.memorize_probes import position_losses
from engram.apps.study.pretrained_report import read_record, write_atomic
from engram.memory import ReaderSettings, train_reader
from engram.memory.reader import reader_parameters

__all__ = ["check_apart", "reader_model", "text_blocks"]

TEXT_TOKENS = 1 << 18  # of the study's training text: plenty for a reader's few passes


def check_apart(written: list[dict[str, Any]], readers: list[dict[str, Any]], where: str) -> None:
    """Refuse reader facts (`where`: their file) that share a subject or a prompt with a fact a run
    writes: readers trained on a fact would recall it with no patch at all."""
    subjects = {r["subject"].strip().lower() for r in written}
    prompts = {r["prompt"].strip() for r in written}
    for r in readers:
        shares_subject = r["subject"].strip().lower() in subjects
        if shares_subject or r["prompt"].strip() in prompts:
            what = "subject" if shares_subject else "prompt"
            raise ValueError(
                f"{where}: reader fact {r['id']} shares its {what} ({r[what]!r}) with a fact the study writes; "
                "readers must be trained on other subjects (facts_gen writes both shipped files apart)"
            )


def text_blocks(s: Subject, text: str, block_len: int) -> torch.Tensor:
    """The training text's first `TEXT_TOKENS` as blocks (`held_blocks`), for the readers' LM loss."""
    return held_blocks(s, text, TEXT_TOKENS, block_len, "training")


def reader_model(
    s: Subject,
    records: list[dict[str, Any]],
    settings: ReaderSettings,
    text: torch.Tensor,
    path: Path,
    say: Callable[[str], None],
    progress: Callable[[int, float], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """(a copy of `s.model` with readers trained on `records`, its record); from `path` (the record; the
    weights beside it, `.safetensors`) when a finished one is there, else trained now and written."""
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
    say(f"{s.name}: training the readers on {len(records)} other facts")
    facts = [to_learn(r) for r in records]
    r = train_reader(model, s.tokenizer, facts, settings, text=text, progress=progress, hasher=s.hasher)
    held = float(position_losses(s.logits(model), s.held, 8).mean())
    save_file({k: p.detach().contiguous().cpu() for k, p in names.items()}, str(weights))
    rec = {
        "version": 1,
        "facts": len(records),
        "losses": r.losses,
        "text_losses": r.text_losses,
        "seconds": r.seconds,
        "changed": {str(k): v for k, v in r.changed.items()},
        "held_out_loss": held,
    }
    write_atomic(path, json.dumps(rec, indent=1))
    return model, rec
