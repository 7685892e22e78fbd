"""How often a reference text uses each Engram row: the profile that pinned cache policies pin from.

`count_rows` counts, per layer, the batches of `batch_tokens` tokens that use each row (a row used
several times within one batch counts once: that is what a cache with per-batch deduplication
fetches; `batch_tokens=1` counts every use, as one token never asks a row twice). A `Profile` keeps
the rows seen, hottest first, with the layout and tokenizer fingerprints it was counted with, and is
a safetensors file (`save_profile` / `load_profile`, `engram profile`). Loading for another layout
or tokenizer is refused. Knows row ids, nothing of caches. Design: docs/systems.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout
from engram.checkpoint.files import open_tensors, save_tensors
from engram.systems.policies import distinct_counts, sorted_distinct

__all__ = ["Profile", "build_profile", "count_rows", "layout_fingerprint", "load_profile", "save_profile"]

FORMAT = "engram-row-profile-1"


def layout_fingerprint(layout: Layout) -> str:
    """sha256 over what decides every row id: the layer ids, each layer's primes and multipliers,
    the compressed vocabulary, pad id and n-gram orders."""
    c = layout.config
    spec = {
        "layers": [[ly.layer_id, [list(p) for p in ly.primes], list(ly.multipliers)] for ly in layout.layers],
        "max_ngram_size": c.max_ngram_size,
        "n_heads": c.n_heads,
        "compressed_vocab_size": c.compressed_vocab_size,
        "pad_token_id": c.pad_token_id,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def count_rows(rows: np.ndarray, batch_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer of rows (N, layers, heads): (row ids, batches using them), hottest first (ties: the
    smaller row id first). Batches are consecutive runs of `batch_tokens` tokens."""
    if not isinstance(rows, np.ndarray) or rows.ndim != 3 or not np.issubdtype(rows.dtype, np.integer):
        found = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
        raise ValueError(f"rows must be an integer array (tokens, layers, heads), got {found}")
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"batch_tokens={batch_tokens!r} must be a whole number >= 1")
    out = []
    for li in range(rows.shape[1]):
        per_batch = [
            sorted_distinct(rows[s : s + batch_tokens, li]) for s in range(0, rows.shape[0], batch_tokens)
        ]
        flat = np.concatenate(per_batch) if per_batch else np.empty(0, np.int64)
        ids, counts = distinct_counts(flat)  # ascending ids
        order = np.argsort(-counts, kind="stable")  # hottest first, ties by ascending id
        out.append((ids[order], counts[order].astype(np.int64)))
    return out


@dataclass(frozen=True)
class Profile:
    """Row use counts of a reference text, per layer, hottest first."""

    layer_ids: tuple[int, ...]
    rows: tuple[np.ndarray, ...]  # per layer (K,) int64 row ids, hottest first
    counts: tuple[np.ndarray, ...]  # per layer (K,) int64 batches using the row
    batch_tokens: int
    tokens: int
    layout_fingerprint: str
    tokenizer_fingerprint: str
    config: dict[str, Any]  # the EngramConfig's to_dict()
    source: str

    def hottest(self, layer_id: int, n: int | None = None) -> np.ndarray:
        """The `n` (default: all) most used rows of layer `layer_id`, hottest first."""
        if layer_id not in self.layer_ids:
            raise ValueError(f"this profile counts layers {list(self.layer_ids)}, not layer {layer_id}")
        rows = self.rows[self.layer_ids.index(layer_id)]
        return rows if n is None else rows[:n]

    def check(self, hasher: NgramHasher) -> None:
        """Refuse this profile unless it was counted with `hasher`'s layout and tokenizer."""
        fp = layout_fingerprint(hasher.layout)
        if fp != self.layout_fingerprint:
            raise ValueError(
                f"this profile ({self.source}) was counted with another layout (fingerprint "
                f"{self.layout_fingerprint[:12]}..., config {self.config.get('name')!r}) than config "
                f"{hasher.config.name!r} (fingerprint {fp[:12]}...); its row ids mean other rows here. "
                "Write a new profile with `engram profile` for this config"
            )
        tp = hasher.compression.fingerprint
        if tp != self.tokenizer_fingerprint:
            raise ValueError(
                f"this profile ({self.source}) was counted with another tokenizer (fingerprint "
                f"{self.tokenizer_fingerprint[:12]}..., this one {tp[:12]}...); write a new profile "
                "with `engram profile` and this tokenizer"
            )


