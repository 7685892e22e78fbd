"""`engram memorize` and `engram patch check` on an HF model folder with Engram: `memorize_folder` (the
folder's model taught a facts file, the patch written to a new file, a summary returned) and
`check_patches` (the patches the folder's model takes, in order). `reference_sequences` turns a text
whose rows must stay untouched (a held-out corpus) into the token sequences `memorize` leaves out.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engram.apps.hf.corpus import read_documents
from engram.apps.hf.folder import load_engram_folder
from engram.apps.memory.files import apply_patches, describe, read_patches
from engram.checkpoint.input_files import path_kind
from engram.config import EngramConfig
from engram.memory import (
    EngramLayers,
    MemorizeSettings,
    PatchOverlapWarning,
    memorize,
    read_facts,
    save_patch,
)
from engram.memory.choose import default_reference_tokens

__all__ = ["check_patches", "memorize_folder", "patch_name", "reference_sequences"]

CHUNK_CHARS = 1 << 20  # text tokenized a piece at a time (cut at a line's end): bounded memory
SEQUENCE_TOKENS = 1 << 16  # reference rows hashed a sequence at a time: (T, layers, heads) int64 each


def patch_name(out: str | os.PathLike[str]) -> str:
    """The default name of a patch written to `out`: its file name less .safetensors and .patch."""
    return Path(out).name.removesuffix(".safetensors").removesuffix(".patch") or Path(out).name


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each ending at a line's end where it can."""
    out, start = [], 0
    while start < len(text):
        stop = min(start + size, len(text))
        if stop < len(text):
            nl = text.rfind("\n", start, stop)
            stop = nl + 1 if nl >= start else stop
        out.append(text[start:stop])
        start = stop
    return out


def reference_sequences(
    documents: Sequence[str],
    tokenizer: Any,
    config: EngramConfig,
    *,
    max_tokens: int | None = None,
    chunk_chars: int = CHUNK_CHARS,
) -> list[np.ndarray]:
    """Token sequences (int64 arrays) of `documents` as `hf-eval` reads a corpus (no special tokens, the
    documents joined by the tokenizer's EOS), its first `max_tokens` (None: all), tokenized
    `chunk_chars` at a time, cut into sequences of `SEQUENCE_TOKENS` that overlap by
    `max_ngram_size - 1`, so no n-gram is lost at a cut (the rows a block starting anywhere reads are
    `engram.memory.choose.rows_read`'s)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    parts: list[np.ndarray] = []
    total = 0
    for doc in documents:
        for piece in _pieces(doc, chunk_chars):
            if max_tokens is not None and total >= max_tokens:
                break
            parts.append(np.asarray(tokenizer(piece, add_special_tokens=False)["input_ids"], dtype=np.int64))
            total += parts[-1].size
        if eos is not None:
            parts.append(np.array([eos], dtype=np.int64))
            total += 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(parts) if parts else np.empty(0, np.int64)
    stream = stream if max_tokens is None else stream[:max_tokens]
    back = config.max_ngram_size - 1  # tokens an n-gram reaches back
    step = SEQUENCE_TOKENS - back
    return [stream[i : i + SEQUENCE_TOKENS] for i in range(0, max(stream.size - back, 1), step)]


def _refuse_existing(out: str | os.PathLike[str]) -> None:
    kind = path_kind(out)
    if kind is not None:
        raise ValueError(f"{out} exists already ({kind}): give a new path for the patch, or remove it first")


def memorize_folder(
    folder: str,
    facts: str | os.PathLike[str],
    out: str | os.PathLike[str],
    settings: MemorizeSettings | None = None,
    *,
    reference: str | os.PathLike[str] | None = None,
    reference_tokens: int | None = None,
    name: str | None = None,
    progress: Callable[[int, float], None] | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Teach the model of HF folder `folder` (with Engram) the facts of JSONL file `facts`
    (`engram.memory.read_facts`) and write the patch to `out`, a new file (`save_patch`: whole or not at
    all). `reference`: a corpus file (UTF-8 text, or JSONL with a "text" field, as `hf-eval` reads it)
    whose rows no fact takes: its first `reference_tokens` (None: `default_reference_tokens`, 0: all of
    it). `name`: default `patch_name(out)`. Everything is checked before the model loads; a refusal
    writes nothing. Returns the summary `engram memorize` prints."""
    s = settings or MemorizeSettings()
    _refuse_existing(out)
    if not Path(out).parent.is_dir():
        raise ValueError(f"{Path(out).parent} is not a folder: make it first, or write the patch elsewhere")
    fact_list = read_facts(facts)
    docs = read_documents(reference) if reference is not None else None
    model, tok = load_engram_folder(folder, verify=verify)
    ref, ref_tokens = None, None
    if docs is not None:
        hasher = EngramLayers.of(model).hasher
        cap = default_reference_tokens(hasher) if reference_tokens is None else reference_tokens or None
        ref = reference_sequences(docs, tok, hasher.config, max_tokens=cap)
        back = hasher.config.max_ngram_size - 1  # the sequences overlap by this much
        ref_tokens = sum(x.size for x in ref) - back * max(len(ref) - 1, 0)
    r = memorize(
        model,
        tok,
        fact_list,
        s,
        reference=ref,
        name=patch_name(out) if name is None else name,
        progress=progress,
    )
    _refuse_existing(out)  # written meanwhile: not replaced
    save_patch(r.patch, out)
    d = describe(read_patches([out])[0])  # what was written, read back as every reader reads it
    return {
        "patch": str(out),
        "folder": str(folder),
        "name": d["name"],
        "facts": d["facts"],
        "rows": d["rows"],
        "rows_per_layer": d["rows_per_layer"],
        "bytes": d["bytes"],
        "bytes_per_fact": d["bytes"] / d["facts"],
        "row_format": d["row_format"],
        "fingerprint": d["fingerprint"],
        "loss_first": r.losses[0],
        "loss": r.losses[-1],
        "steps": s.steps,
        "seconds": r.seconds,
        "settings": {
            "rows": s.choice.value,
            "rows_per_fact": s.rows_per_fact,
            "steps": s.steps,
            "lr": s.lr,
            "batch_size": s.batch_size,
            "seed": s.seed,
            "reference": None if reference is None else str(reference),
            "reference_tokens": ref_tokens,
        },
    }


def check_patches(folder: str, paths: Sequence[str], *, verify: bool = False) -> list[dict[str, Any]]:
    """Whether the model of HF folder `folder` takes each patch of `paths`, applied in that order (one
    refused is skipped, the next applied on what fit): per patch {path, name, fits, error (the refusal's
    line, or None), shares (rows shared with patches applied before, as the warnings say)}. A folder
    without Engram, or one that does not load, is refused (ValueError)."""
    model, _ = load_engram_folder(folder, verify=verify)
    out = []
    for path in paths:
        r: dict[str, Any] = {"path": str(path), "name": None, "fits": False, "rows": None, "error": None}
        r["shares"] = []
        try:
            (f,) = read_patches([path])
            r["name"] = f.patch.name
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PatchOverlapWarning)
                apply_patches(model, [f])
            r["fits"] = True
            r["rows"] = f.patch.num_rows
            r["shares"] = [str(w.message) for w in caught if issubclass(w.category, PatchOverlapWarning)]
            for w in caught:  # any other warning: shown as it would have been
                if not issubclass(w.category, PatchOverlapWarning):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except ValueError as e:  # the line without the file's name, which "path" holds
            r["error"] = str(e).removeprefix(f"{path}: ").removeprefix(f"{Path(path)}: ")
        out.append(r)
    return out
