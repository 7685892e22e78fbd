"""`engram cache-sim`: how much deduplication and a hot-row cache save on a real text.

The text is tokenised and hashed with the config's layout; `engram.systems.cache_sim.simulate_cache`
replays its rows through one LRU cache per layer and size. Only argument handling and printing here.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from engram.cli.options import (
    SIZE_HELP,
    add_config_options,
    add_text_options,
    config_from_args,
    hasher_for,
    positive_int,
    row_count,
    text_from_args,
)
from engram.storage.fp8 import fp8_row_bytes
from engram.systems.cache_sim import simulate_cache

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add cache-sim to the `engram` subparsers."""
    p = sub.add_parser(
        "cache-sim",
        help="replay a real text's Engram rows through LRU caches: dedup and hit rates, bytes per token",
    )
    add_config_options(p)
    add_text_options(p, "replay")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, help="tokens per fetch (default 4096)")
    p.add_argument(
        "--cache-rows",
        type=row_count,
        nargs="+",
        default=[1 << 16, 1 << 18, 1 << 20, 1 << 22],
        help=f"cache sizes in rows per layer, e.g. 64Ki 1Mi (default: 64Ki 256Ki 1Mi 4Mi; {SIZE_HELP})",
    )
    p.set_defaults(func=cmd_cache_sim)


def cmd_cache_sim(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    text, source = text_from_args(args)
    hasher, tok = hasher_for(config)
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
