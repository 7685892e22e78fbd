"""Row statistics of a hashed text for planning training (`engram plan train`): how many distinct rows a
batch asks for, and which rows nearly every batch asks for (the rows that load their owner most).

`measure_row_stats(rows, batch_tokens, ...)` cuts a text's rows (tokens, layers, heads) into
consecutive batches of each size and records, per layer and batch size, the mean distinct rows of a
batch in each head's block of rows and the `hot` rows found in most batches with the share of batches
holding each. `RowStats` answers `distinct(layer, tokens)` (log-log interpolation between measured
sizes) and `owner_rows` (the distinct rows a batch asks each owner of a row range for: each head's
spread over its block, the hot rows placed on their owners; a 2-gram head's block is asked for
fewer distinct rows than a 4-gram head's). Saved as JSON (`save` / `load_row_stats`), checked against
the layout's fingerprint. Numbers and numpy only: nothing of torch or of the exchange itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BatchRows", "RowStats", "load_row_stats", "measure_row_stats", "owner_bounds"]

FORMAT = "engram-row-stats-1"
DEFAULT_BATCH_TOKENS = tuple(1 << k for k in range(9, 17))  # 512 .. 65536 tokens a rank
DEFAULT_HOT = 4096  # hot rows kept per layer and batch size
DEFAULT_MAX_BATCHES = 64  # batches measured per size (spread over the text)


@dataclass(frozen=True)
class BatchRows:
    """One layer's rows in batches of `batch_tokens` consecutive tokens."""

    batch_tokens: int
    batches: int  # batches measured
    distinct_heads: tuple[float, ...]  # mean distinct rows of a batch in each head's block of rows
    hot_rows: tuple[int, ...] = ()  # rows in most batches, most frequent first
    hot_share: tuple[float, ...] = ()  # share of the batches holding each hot row

    @property
    def distinct(self) -> float:
        """Mean distinct rows of a batch (the heads' blocks are disjoint: their sum)."""
        return float(sum(self.distinct_heads))


@dataclass(frozen=True)
class RowStats:
    """Measured row statistics of one text under one layout."""

    config: str
    fingerprint: (
        str  # the layout's (engram.addressing.layout.layout_fingerprint): rows mean nothing elsewhere
    )
    source: str
    tokens: int
    head_rows: tuple[tuple[int, ...], ...]  # per layer, the rows of each head's block (its prime), in order
    table_rows: tuple[int, ...]  # per layer (padding included)
    layers: tuple[tuple[BatchRows, ...], ...] = field(default=())  # per layer, by batch size

    @property
    def rows_per_token(self) -> int:
        return len(self.head_rows[0])

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(b.batch_tokens for b in self.layers[0])

    def distinct_heads(self, layer: int, tokens: float) -> np.ndarray:
        """(heads,) mean distinct rows of each head of layer index `layer` in a batch of `tokens` tokens:
        the measured share of distinct rows among the head's lookups, interpolated log-log between
        batch sizes. Outside the measured sizes the nearest size's share is used (beyond the largest:
        an upper bound, as the share only falls as the batch grows; below the smallest: a lower bound)."""
        pts = self.layers[layer]
        if not tokens > 0:
            return np.zeros(len(pts[0].distinct_heads))
        sizes = np.log([b.batch_tokens for b in pts])
        shares = np.log(np.maximum([[d / b.batch_tokens for d in b.distinct_heads] for b in pts], 1e-12))
        x = math.log(tokens)
        share = np.array([np.interp(x, sizes, shares[:, h]) for h in range(shares.shape[1])])
        # at most one distinct row per lookup, and at most the head's block of rows
        return np.minimum(np.minimum(np.exp(share), 1.0) * tokens, self.head_rows[layer])

    def distinct(self, layer: int, tokens: float) -> float:
        """Mean distinct rows of layer index `layer` in a batch of `tokens` tokens (every head)."""
        return float(self.distinct_heads(layer, tokens).sum())

    def nearest(self, layer: int, tokens: float) -> BatchRows:
        """The measured batch size nearest `tokens` (in log)."""
        return min(self.layers[layer], key=lambda b: abs(math.log(b.batch_tokens) - math.log(max(tokens, 1))))

    def owner_rows(self, layer: int, tokens: float, owners: int, hot: bool = True) -> np.ndarray:
        """(owners,) distinct rows a batch of `tokens` tokens asks each owner of layer `layer`'s table for
        (owner i holds rows [i * n // N, (i + 1) * n // N)): the hot rows (of the nearest measured batch
        size) on their owners, each head's other distinct rows spread evenly over the head's other rows.
        Sums to distinct(layer, tokens); at most an owner's range (a batch holding every row of a head
        asks each owner for all of its rows)."""
        per_head = self.distinct_heads(layer, tokens)
        heads = np.array(self.head_rows[layer], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(heads)[:-1]])
        bounds = owner_bounds(self.table_rows[layer], owners)
        lo, hi = bounds[:-1, None], bounds[1:, None]  # (owners, 1)
        free = np.clip(np.minimum(hi, starts + heads) - np.maximum(lo, starts), 0, None).astype(np.float64)
        out = np.zeros(owners)
        if hot:
            b = self.nearest(layer, tokens)
            rows = np.array(b.hot_rows, dtype=np.int64)
            share = np.array(b.hot_share, dtype=np.float64)
            head = np.searchsorted(starts, rows, side="right") - 1
            owner = np.searchsorted(bounds, rows, side="right") - 1
            in_head = np.bincount(head, weights=share, minlength=heads.size)
            # a batch of another size than measured holds its hot rows in proportion
            scale = np.minimum(1.0, per_head / np.maximum(in_head, 1e-12))
            out += np.bincount(owner, weights=share * scale[head], minlength=owners)
            per_head = np.maximum(per_head - in_head * scale, 0.0)
            np.subtract.at(free, (owner, head), 1.0)  # (owners, heads) rows that are not hot
        spread = free @ (per_head / np.maximum(free.sum(axis=0), 1.0))
        return np.minimum(out + spread, np.diff(bounds))

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT} | asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))


