"""Three levels, the SSD row file and the public gathers, each against its baseline measured in the same run.

- public gather (issue 10 part 8): the numba kernel into a given `out` (the bound), the same allocating
  its output (`lookup.dequantize_gather` without `out`: what `FP8Table.gather` did before its output
  pool), `FP8Table.gather` (pooled outputs), and `TieredTable` / `LevelTable` with every row cached (a
  100 % hit rate) against `FP8Table.gather`.
- pages per missed row (part 4): every distinct row of each batch read cold (no cache) from the row
  file (pages actually read, counted by `RowFile`) and, counted from the tensors' file offsets, from the
  same table as a safetensors file (values and scales in two tensors): per row alone, and distinct
  pages for the whole batch.
- three levels (part 3): `LevelTable(RowFile, device 1 %, host 5 % of the rows)` in steady state vs
  `FP8Table.gather` on the same ids (identical bytes checked first), with each level's hit rate; and one
  cold pass with the file's pages dropped from the page cache, buffered and O_DIRECT.

    python benchmarks/bench_levels.py [--rows 1048576] [--tokens 4096] [--batches 4] [--repeats 5] [--quick]

V4.1-like rows (dim 256, 264 bytes), 24 rows per token, Zipf(1.2) ids scattered over the table. On a
shared 2-core machine the timings are noisy: variants are interleaved round by round, best of
`repeats`; read the ratios. Temporary files go to `folder` (default: the system temp folder).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engram.benchmarks.bench_lookup import make_ids, make_table
from engram.benchmarks.timing import best_times, drop_pages
from engram.checkpoint.files import read_header, save_tensors
from engram.model.table import FP8Table
from engram.storage import lookup
from engram.storage.rowfile import RowFile, split_layout_pages, write_row_file
from engram.systems import Placement, TieredTable
from engram.systems.levels import LevelTable


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _safetensors_offsets(path: Path, names: tuple[str, str]) -> tuple[int, int]:
    """File offsets of two tensors' data, from the safetensors header."""
    n, header = read_header(path)
    return tuple(8 + n + header[name]["data_offsets"][0] for name in names)  # type: ignore[return-value]


def bench_public(table: FP8Table, batches: list[torch.Tensor], repeats: int) -> list[dict]:
    ids = batches[0]
    n = ids.numel()
    distinct = int(torch.unique(torch.cat([b.reshape(-1) for b in batches])).numel())
    out = torch.empty((*ids.shape, table.dim))
    tiered = TieredTable(table, Placement.HOST, cache_rows=distinct)
    levels = LevelTable(table, device_rows=distinct, host_rows=distinct)
    want = table.gather(ids)
    for b in batches:  # warm: every row of every batch cached
        tiered.gather(b)
        levels.gather(b)
    for name, t in (("TieredTable", tiered), ("LevelTable", levels)):
        if not torch.equal(_bits(t.gather(ids)), _bits(want)):
            raise AssertionError(f"{name}.gather disagrees with FP8Table.gather")
    tiered.reset_stats()
    best = best_times(
        {
            "kernel": lambda: lookup.dequantize_gather(table.weight, table.scale, ids, torch.float32, out),
            "allocating": lambda: lookup.dequantize_gather(table.weight, table.scale, ids, torch.float32),
            "fp8": lambda: table.gather(ids),
            "tiered": lambda: tiered.gather(ids),
            "levels": lambda: levels.gather(ids),
        },
        repeats,
    )
    hit = tiered.stats()["cache_hit_rate"]
    rows = [
        (
            "lookup.dequantize_gather allocating (before: FP8Table.gather had no output pool)",
            "allocating",
            "kernel",
        ),
        ("FP8Table.gather (output pool)", "fp8", "kernel"),
        (f"TieredTable(HOST), every row cached (hit rate {hit:.0%})", "tiered", "fp8"),
        ("LevelTable, every row in level 1", "levels", "fp8"),
    ]
    base_name = {"kernel": "numba kernel into a given out", "fp8": "FP8Table.gather"}
    return [
        {
            "op": f"public gather: {op}",
            "rows_per_s": n / best[key],
            "baseline": base_name[base],
            "baseline_rows_per_s": n / best[base],
            "slowdown": best[key] / best[base],  # time / baseline time: 1.0 = as fast
        }
        for op, key, base in rows
    ]


