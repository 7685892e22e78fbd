"""The text corpus of `engram hf-train` / `hf-eval`: a UTF-8 text file (one document) or JSONL with a
"text" field (a document a line), refused when empty, binary or not UTF-8; tokenized with the model's
tokenizer, documents joined by its EOS, cut into blocks of `seq_len` tokens, the last `held_out`
fraction of the blocks held out (the end of the corpus: deterministic, never trained on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engram.checkpoint.input_files import input_file

__all__ = ["HELD_OUT", "SEQ_LEN_ONE", "Corpus", "read_corpus", "read_documents", "split_blocks"]

HELD_OUT = 0.05  # the last 5% of the corpus's blocks: never trained on
# a block's loss predicts tokens 1..T-1 from those before them: a block of one token predicts nothing
SEQ_LEN_ONE = (
    "--seq-len 1: a block of one token has no next token to predict (no loss to train or evaluate); "
    "give --seq-len 2 or more"
)


@dataclass(frozen=True)
class Corpus:
    """A corpus cut into token blocks: `train` and `held` ([n, seq_len] int64), the last blocks held out."""

    path: str
    train: torch.Tensor
    held: torch.Tensor
    tokens: int  # of the whole corpus


def read_documents(path: str | os.PathLike[str]) -> list[str]:
    """The documents of a corpus file: a JSONL file (suffix .jsonl): each line's "text"; any other file:
    its whole text as one document. Refuses a missing, empty, binary or non-UTF-8 file, and a JSONL
    line that is not an object with a string "text", naming the line."""
    p = input_file(path, "a corpus (a UTF-8 text file, or JSONL with a 'text' field)")
    data = p.read_bytes()
    nul = data.find(b"\0", 0, 1 << 20)
    if nul >= 0:
        raise ValueError(
            f"{path} looks binary (a NUL byte at offset {nul}): give a UTF-8 text file or JSONL with a "
            "'text' field"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {e.start}): give a UTF-8 text file or JSONL with a 'text' field"
        ) from None
    if not text.strip():
        raise ValueError(f"{path} is empty (no text): give a corpus with text in it")
    if p.suffix.lower() != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not JSON ({e.msg}); give one JSON object a line") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(
                f"{path}, line {n}: expected an object with a string 'text' field, got "
                f"{type(rec).__name__}{' without text' if isinstance(rec, dict) else ''}; fix the line, "
                "or give a plain text file (any suffix but .jsonl)"
            )
        if rec["text"].strip():
            docs.append(rec["text"])
    if not docs:
        raise ValueError(f"{path} holds no text (every 'text' field is empty): give a corpus with text in it")
    return docs


def split_blocks(ids: Sequence[int], seq_len: int, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held): the id stream cut into blocks of `seq_len` (the tail dropped); the last
    round(held_out * blocks) blocks (at least 1 when held_out > 0) are held out."""
    if seq_len < 2:
        raise ValueError(SEQ_LEN_ONE if seq_len == 1 else f"--seq-len {seq_len}: give 2 or more")
    n = len(ids) // seq_len
    blocks = torch.tensor(list(ids[: n * seq_len]), dtype=torch.int64).view(n, seq_len)
    n_held = 0 if held_out == 0 or n == 0 else max(1, round(held_out * n))
    return blocks[: n - n_held], blocks[n - n_held :]


def read_corpus(
    path: str, tokenizer: Any, seq_len: int, held_out: float, docs: list[str] | None = None
) -> Corpus:
    """Read (or take `docs`, its `read_documents`), tokenize (documents joined by the tokenizer's EOS when
    it has one) and split a corpus."""
    docs = read_documents(path) if docs is None else docs
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    train, held = split_blocks(ids, seq_len, held_out)
    return Corpus(str(path), train, held, len(ids))
