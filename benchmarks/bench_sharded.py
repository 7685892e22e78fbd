"""Row exchange of a sharded Engram table vs world size: `prefetch_tables` + `gather` + backward +
`sync_table_grads` on gloo (CPU), for world sizes 1, 2, ... in the same run.

    python benchmarks/bench_sharded.py [--worlds 1,2,4] [--rows 4194304] [--dim 32] [--tokens 4096]
                                       [--heads 8] [--repeats 10]

Each rank looks up `tokens` x `heads` Zipf-distributed row ids (so some repeat, as n-grams do) of
one table [rows, dim] fp32, sharded over the world; the global batch is `world` times one rank's.
Reported per world size: median seconds of one step's exchange on rank 0, rows per second (all
ranks' looked-up ids / seconds), and the ratio of that throughput to world size 1's (measured in
the same run; > 1: the exchange scales). Every rank uses one torch thread; ranks beyond the
machine's cores share them, which the numbers then show.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.distributed import ShardedTable, prefetch_tables, sync_table_grads


def _worker(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        table = ShardedTable(args.rows, args.dim, seed=0)
        gen = torch.Generator().manual_seed(rank)
        n = args.tokens * args.heads
        # Zipf-like ids: a power of a uniform variate, scattered over the table by a fixed odd multiplier
        sets = [
            ((torch.rand(n, generator=gen) ** 3 * args.rows).long() * 2654435761 % args.rows).view(
                args.tokens, args.heads
            )
            for _ in range(4)
        ]
        times = []
        for i in range(args.repeats + 2):
            rows = sets[i % len(sets)]
            dist.barrier()
            t0 = time.perf_counter()
            prefetch_tables([(table, rows)])
            table.gather(rows).sum().backward()
            sync_table_grads([table])
            dist.barrier()
            if i >= 2:  # 2 warm-up rounds
                times.append(time.perf_counter() - t0)
            table.weight.grad = None
        if rank == 0:
            Path(out).write_text(str(statistics.median(times)))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--rows", type=int, default=1 << 22)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(
        f"table {args.rows:,} x {args.dim} fp32; {args.tokens} tokens x {args.heads} heads per rank; gloo, "
        "1 thread per rank"
    )
    print(f"{'world':>5} {'s/step':>9} {'rows/s':>12} {'ratio':>6}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for w in worlds:
            out = Path(tmp) / f"w{w}.txt"
            mp.spawn(_worker, args=(w, str(Path(tmp) / f"init{w}"), str(out), args), nprocs=w)
            sec = float(out.read_text())
            rate = w * args.tokens * args.heads / sec
            base = base or rate
            print(f"{w:>5} {sec:>9.4f} {rate:>12,.0f} {rate / base:>6.2f}")


if __name__ == "__main__":
    main()
