"""How much a hot-row cache saves on real text: replay a token stream's Engram rows through `RowCache`.

Hashes a corpus with the config's real layout and replays its rows batch by batch through one
exact-LRU `RowCache` per layer and capacity, reporting what deduplication and the cache leave to
fetch per token (`engram cache-sim`). Only the cache's index matters here, so its rows are kept
32 bytes wide. Design: docs/systems.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engram.systems.cache import RowCache

__all__ = ["CacheSimReport", "simulate_cache"]


@dataclass
class CacheSimReport:
    layer_id: int
    capacity: int  # cache slots (rows)
    tokens: int
    rows_asked: int  # tokens * heads
    rows_distinct: int  # distinct rows per batch, summed over batches (what a deduplicated fetch reads)
    hits: int  # of those, found in the cache
    hits_second_half: int  # hits over the second half of the batches (the cache warm; 0 for 1 batch)
    distinct_second_half: int
    row_bytes: int  # bytes of one stored row (V4.1: 256 FP8 values + 8 scales = 264)
    batches: int  # calls replayed (a warm rate needs >= 2: the first batch is always cold)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows_distinct if self.rows_distinct else 0.0

    @property
    def warm_hit_rate(self) -> float | None:
        """Hit rate over the second half of the batches; None with fewer than 2 batches (no warm half)."""
        if self.batches < 2:
            return None
        return self.hits_second_half / self.distinct_second_half if self.distinct_second_half else 0.0

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes fetched per token: every row asked, distinct rows per batch, misses of the cache."""
        per = self.row_bytes / self.tokens
        return {
            "no_dedup": self.rows_asked * per,
            "dedup": self.rows_distinct * per,
            "dedup_and_cache": (self.rows_distinct - self.hits) * per,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "hit_rate": self.hit_rate,
            "warm_hit_rate": self.warm_hit_rate,
            "bytes_per_token": self.bytes_per_token(),
        }


def simulate_cache(
    rows: np.ndarray,
    batch_tokens: int,
    capacities: list[int],
    row_bytes: int,
    layer_ids: list[int] | None = None,
) -> list[CacheSimReport]:
    """Replay rows (N, n_layers, heads) of a token stream, `batch_tokens` per call, through one LRU
    cache per (layer, capacity). Returns one report per pair, layers outermost."""
    if rows.ndim != 3 or rows.shape[0] == 0:
        raise ValueError(f"rows must be (tokens >= 1, layers, heads), got shape {rows.shape}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens={batch_tokens} must be >= 1")
    if not capacities or any(c < 1 for c in capacities):
        raise ValueError(f"capacities {capacities} must be one or more cache sizes >= 1 row")
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"rows must hold integer row ids, got dtype {rows.dtype}")
    if rows.min() < 0:
        pos = tuple(int(i) for i in np.argwhere(rows < 0)[0])
        raise ValueError(f"row id {int(rows[pos])} at position {pos} is negative; row ids are >= 0")
    n, n_layers, _ = rows.shape
    layer_ids = list(range(n_layers)) if layer_ids is None else list(layer_ids)
    if len(layer_ids) != n_layers:
        raise ValueError(
            f"layer_ids {layer_ids} name {len(layer_ids)} layer(s) but rows hold {n_layers} (axis 1 of "
            f"shape {rows.shape}); give one id per layer, or layer_ids=None"
        )
    starts = range(0, n, batch_tokens)
    # the warm half: the second half of the batches; with one batch there is none (it is cold)
    half = len(starts) // 2 if len(starts) >= 2 else len(starts)
    reports = []
    for li in range(n_layers):
        # distinct rows of each batch, sorted int64 (what RowCache.plan takes), computed once per layer
        batches = [np.unique(rows[s : s + batch_tokens, li].astype(np.int64)) for s in starts]
        seen = int(np.unique(np.concatenate(batches)).size)
        for cap in capacities:
            # only the index and counters matter (rows 32 bytes wide); an LRU cache with a slot for every
            # row the stream asks never evicts, so more slots than that change nothing and are not allocated
            cache = RowCache(min(cap, seen), 32)
            hits_late = distinct_late = 0
            for b, uniq in enumerate(batches):
                before = cache.hits
                cache.plan(uniq)
                if b >= half:
                    hits_late += cache.hits - before
                    distinct_late += uniq.shape[0]
            reports.append(
                CacheSimReport(
                    layer_id=layer_ids[li],
                    capacity=cap,
                    tokens=n,
                    rows_asked=int(rows[:, li].size),
                    rows_distinct=cache.hits + cache.misses,
                    hits=cache.hits,
                    hits_second_half=hits_late,
                    distinct_second_half=distinct_late,
                    row_bytes=row_bytes,
                    batches=len(starts),
                )
            )
    return reports
