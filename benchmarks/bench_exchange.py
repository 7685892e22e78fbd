"""The row exchange measured on the King James Bible through DeepSeek-V4.1's layout (issue 29 item 5).

W gloo ranks each hold 1/W of V4.1's two tables (384M rows each, the real row ranges) and run the
training step's exchange on consecutive Bible batches of --rank-tokens tokens: prefetch (counts, ids,
rows), backward, gradients to the owners. `engram.distributed.exchange_stats` counts every rank's rows
and bytes. The tables are --dim wide (1 by default: the rows and ids exchanged are V4.1's, the
values narrower so that the tables fit this machine); bytes are also given for V4.1's 256-wide fp32
rows (rows x 1024 B + ids). Printed per rank and step: lookups, distinct rows asked (all and of other
ranks), rows served and their distinct part, bytes to other ranks as sent against without removing
repeats (the ratio), and, with --row-stats, `engram plan train`'s prediction for the same setup.

    python benchmarks/bench_exchange.py --ranks 3 --rank-tokens 4096 --steps 4 --row-stats FILE
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

V41_ROW_BYTES = 256 * 4  # a V4.1 row in fp32


def worker(
    rank: int, world: int, init: str, out: str, rows: torch.Tensor, table_rows: list[int], dim: int
) -> None:
    import torch.distributed as dist

    from engram.distributed import ShardedTable, prefetch_tables, sync_table_grads
    from engram.distributed.exchange_stats import exchange_stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    exchange_stats().count_served_distinct = True
    tables = [ShardedTable(n, dim, dtype=torch.bfloat16, seed=i) for i, n in enumerate(table_rows)]
    steps = []
    rank_tokens = rows.shape[1]
    for step in range(rows.shape[0] // world):  # rows: (steps * world, rank_tokens, layers, heads)
        batch = rows[step * world + rank]  # (rank_tokens, layers, heads)
        before = exchange_stats().copy()
        t0 = time.perf_counter()
        prefetch_tables([(t, batch[:, i]) for i, t in enumerate(tables)])
        sum(t.gather(batch[:, i]).float().sum() for i, t in enumerate(tables)).backward()
        sync_table_grads(tables)
        seconds = time.perf_counter() - t0
        steps.append({"x": (exchange_stats() - before).to_dict(), "seconds": seconds, "tokens": rank_tokens})
    torch.save(steps, Path(out) / f"rank-{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--rank-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1)
    ap.add_argument("--row-stats", help="engram plan train's row statistics of V4.1 (for the prediction)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from engram.addressing.layout import Layout
    from engram.apps.lm.corpus import kjv_text
    from engram.cli.options import hasher_for
    from engram.config import EngramConfig

    config = EngramConfig.preset("deepseek-v4.1")
    hasher, tok = hasher_for(config)
    ids = np.array(tok.encode(kjv_text(), add_special_tokens=False).ids, dtype=np.int64)
    step_tokens = args.ranks * args.rank_tokens
    if ids.size < args.steps * step_tokens:
        raise SystemExit(
            f"the Bible's {ids.size:,} tokens are too few for {args.steps} steps of {step_tokens:,}"
        )
    # each step's global batch (consecutive tokens) at evenly spaced places of the Bible: the means are
    # the whole text's, as `engram plan train`'s row statistics are
    starts = np.linspace(0, ids.size - step_tokens, args.steps).astype(np.int64)
    ids = np.concatenate([ids[a : a + step_tokens] for a in starts])
    rows = torch.from_numpy(hasher.hash(ids)).reshape(
        args.steps * args.ranks, args.rank_tokens, config.n_layers, -1
    )
    table_rows = list(Layout(config).table_rows)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.ranks, f"{d}/init", d, rows, table_rows, args.dim), nprocs=args.ranks)
        ranks = [torch.load(Path(d) / f"rank-{r}.pt", weights_only=False) for r in range(args.ranks)]

    def mean(key, f=lambda v: v) -> list[float]:
        return [float(np.mean([f(s["x"][key]) for s in r])) for r in ranks]

    row_b = args.dim * 2
    res = {
        "ranks": args.ranks, "rank_tokens": args.rank_tokens, "steps": args.steps, "dim": args.dim,
        "lookups": mean("lookups"), "rows_requested": mean("rows_requested"),
        "rows_requested_remote": mean("rows_requested_remote"), "rows_served": mean("rows_served"),
        "rows_served_distinct": mean("rows_served_distinct"),
        "sent_remote_bytes": mean("sent_remote", lambda v: v["total"]),
        "received_remote_bytes": mean("received_remote", lambda v: v["total"]),
        "undeduped_remote_bytes": mean("undeduped_remote", lambda v: v["total"]),
    }  # fmt: skip

    def v41(key: str) -> list[float]:
        """Bytes of a rank's traffic with V4.1's 256-wide fp32 rows instead of --dim bf16 ones."""
        out = []
        for r in ranks:
            per = []
            for s in r:
                t = s["x"][key]
                rows_moved = (t["rows"] + t["grads"]) / row_b
                per.append(t["counts"] + t["ids"] + rows_moved * V41_ROW_BYTES)
            out.append(float(np.mean(per)))
        return out

    res["v41_sent_remote_bytes"] = v41("sent_remote")
    res["v41_received_remote_bytes"] = v41("received_remote")
    res["v41_undeduped_remote_bytes"] = v41("undeduped_remote")
    print(f"V4.1 layout, King James Bible: {args.ranks} ranks x {args.rank_tokens} tokens, {args.steps} steps spread "
          "over the text (means per step)")  # fmt: skip
    print(f"{'rank':>4} {'lookups':>9} {'distinct':>9} {'remote':>9} {'served':>9} {'distinct':>9} "
          f"{'sent MB':>8} {'recv MB':>8} {'no-dedup MB':>11} {'ratio':>6}")  # fmt: skip
    for r in range(args.ranks):
        sent, recv, und = (res[k][r] / 1e6 for k in ("v41_sent_remote_bytes", "v41_received_remote_bytes",
                                                      "v41_undeduped_remote_bytes"))  # fmt: skip
        print(f"{r:>4} {res['lookups'][r]:>9,.0f} {res['rows_requested'][r]:>9,.0f} "
              f"{res['rows_requested_remote'][r]:>9,.0f} {res['rows_served'][r]:>9,.0f} "
              f"{res['rows_served_distinct'][r]:>9,.0f} {sent:>8.1f} {recv:>8.1f} {und:>11.1f} {und / sent:>6.2f}")  # fmt: skip
    print("bytes for V4.1's 256-wide fp32 rows; ratio: without removing repeats / as sent")
    if args.row_stats:
        from engram.systems.row_stats import load_row_stats
        from engram.systems.train_plan import TrainSetup, plan_training

        stats = load_row_stats(args.row_stats)
        plan = plan_training(config, table_rows, stats, TrainSetup(args.ranks * args.rank_tokens, args.ranks))
        x = plan.exchange
        res["plan"] = plan.to_dict()
        print(f"plan: {x.lookups:,.0f} lookups, {x.rows_requested:,.0f} distinct, {x.rows_served:,.0f} served "
              f"(busiest {x.rows_served_max:,.0f}), {x.rows_served_distinct:,.0f} distinct served, sent "
              f"{x.sent_total / 1e6:.1f} MB, received {x.received_total / 1e6:.1f} MB, no-dedup "
              f"{sum(x.undeduped.values()) / 1e6:.1f} MB")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
