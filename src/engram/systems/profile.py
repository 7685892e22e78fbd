"""How often a reference text uses each Engram row: the profile that pinned cache policies pin from.

`count_rows` counts, per layer, the batches of `batch_tokens` tokens that use each row (a row used
several times within one batch counts once: that is what a cache with per-batch deduplication
fetches; `batch_tokens=1` counts every use, as one token never asks a row twice). A `Profile` keeps
the rows seen, hottest first, with the layout and tokenizer fingerprints it was counted with, and is
a safetensors file (`save_profile` / `load_profile`, `engram profile`). Every field is checked when
a profile is made or loaded (whole-number row ids and counts, hottest first, sizes >= 1); loading
for another layout or tokenizer, or with row ids the layout does not address, is refused. Knows row ids, nothing of caches. Design: docs/systems.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import layout_fingerprint
from engram.checkpoint.files import open_tensors, save_tensors
from engram.systems.policies import distinct_counts, sorted_distinct

__all__ = ["Profile", "build_profile", "count_rows", "load_profile", "save_profile"]

FORMAT = "engram-row-profile-1"


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

    def __post_init__(self) -> None:
        fix = "write it again with `engram profile`"
        for name in ("batch_tokens", "tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"this profile's {name}={v!r} must be a whole number >= 1; {fix}")
        if len(self.rows) != len(self.layer_ids) or len(self.counts) != len(self.layer_ids):
            raise ValueError(
                f"this profile counts layers {list(self.layer_ids)} but holds {len(self.rows)} row and "
                f"{len(self.counts)} count arrays; {fix}"
            )
        for lid, rows, counts in zip(self.layer_ids, self.rows, self.counts, strict=True):
            for what, a in ((f"rows.{lid}", rows), (f"counts.{lid}", counts)):
                if not isinstance(a, np.ndarray) or a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                    found = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                    raise ValueError(
                        f"this profile's {what} is {found}; it must be a 1-D integer array (row ids and "
                        f"counts are whole numbers); {fix}"
                    )
            if rows.shape != counts.shape:
                raise ValueError(
                    f"this profile's rows.{lid} ({rows.shape[0]}) and counts.{lid} ({counts.shape[0]}) "
                    f"differ in length; {fix}"
                )
            if rows.shape[0] == 0:
                continue
            if int(rows.min()) < 0:
                i = int(np.argmax(rows < 0))
                raise ValueError(f"this profile's rows.{lid}[{i}] = {int(rows[i])}: row ids are >= 0; {fix}")
            if int(counts.min()) < 1:
                i = int(np.argmax(counts < 1))
                raise ValueError(
                    f"this profile's counts.{lid}[{i}] = {int(counts[i])}: a count is how often the text used "
                    f"the row, >= 1 for every row listed; {fix}"
                )
            if rows.shape[0] > 1 and bool((np.diff(counts) > 0).any()):
                i = int(np.argmax(np.diff(counts) > 0)) + 1
                raise ValueError(
                    f"this profile's counts.{lid} are not hottest first ({int(counts[i - 1])} then "
                    f"{int(counts[i])} at {i}); {fix}"
                )
            if np.unique(rows).shape[0] != rows.shape[0]:
                raise ValueError(f"this profile's rows.{lid} lists a row id more than once; {fix}")

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
        for lid in self.layer_ids:
            self.check_rows(lid, hasher.layout.layer(lid).num_embeddings)

    def check_rows(self, layer_id: int, table_rows: int) -> None:
        """Refuse this profile if layer `layer_id` lists a row id >= `table_rows` (the rows it has)."""
        rows = self.hottest(layer_id)
        if rows.shape[0] and int(rows.max()) >= table_rows:
            i = int(np.argmax(rows >= table_rows))
            raise ValueError(
                f"this profile ({self.source}) lists row {int(rows[i])} (rows.{layer_id}[{i}]), but layer "
                f"{layer_id} has {table_rows} rows; write a new profile with `engram profile` for this config"
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


def _ids(a: np.ndarray) -> np.ndarray:
    """An integer array as int64; any other (a float id, a NaN count) as it is, for `Profile` to refuse."""
    return a.astype(np.int64) if np.issubdtype(a.dtype, np.integer) else a


def load_profile(path: str | os.PathLike[str], hasher: NgramHasher | None = None) -> Profile:
    """Read a profile written by `save_profile`; with `hasher`, refuse one for another layout or tokenizer."""
    f = open_tensors(path)
    meta = f.metadata if isinstance(f.metadata, dict) else {}
    if meta.get("engram_format") != FORMAT:
        raise ValueError(
            f"{path} is not an Engram row profile (format {meta.get('engram_format')!r}, expected "
            f"{FORMAT!r}); write one with `engram profile --out FILE`"
        )
    damaged = f"{path}: a damaged row profile"
    try:
        layer_ids = tuple(int(x) for x in json.loads(meta["layer_ids"]))
        sizes = {}
        for name in ("batch_tokens", "tokens"):
            try:
                sizes[name] = int(meta[name])
            except ValueError:
                raise ValueError(f"{name}={meta[name]!r} is not a whole number") from None
        config, source = json.loads(meta["config"]), meta.get("source", str(path))
        layout_fp, tokenizer_fp = meta["layout_fingerprint"], meta["tokenizer_fingerprint"]
        rows = tuple(_ids(f.tensor(f"rows.{lid}").numpy()) for lid in layer_ids)
        counts = tuple(_ids(f.tensor(f"counts.{lid}").numpy()) for lid in layer_ids)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{damaged} ({type(e).__name__}: {e}); write it again") from None
    try:
        profile = Profile(
            layer_ids=layer_ids,
            rows=rows,
            counts=counts,
            batch_tokens=sizes["batch_tokens"],
            tokens=sizes["tokens"],
            layout_fingerprint=layout_fp,
            tokenizer_fingerprint=tokenizer_fp,
            config=config,
            source=source,
        )
        if hasher is not None:
            profile.check(hasher)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return profile