def build_profile(hasher: NgramHasher, token_ids: np.ndarray, batch_tokens: int, source: str) -> Profile:
    """Hash token_ids (N,) with `hasher` and count each layer's rows (see `count_rows`)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise ValueError(f"{source} holds no tokens (shape {ids.shape}); give a non-empty text")
    per_layer = count_rows(hasher.hash(ids), batch_tokens)
    return Profile(
        layer_ids=tuple(hasher.config.layer_ids),
        rows=tuple(r for r, _ in per_layer),
        counts=tuple(c for _, c in per_layer),
        batch_tokens=batch_tokens,
        tokens=int(ids.shape[0]),
        layout_fingerprint=layout_fingerprint(hasher.layout),
        tokenizer_fingerprint=hasher.compression.fingerprint,
        config=hasher.config.to_dict(),
        source=source,
    )


def save_profile(profile: Profile, path: str | os.PathLike[str], top: int | None = None) -> int:
    """Write `profile` (only each layer's `top` hottest rows, if given) as safetensors; returns bytes."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top={top!r} must be a whole number >= 1 (rows kept per layer), or None for all")
    tensors = {}
    for lid, rows, counts in zip(profile.layer_ids, profile.rows, profile.counts, strict=True):
        tensors[f"rows.{lid}"] = torch.from_numpy(np.ascontiguousarray(rows[:top]))
        tensors[f"counts.{lid}"] = torch.from_numpy(np.ascontiguousarray(counts[:top]))
    meta = {
        "engram_format": FORMAT,
        "layer_ids": json.dumps(list(profile.layer_ids)),
        "batch_tokens": str(profile.batch_tokens),
        "tokens": str(profile.tokens),
        "layout_fingerprint": profile.layout_fingerprint,
        "tokenizer_fingerprint": profile.tokenizer_fingerprint,
        "config": json.dumps(profile.config, sort_keys=True),
        "source": profile.source,
    }
    return save_tensors(path, tensors, meta)


def load_profile(path: str | os.PathLike[str], hasher: NgramHasher | None = None) -> Profile:
    """Read a profile written by `save_profile`; with `hasher`, refuse one for another layout or tokenizer."""
    f = open_tensors(path)
    meta = f.metadata if isinstance(f.metadata, dict) else {}
    if meta.get("engram_format") != FORMAT:
        raise ValueError(
            f"{path} is not an Engram row profile (format {meta.get('engram_format')!r}, expected "
            f"{FORMAT!r}); write one with `engram profile --out FILE`"
        )
    try:
        layer_ids = tuple(int(x) for x in json.loads(meta["layer_ids"]))
        rows = tuple(f.tensor(f"rows.{lid}").numpy().astype(np.int64) for lid in layer_ids)
        counts = tuple(f.tensor(f"counts.{lid}").numpy().astype(np.int64) for lid in layer_ids)
        profile = Profile(
            layer_ids=layer_ids,
            rows=rows,
            counts=counts,
            batch_tokens=int(meta["batch_tokens"]),
            tokens=int(meta["tokens"]),
            layout_fingerprint=meta["layout_fingerprint"],
            tokenizer_fingerprint=meta["tokenizer_fingerprint"],
            config=json.loads(meta["config"]),
            source=meta.get("source", str(path)),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: a damaged row profile ({type(e).__name__}: {e}); write it again") from None
    if any(r.shape != c.shape for r, c in zip(rows, counts, strict=True)):
        raise ValueError(f"{path}: rows and counts differ in length; a damaged profile, write it again")
    if hasher is not None:
        profile.check(hasher)
    return profile
