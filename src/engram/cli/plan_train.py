"""`engram plan train`: memory per rank and the row exchange per step of training row-sharded tables.

Registered by `engram.cli.systems` under `engram plan` (beside `plan memory`). The row statistics
(distinct rows per batch, the rows most batches ask for) are measured on a real text through the
config's layout, the King James Bible by default, or read from --row-stats FILE (a missing FILE is
measured and written, so the text is hashed once). The work is `engram.systems.row_stats` and
`.train_plan`'s; only argument handling and printing here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from engram.cli.options import (
    SIZE_HELP,
    add_config_options,
    add_text_options,
    config_from_args,
    hasher_for,
    row_count,
    text_from_args,
)
from engram.systems.row_stats import RowStats, load_row_stats, measure_row_stats
from engram.systems.train_plan import (
    LINK_GBPS,
    PARAM_BYTES,
    TableOptimizer,
    TrainPlan,
    TrainSetup,
    plan_training,
)

__all__ = ["add_plan_train", "cmd_plan_train"]


def add_plan_train(p: argparse.ArgumentParser) -> None:
    add_config_options(p)
    add_text_options(p, "measure the rows of")
    p.add_argument("--row-stats", metavar="FILE",
                   help="row statistics to read; a missing FILE is measured on the text and written there")  # fmt: skip
    p.add_argument("--tokens-per-step", type=row_count, required=True,
                   help=f"tokens of the global batch, every rank's together, e.g. 16Mi ({SIZE_HELP})")  # fmt: skip
    p.add_argument("--ranks", type=int, nargs="+", required=True, metavar="N",
                   help="data-parallel ranks (GPUs), each with tokens-per-step / N tokens; several: one row each")  # fmt: skip
    p.add_argument("--table-ranks", type=int, metavar="N",
                   help="ranks holding the tables' rows (the first N; default: every rank)")  # fmt: skip
    p.add_argument("--optimizer", nargs="+", default=[TableOptimizer.ADAM.value], metavar="NAME",
                   help=f"table optimizer(s): {', '.join(o.value for o in TableOptimizer)} (default adam: "
                   "SparseRowAdam; dense-adam: the paper's Adam over the whole table)")  # fmt: skip
    p.add_argument("--param-dtype", default="fp32", choices=sorted(PARAM_BYTES),
                   help="the tables' values, the rows exchanged and their gradients (default fp32)")  # fmt: skip
    p.add_argument("--link-gbps", type=float, default=LINK_GBPS,
                   help=f"GB/s each rank sends and receives at (default {LINK_GBPS:g}: 400 Gb/s InfiniBand)")  # fmt: skip
    p.add_argument("--active-share", type=float, default=1.0,
                   help="sinkhorn: share of a shard's rows with momentum (default 1: every row, as at V4.1's scale)")  # fmt: skip
    p.add_argument("--steps", type=int, metavar="N",
                   help="sinkhorn: the run's steps so far; its active rows are the distinct rows of N global batches "
                   "(from the statistics) instead of --active-share")  # fmt: skip
    p.set_defaults(func=cmd_plan_train)


def _row_stats(args: argparse.Namespace, config: Any) -> RowStats:
    """--row-stats FILE read (checked against the layout), or measured on the text (and written there)."""
    from engram.addressing.layout import Layout, layout_fingerprint

    layout = Layout(config)
    fingerprint = layout_fingerprint(layout)
    if args.row_stats and Path(args.row_stats).exists():
        if args.text_file or args.max_chars:
            raise ValueError(
                f"--row-stats {args.row_stats} exists and is read; --text-file / --max-chars would measure a "
                "text: give a new --row-stats path to measure, or leave them out"
            )
        return load_row_stats(args.row_stats, fingerprint)
    if args.row_stats and not Path(args.row_stats).parent.is_dir():
        raise ValueError(
            f"--row-stats {args.row_stats}: its folder does not exist; create it or give another path"
        )
    hasher, tok = hasher_for(config)
    text, source = text_from_args(args)
    ids = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"{source} holds no tokens; give a non-empty text")
    heads = [layer.flat_primes.tolist() for layer in layout.layers]
    stats = measure_row_stats(hasher.hash(ids), heads, layout.table_rows, config=config.name, fingerprint=fingerprint,
                              source=source)  # fmt: skip
    if args.row_stats:
        stats.save(args.row_stats)
    return stats


def cmd_plan_train(args: argparse.Namespace) -> int:
    setups = [  # before the (slow) measuring: a bad setup is refused at once
        TrainSetup(
            args.tokens_per_step,
            r,
            o,
            args.table_ranks,
            args.param_dtype,
            args.link_gbps,
            args.active_share,
            args.steps,
        )
        for r in args.ranks
        for o in args.optimizer
    ]
    config = config_from_args(args)
    t0 = time.perf_counter()
    stats = _row_stats(args, config)
    plans = [plan_training(config, stats.table_rows, stats, s) for s in setups]
    if args.json:
        print(json.dumps({"stats": {"source": stats.source, "tokens": stats.tokens, "seconds": time.perf_counter() - t0},
                          "plans": [p.to_dict() for p in plans]}))  # fmt: skip
        return 0
    _print(plans, stats, args, config.head_dim)
    return 0


def _print(plans: list[TrainPlan], stats: RowStats, args: argparse.Namespace, dim: int) -> None:
    p0 = plans[0]
    rows = sum(p0.table_rows)
    print(f"{p0.config}: {len(p0.table_rows)} tables, {rows:,} rows x {dim}, "
          f"{args.param_dtype}; {args.tokens_per_step:,} tokens a step; link {args.link_gbps:g} GB/s a rank\n"
          f"rows measured on {stats.source} ({stats.tokens:,} tokens); memory of the fullest and busiest owner rank, GB "
          f"(1e9 B); exchange per step and rank, MB to other ranks\n")  # fmt: skip
    print(f"{'ranks':>6} {'owners':>6} {'optimizer':<10} {'rows':>7} {'state':>7} {'work':>7} {'staged':>7} "
          f"{'grads':>7} {'total':>7} | {'distinct':>9} {'served':>9} {'max':>9} {'sent':>8} {'recv':>8} "
          f"{'no-dedup':>8} {'ms':>7}")  # fmt: skip
    for p in plans:
        m, x = p.memory, p.exchange
        gb = [
            v / 1e9
            for v in (m.rows, m.optimizer_state, m.optimizer_work, m.staged_rows, m.gradients, m.total)
        ]
        und = sum(x.undeduped.values())
        print(f"{p.setup.ranks:>6} {p.setup.owners:>6} {p.setup.optimizer:<10} " + " ".join(f"{v:>7.2f}" for v in gb)
              + f" | {x.rows_requested:>9,.0f} {x.rows_served:>9,.0f} {x.rows_served_max:>9,.0f} "
              f"{x.sent_total / 1e6:>8.1f} {x.received_total / 1e6:>8.1f} {und / 1e6:>8.1f} {x.seconds * 1e3:>7.1f}")  # fmt: skip
    print("\nrows: the shard; state / work: the table optimizer's (Sinkhorn's fp32 workspace); staged: the batch's "
          "distinct rows;\ngrads: the block's, the rows received as owner, the shard's. distinct: rows a rank asks "
          "for; served: rows an owner\nserves (mean, max: the rows most batches hold load theirs); sent / recv: an "
          "owner rank's bytes; no-dedup: its lookups'\nbytes if repeats were sent too; ms: the four all-to-alls "
          "of the busiest owner at the link rate (latency not counted)")  # fmt: skip
    for note in dict.fromkeys(n for p in plans for n in p.notes):
        print(f"note: {note}")