def bench_rowfile(
    table: FP8Table, batches: list[torch.Tensor], repeats: int, folder: str | None
) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        st_path = Path(tmp) / "table.safetensors"
        save_tensors(st_path, {"weight": table.weight, "scale": table.scale})
        value_off, scale_off = _safetensors_offsets(st_path, ("weight", "scale"))
        rf_path = write_row_file(Path(tmp) / "table.rows", table.weight, table.scale)
        rf = RowFile(rf_path)
        per_row_st = distinct_st = rows_total = 0
        for b in batches:  # every distinct row a miss: read cold, no cache
            uniq = np.unique(b.numpy())
            p, d = split_layout_pages(value_off, scale_off, table.dim, uniq)
            per_row_st, distinct_st, rows_total = per_row_st + p, distinct_st + d, rows_total + uniq.shape[0]
            rf.gather_bytes(torch.from_numpy(uniq))
        s = rf.stats()
        results.append(
            {
                "op": "pages per missed row: row file (read) vs safetensors (from offsets)",
                "rowfile_pages_per_row": s["pages_read"] / rows_total,
                "rowfile_pages_per_row_alone": rf.header.pages_per_group,  # no row crosses its page group
                "safetensors_pages_per_row": distinct_st / rows_total,
                "safetensors_pages_per_row_alone": per_row_st / rows_total,
                "rowfile_reads_per_row": s["reads"] / rows_total,
                "rows": rows_total,
            }
        )
        # three levels on the row file, steady state, vs FP8Table.gather on the same ids
        lt = LevelTable(rf, device_rows=max(1, table.num_rows // 100), host_rows=max(1, table.num_rows // 20))
        for b in batches:
            if not torch.equal(_bits(lt.gather(b)), _bits(table.gather(b))):
                raise AssertionError("LevelTable(RowFile) disagrees with FP8Table.gather")
        lt.reset_stats()

        def one_pass(fn: Callable[[torch.Tensor], object]) -> Callable[[], None]:
            def run_all() -> None:
                for b in batches:
                    fn(b)

            return run_all

        best = best_times({"levels": one_pass(lt.gather), "fp8": one_pass(table.gather)}, repeats)
        n = sum(b.numel() for b in batches)
        st = lt.stats()
        results.append(
            {
                "op": "three levels (device 1 %, host 5 %, row file), steady state",
                "rows_per_s": n / best["levels"],
                "baseline": "FP8Table.gather (whole table in DRAM)",
                "baseline_rows_per_s": n / best["fp8"],
                "slowdown": best["levels"] / best["fp8"],
                "device_hit_rate": st["device"]["hit_rate"],
                "host_hit_rate": st["host"]["hit_rate"],
                "backing_bytes_per_row": st["backing"]["bytes_in"] / max(1, st["rows_requested"]),
            }
        )
        # one cold pass from the storage device: buffered vs O_DIRECT positional reads
        cold = {}
        for direct, io_threads in ((False, 1), (True, 1), (True, 8)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f = RowFile(rf_path, direct=direct, io_threads=io_threads)
            drop_pages(rf_path)
            cold_lt = LevelTable(f, device_rows=lt.l1.capacity, host_rows=lt.l2.capacity)
            t0 = time.perf_counter()
            for b in batches:
                cold_lt.gather(b)
            label = ("direct" if f.direct else "buffered") + f", {io_threads} in flight"
            cold[label] = (time.perf_counter() - t0, f.stats())
            f.close()
        for label, (secs, fst) in cold.items():
            results.append(
                {
                    "op": f"three levels, first pass, row file pages dropped ({label} reads)",
                    "rows_per_s": n / secs,
                    "pages_per_row": fst["pages_per_row"],
                    "reads": fst["reads"],
                }
            )
        rf.close()
    return results


def run(
    rows: int = 1 << 20,
    dim: int = 256,
    tokens: int = 4096,
    per_token: int = 24,
    batches: int = 4,
    repeats: int = 5,
    zipf: float = 1.2,
    folder: str | None = None,
    seed: int = 0,
) -> list[dict]:
    table = make_table(rows, dim, seed)
    ids = [make_ids(rows, tokens, per_token, zipf, seed + i) for i in range(batches)]
    return bench_public(table, ids, repeats) + bench_rowfile(table, ids, repeats, folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", help="folder for the temporary files (default: the system temp folder)")
    ap.add_argument("--quick", action="store_true", help="256K rows, 1024 tokens, 3 repeats (seconds)")
    args = ap.parse_args()
    kw = dict(rows=args.rows, tokens=args.tokens, batches=args.batches, repeats=args.repeats)
    if args.quick:
        kw = dict(rows=1 << 18, tokens=1024, batches=4, repeats=3)
    for r in run(folder=args.dir, **kw):
        if "slowdown" in r:
            print(
                f"{r['op']:<80} {r['rows_per_s'] / 1e6:6.2f} M rows/s | {r['baseline']} "
                f"{r['baseline_rows_per_s'] / 1e6:6.2f} | time ratio {r['slowdown']:.2f}x"
            )
        elif "rowfile_pages_per_row" in r:
            print(
                f"{r['op']:<80} row file {r['rowfile_pages_per_row']:.2f} (alone "
                f"{r['rowfile_pages_per_row_alone']:.0f}) | safetensors {r['safetensors_pages_per_row']:.2f} "
                f"(alone {r['safetensors_pages_per_row_alone']:.2f}) | {r['rowfile_reads_per_row']:.2f} "
                f"preadv per row, {r['rows']} rows"
            )
        else:
            print(
                f"{r['op']:<80} {r['rows_per_s'] / 1e6:6.2f} M rows/s | {r['pages_per_row']:.2f} pages / row "
                f"read, {r['reads']} preadv calls"
            )


if __name__ == "__main__":
    main()
