"""Lookup fast path: `lookup.dequantize_gather(..., backend="numba")` (the fused gather + ue8m0 dequantise
kernel of `engram.kernels.cpu_lookup`) on a table several times larger than the last-level cache, against
the baselines of `bench_lookup.py`, measured in the same run on the same ids:

- (a) the plain torch way: `F.embedding` of the fp8 value bytes and of the scale bytes, convert, multiply;
- (b) the raw byte gather of the same rows (`index_select` of the uint8 values and scales), as
  `bench_lookup.py` times it (allocating its outputs), and (b') the same into preallocated buffers;
- the torch backend of `dequantize_gather` (the reference twin), for the record.

    python benchmarks/bench_lookup_fast.py [--rows N] [--tokens 8192] [--per-token 24] [--repeats 5]

The fast path writes into a preallocated output (as a caller that reuses its buffer would); the line
"allocating" shows it with a fresh output per call (page faults on a 200 MB fp32 output cost more than
the gather on a VM), and "FP8Table.gather" the public table API, whose output pool
(`engram.storage.outpool`) reuses a buffer once the caller has let go of the previous result. Prints rows/s and GB/s of table bytes read (264 B a row) and the ratios
(baseline time / fast path time: > 1 means the fast path is faster). Baselines run with torch's default
intra-op threads; the fast path with 1 and with all cores. All are timed interleaved, round by round
(best of `repeats`), so that a shared machine's changing load hits them alike. Every variant is first
checked to be bit-identical to the torch backend.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from engram.benchmarks.bench_lookup import (
    default_rows,
    llc_bytes,
    make_ids,
    make_table,
    raw_gather,
    torch_reference,
)
from engram.benchmarks.timing import best_times
from engram.kernels.threads import available_cores
from engram.rowformat.fp8 import BLOCK, fp8_row_bytes
from engram.storage import lookup


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so NaNs compare equal to themselves."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def run(
    rows: int | None = None,
    dim: int = 256,
    tokens: int = 8192,
    per_token: int = 24,
    repeats: int = 5,
    zipf: float | None = 1.2,
    seed: int = 0,
) -> list[dict]:
    row_bytes = fp8_row_bytes(dim)
    llc = llc_bytes()
    rows = default_rows(row_bytes) if rows is None else rows
    table = make_table(rows, dim, seed)
    values, scales = table.weight, table.scale
    cores = available_cores()
    results = []
    cases = [("uniform", make_ids(rows, tokens, per_token, None, seed))]
    if zipf is not None:
        cases.append((f"zipf {zipf}", make_ids(rows, tokens, per_token, zipf, seed)))
    for dist, ids in cases:
        n = ids.numel()
        uniq = int(torch.unique(ids).numel())
        flat = ids.reshape(-1)
        raw_v = torch.empty((n, dim), dtype=torch.uint8)
        raw_s = torch.empty((n, dim // BLOCK), dtype=torch.uint8)

        def raw_into(
            flat: torch.Tensor = flat, raw_v: torch.Tensor = raw_v, raw_s: torch.Tensor = raw_s
        ) -> None:
            torch.index_select(values.view(torch.uint8), 0, flat, out=raw_v)
            torch.index_select(scales.view(torch.uint8), 0, flat, out=raw_s)

        for dtype in (torch.float32, torch.bfloat16):
            want = lookup.dequantize_gather(values, scales, ids, dtype, backend="torch")
            if not torch.equal(bits(torch_reference(table, ids, dtype)), bits(want)):
                raise AssertionError(f"the torch backend and the plain torch reference disagree ({dtype})")
            out = torch.empty_like(want)
            fns: dict[str, Callable[[], object]] = {
                "raw": lambda ids=ids: raw_gather(table, ids),
                "raw_into": raw_into,
                "ref": lambda ids=ids, dtype=dtype: torch_reference(table, ids, dtype),
                "twin": lambda ids=ids, dtype=dtype: lookup.dequantize_gather(
                    values, scales, ids, dtype, backend="torch"
                ),
            }
            labels = []
            for threads in sorted({1, cores}):
                label = f"{threads} thread{'s' if threads > 1 else ''}"
                fns[label] = lambda ids=ids, dtype=dtype, out=out, threads=threads: lookup.dequantize_gather(
                    values, scales, ids, dtype, out, backend="numba", threads=threads
                )
                labels.append(label)
            label = f"{cores} threads, allocating"
            fns[label] = lambda ids=ids, dtype=dtype: lookup.dequantize_gather(
                values, scales, ids, dtype, backend="numba"
            )
            labels.append(label)
            label = "FP8Table.gather (its output pool: no fresh pages)"
            fns[label] = lambda ids=ids, dtype=dtype: table.gather(ids, dtype)
            labels.append(label)
            for label in labels:
                got = fns[label]()
                assert isinstance(got, torch.Tensor)
                if not torch.equal(bits(got), bits(want)):
                    raise AssertionError(
                        f"the numba backend ({label}) and the torch backend disagree ({dtype})"
                    )
            best = best_times(fns, repeats)
            name = str(dtype).removeprefix("torch.")
            for label in labels:
                t = best[label]
                results.append(
                    {
                        "op": f"numba -> {name}, {dist} ({uniq / n:.0%} distinct), {label}",
                        "rows_per_s": n / t,
                        "gb_per_s": n * row_bytes / t / 1e9,
                        "baseline": "F.embedding + dequantise (torch)",
                        "baseline_rows_per_s": n / best["ref"],
                        "ratio": best["ref"] / t,
                        "ratio_vs_torch_backend": best["twin"] / t,
                        "raw_rows_per_s": n / best["raw"],
                        "ratio_vs_raw": best["raw"] / t,
                        "raw_into_rows_per_s": n / best["raw_into"],
                        "ratio_vs_raw_into": best["raw_into"] / t,
                        "table_mb": rows * row_bytes / 1e6,
                        "llc_mb": llc / 1e6,
                        "torch_threads": torch.get_num_threads(),
                    }
                )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, help="table rows (default: 4x the last-level cache, >= 2M)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--per-token", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--zipf", type=float, default=1.2, help="also time Zipfian ids with this exponent (0: off)"
    )
    args = ap.parse_args()
    results = run(args.rows, args.dim, args.tokens, args.per_token, args.repeats, args.zipf or None)
    r0 = results[0]
    print(
        f"table {r0['table_mb']:.0f} MB ({r0['table_mb'] / r0['llc_mb']:.1f}x the {r0['llc_mb']:.0f} MB LLC), "
        f"{args.tokens} tokens x {args.per_token} rows; baselines on {r0['torch_threads']} torch threads"
    )
    for r in results:
        print(
            f"{r['op']:<58} {r['rows_per_s'] / 1e6:6.2f} M rows/s {r['gb_per_s']:5.2f} GB/s | "
            f"vs torch ref ({r['baseline_rows_per_s'] / 1e6:5.2f}) {r['ratio']:5.2f}x | "
            f"vs torch backend {r['ratio_vs_torch_backend']:5.2f}x | "
            f"vs raw gather ({r['raw_rows_per_s'] / 1e6:5.2f}) {r['ratio_vs_raw']:4.2f}x, "
            f"into buffers ({r['raw_into_rows_per_s'] / 1e6:5.2f}) {r['ratio_vs_raw_into']:4.2f}x"
        )


if __name__ == "__main__":
    main()
