"""How much a hot-row cache saves on real text: replay a token stream's Engram rows through `RowCache`.

Hashes a corpus with the config's real layout and replays its rows batch by batch through one
exact-LRU `RowCache` per layer and capacity, reporting what deduplication and the cache leave to
fetch per token (`engram cache-sim`). Only the cache's index matters here, so its rows are kept
32 bytes wide. Design: docs/systems.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engram.storage.fp8 import fp8_row_bytes
from engram.systems.cache import RowCache

__all__ = ["CacheSimReport", "add_cache_sim_command", "simulate_cache"]


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
        for cap in capacities:
            cache = RowCache(cap, 32)  # only the index and counters matter: rows 32 bytes wide
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


def _size(text: str) -> int:
    """'65536', '64K', '1M' -> rows."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a row count (e.g. 65536, 64K, 4M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a cache holds at least 1 row")
    return value


def cmd_cache_sim(args: argparse.Namespace) -> int:
    from engram.cli.commands import _config_from_args, _hasher, _text_from_args

    config = _config_from_args(args)
    text, source = _text_from_args(args)
    hasher, tok = _hasher(config)
    ids = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"{source} holds no tokens; give a non-empty text file")
    t0 = time.perf_counter()
    rows = hasher.hash(ids)  # (N, layers, heads): the text as one stream
    reports = simulate_cache(
        rows, args.batch_tokens, args.cache_rows, fp8_row_bytes(config.head_dim), list(config.layer_ids)
    )
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"source": source, "config": config.name, "seconds": elapsed,
                          "reports": [r.to_dict() for r in reports]}))  # fmt: skip
        return 0
    r0 = reports[0]
    bpt = r0.bytes_per_token()
    table_rows = hasher.layout.layers[0].num_embeddings
    print(
        f"{source}: {ids.size:,} tokens, {config.name} ({table_rows:,} rows a layer), batches of "
        f"{args.batch_tokens} tokens, {elapsed:.1f} s\n"
        f"per token and layer: {config.rows_per_token} rows = {bpt['no_dedup']:.0f} B; "
        "deduplicated per batch and through an LRU cache of the given rows on the device:\n"
    )
    print(f"{'layer':>5} {'cache rows':>11} {'cache MB':>9} {'distinct/batch':>14} {'hit rate':>8} "
          f"{'warm':>6} {'B/token dedup':>13} {'B/token +cache':>14} {'saved':>6}")  # fmt: skip
    for r in reports:
        b = r.bytes_per_token()
        warm = "-" if r.warm_hit_rate is None else f"{r.warm_hit_rate:.1%}"
        print(
            f"{r.layer_id:>5} {r.capacity:>11,} {r.capacity * r.row_bytes / 1e6:>9,.0f} "
            f"{r.rows_distinct / r.rows_asked:>14.1%} {r.hit_rate:>8.1%} {warm:>6} "
            f"{b['dedup']:>13,.0f} {b['dedup_and_cache']:>14,.0f} {1 - b['dedup_and_cache'] / b['no_dedup']:>6.1%}"
        )
    print("\nwarm: hit rate over the second half of the stream; saved: against fetching every row asked")
    return 0


def add_cache_sim_command(sub: Any) -> None:
    from engram.cli.commands import _add_config_options

    p = sub.add_parser(
        "cache-sim",
        help="replay a real text's Engram rows through LRU caches: dedup and hit rates, bytes per token",
    )
    _add_config_options(p)
    p.add_argument(
        "--text-file", action="append", help="text file(s) to replay (default: the King James Bible)"
    )
    p.add_argument("--max-chars", type=int, help="only the first N characters of the text")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per fetch (default 4096)")
    p.add_argument(
        "--cache-rows",
        type=_size,
        nargs="+",
        default=[1 << 16, 1 << 18, 1 << 20, 1 << 22],
        help="cache sizes in rows per layer, e.g. 64K 1M (default: 64K 256K 1M 4M)",
    )
    p.set_defaults(func=cmd_cache_sim)
