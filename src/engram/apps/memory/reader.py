"""`engram train-reader` on an HF model folder with Engram: `train_reader_folder` trains the Engram
layers' readers on a facts file (and the LM loss of a text), then writes the model as a new Engram
model folder (HF's files, the tokenizer, the Engram part with the new readers and the tables as they
were, `engram_reader.json`), whole or not at all. Patches are then written for that folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engram.apps.hf.corpus import read_corpus
from engram.apps.hf.folder import load_engram_folder
from engram.apps.hf.settings import check_out, partial_folder
from engram.checkpoint.folder_lock import write_lock
from engram.memory import ReaderSettings, read_facts, train_reader

__all__ = ["READER_FILE", "text_blocks", "train_reader_folder"]

READER_FILE = "engram_reader.json"  # in OUT: what trained its readers
BLOCK_TOKENS = 128  # the text's LM loss: blocks of this many tokens
MAX_TEXT_TOKENS = 1 << 20  # the text's first million tokens are plenty for a reader's few passes


def text_blocks(path: str | os.PathLike[str], tokenizer: Any, max_len: int | None) -> torch.Tensor:
    """The text file (UTF-8, or JSONL with a "text" field) as `hf-train` and `hf-eval` read a corpus
    (`read_corpus`), in blocks of `BLOCK_TOKENS` (fewer where the model's context is shorter), the first
    `MAX_TEXT_TOKENS` tokens' worth; ValueError for a text shorter than one block."""
    length = min(BLOCK_TOKENS, max_len or BLOCK_TOKENS)
    corpus = read_corpus(str(path), tokenizer, length, 0.0)
    if corpus.train.shape[0] == 0:
        raise ValueError(
            f"--text {path}: {corpus.tokens} tokens, fewer than one block of {length}; give more text"
        )
    return corpus.train[: MAX_TEXT_TOKENS // length]


def train_reader_folder(
    folder: str,
    facts: str | os.PathLike[str],
    out: str | os.PathLike[str],
    settings: ReaderSettings | None = None,
    *,
    text: str | os.PathLike[str] | None = None,
    progress: Callable[[int, float], None] | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Train the readers of HF folder `folder`'s model (with Engram) on the facts of JSONL file `facts`
    and the text file `text` (`engram.memory.train_reader`), and write the model to `out` (new or
    empty). Everything is checked before the model loads; a refusal or a failure writes nothing.
    Returns the summary `engram train-reader` prints."""
    s = settings or ReaderSettings()
    check_out(out)
    if Path(out).resolve() == Path(folder).resolve():
        raise ValueError(f"--out {out} is the folder read: give a new folder")
    fact_list = read_facts(facts)
    with write_lock(out, f"engram train-reader --out {shlex.quote(str(out))}"):
        model, tok = load_engram_folder(folder, verify=verify)
        max_len = getattr(model.config, "max_position_embeddings", None)
        blocks = None if text is None else text_blocks(text, tok, max_len)
        r = train_reader(model, tok, fact_list, s, text=blocks, progress=progress)
        summary = {
            "out": str(out),
            "folder": str(folder),
            "facts": r.facts,
            "passes": s.passes,
            "loss_first": r.losses[0],
            "loss": r.losses[-1],
            "text": None if text is None else str(text),
            "text_blocks": 0 if blocks is None else int(blocks.shape[0]),
            "text_loss_first": r.text_losses[0] if r.text_losses else None,
            "text_loss": r.text_losses[-1] if r.text_losses else None,
            "changed": {str(k): v for k, v in r.changed.items()},
            "seconds": r.seconds,
            "settings": {
                "lr": s.lr,
                "row_lr": s.row_lr,
                "rows": s.choice.value,
                "rows_per_fact": s.rows_per_fact,
                "batch_size": s.batch_size,
                "text_weight": s.text_weight,
                "text_batch": s.text_batch,
                "seed": s.seed,
            },
        }
        stage = partial_folder(out)
        shutil.rmtree(stage, ignore_errors=True)  # a run killed while writing: written again
        try:
            model.save_pretrained(stage)
            tok.save_pretrained(stage)
            (stage / READER_FILE).write_text(json.dumps(summary, indent=1) + "\n")
            o = Path(out)
            if o.is_dir():
                o.rmdir()  # empty (checked): the rename below replaces it
            os.replace(stage, o)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return summary