def owner_bounds(num_rows: int, owners: int) -> np.ndarray:
    """(owners + 1,) row boundaries: owner i holds rows [i * n // N, (i + 1) * n // N) (as
    engram.distributed.shard_bounds splits a table over its owner ranks)."""
    return np.array([i * num_rows // owners for i in range(owners + 1)], dtype=np.int64)


def measure_row_stats(
    rows: np.ndarray,
    head_rows: tuple[tuple[int, ...], ...] | list[list[int]],
    table_rows: tuple[int, ...] | list[int],
    *,
    config: str,
    fingerprint: str,
    source: str,
    batch_tokens: tuple[int, ...] = DEFAULT_BATCH_TOKENS,
    hot: int = DEFAULT_HOT,
    max_batches: int = DEFAULT_MAX_BATCHES,
) -> RowStats:
    """Statistics of a hashed text's rows (tokens, layers, heads) in batches of each `batch_tokens`
    size (those longer than the text are left out; at least one must fit). `head_rows`: per layer, the
    rows of each head's block, in the rows' column order (Layout's primes). At most `max_batches`
    batches per size, spread evenly over the text; `hot` rows kept per layer and size."""
    if rows.ndim != 3 or rows.shape[1] != len(table_rows) or len(head_rows) != len(table_rows):
        raise ValueError(
            f"rows must be (tokens, {len(table_rows)} layers, heads) with the heads' rows of every layer, "
            f"got rows of shape {rows.shape} and {len(head_rows)} layers of heads"
        )
    if any(len(h) != rows.shape[2] for h in head_rows):
        raise ValueError(
            f"head_rows must give {rows.shape[2]} heads per layer, got {[len(h) for h in head_rows]}"
        )
    if hot < 0 or max_batches < 1:
        raise ValueError(f"hot={hot} must be >= 0 and max_batches={max_batches} >= 1")
    sizes = sorted({int(b) for b in batch_tokens if 1 <= b <= rows.shape[0]})
    if not sizes:
        raise ValueError(
            f"the text has {rows.shape[0]:,} tokens, fewer than the smallest batch measured "
            f"({min(batch_tokens):,}); give a longer text or smaller batches"
        )
    layers = []
    for li in range(rows.shape[1]):
        per = []
        for b in sizes:
            n = rows.shape[0] // b
            picks = np.unique(np.linspace(0, n - 1, min(n, max_batches)).round().astype(np.int64))
            heads = [
                [np.unique(rows[i * b : (i + 1) * b, li, h]) for h in range(rows.shape[2])] for i in picks
            ]
            ids, counts = np.unique(np.concatenate([d for batch in heads for d in batch]), return_counts=True)
            top = np.argsort(-counts, kind="stable")[:hot]
            per.append(
                BatchRows(
                    b,
                    int(picks.size),
                    tuple(float(np.mean([batch[h].size for batch in heads])) for h in range(rows.shape[2])),
                    tuple(int(r) for r in ids[top]),
                    tuple(float(c) / picks.size for c in counts[top]),
                )
            )
        layers.append(tuple(per))
    return RowStats(config, fingerprint, source, int(rows.shape[0]),
                    tuple(tuple(int(p) for p in h) for h in head_rows), tuple(int(n) for n in table_rows),
                    tuple(layers))  # fmt: skip


def load_row_stats(path: str | Path, fingerprint: str | None = None) -> RowStats:
    """Read `RowStats.save`'s file; with `fingerprint`, refuse statistics of another layout."""
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not a row statistics file ({e}); write one with engram plan train --row-stats"
        ) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a row statistics file of format {FORMAT!r}; measure again with --row-stats"
        )
    if fingerprint is not None and d.get("fingerprint") != fingerprint:
        raise ValueError(
            f"{path}: row statistics of another layout (config {d.get('config')!r}); they mean nothing for "
            "this config's rows: give another --row-stats file (a missing one is measured and written)"
        )
    try:
        layers = tuple(
            tuple(
                BatchRows(
                    b["batch_tokens"],
                    b["batches"],
                    tuple(b["distinct_heads"]),
                    tuple(b["hot_rows"]),
                    tuple(b["hot_share"]),
                )
                for b in layer
            )
            for layer in d["layers"]
        )
        heads = tuple(tuple(h) for h in d["head_rows"])
        stats = RowStats(d["config"], d["fingerprint"], d["source"], d["tokens"], heads, tuple(d["table_rows"]),
                         layers)  # fmt: skip
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: a damaged row statistics file ({type(e).__name__}: {e}); measure again"
        ) from None
    if not stats.layers or any(not layer for layer in stats.layers):
        raise ValueError(f"{path}: a row statistics file without measured batches; measure again")
    return stats
