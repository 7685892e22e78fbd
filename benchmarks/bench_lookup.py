"""Lookup throughput: `FP8Table.gather` (gather + dequantise FP8 e4m3 rows with ue8m0 scales) on a table
several times larger than the last-level cache, against two baselines measured in the same run:

- (a) the plain torch way: `F.embedding` of the fp8 value bytes and of the scale bytes, convert both to
  float, multiply block by block, cast to the output dtype (no deduplication);
- (b) the raw byte gather of the same rows with no dequantisation at all (`index_select` of the uint8
  values and scales): the memory-bound floor any lookup pays.

    python benchmarks/bench_lookup.py [--rows N] [--tokens 8192] [--per-token 24] [--repeats 3] [--threads N]

Prints rows/s and GB/s of table bytes read (264 B a 256-wide row) of each, and the ratios
(baseline time / our time: > 1 means ours is faster). Every variant is checked against the reference
first (exactly equal). The default table holds 4x the last-level cache (at least 2M rows).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engram.benchmarks.timing import best_time, cuda_time
from engram.model.table import FP8Table
from engram.rowformat.fp8 import BLOCK, SCALE_DTYPE, VALUE_DTYPE, fp8_row_bytes


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 32 MiB if it cannot be read."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        best = max(best, int(text.rstrip("KMGkmg")) * mult)
    return best or 32 << 20


def available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_rows(row_bytes: int) -> int:
    """Table rows for a CPU run: 4x the last-level cache (at least 2M), leaving room for outputs."""
    rows = max(2_000_000, math.ceil(4 * llc_bytes() / row_bytes))
    return min(rows, available_bytes() // 3 // row_bytes)


def make_table(rows: int, dim: int, seed: int) -> FP8Table:
    """Random finite e4m3 bytes (|value| <= 448, NaN codes avoided) and scale bytes 2**-7 .. 2**7.

    A 64k-row random block is tiled over the table: byte content does not change a gather's cost.
    """
    g = torch.Generator().manual_seed(seed)
    block = min(rows, 1 << 16)
    v_blk = torch.randint(0, 0x7F, (block, dim), generator=g, dtype=torch.uint8)  # 0x7f is NaN
    v_blk |= torch.randint(0, 2, (block, dim), generator=g, dtype=torch.uint8) << 7  # sign
    s_blk = torch.randint(120, 135, (block, dim // BLOCK), generator=g, dtype=torch.uint8)
    values = torch.empty((rows, dim), dtype=torch.uint8)
    scales = torch.empty((rows, dim // BLOCK), dtype=torch.uint8)
    for start in range(0, rows, block):
        n = min(block, rows - start)
        values[start : start + n] = v_blk[:n]
        scales[start : start + n] = s_blk[:n]
    return FP8Table(values.view(VALUE_DTYPE), scales.view(SCALE_DTYPE))


def torch_reference(table: FP8Table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Baseline (a): the straightforward torch lookup + dequantise, (T, K) ids -> (T, K, D)."""
    v = F.embedding(ids, table.weight.view(torch.uint8))  # (T, K, D) uint8
    s = F.embedding(ids, table.scale.view(torch.uint8))  # (T, K, D // 32) uint8
    vf = v.view(VALUE_DTYPE).float()
    sf = s.view(SCALE_DTYPE).float()
    out = (vf.unflatten(-1, (-1, BLOCK)) * sf.unsqueeze(-1)).flatten(-2)
    return out.to(dtype)


def raw_gather(table: FP8Table, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline (b): the rows' bytes only, no dequantisation."""
    flat = ids.reshape(-1)
    return table.weight.view(torch.uint8).index_select(0, flat), table.scale.view(torch.uint8).index_select(
        0, flat
    )


def make_ids(rows: int, tokens: int, per_token: int, zipf: float | None, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if zipf is None:
        ids = rng.integers(0, rows, size=(tokens, per_token))
    else:  # Zipfian n-gram popularity, hot rows scattered over the table by an odd multiplier
        rank = rng.zipf(zipf, size=(tokens, per_token)).astype(np.int64) % rows
        ids = (rank * 2_654_435_761) % rows
    return torch.from_numpy(ids.astype(np.int64))


def run_cuda(
    rows: int = 16 << 20,
    dim: int = 256,
    tokens: int = 65536,
    per_token: int = 24,
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """The same comparison with the table resident on the GPU (the Triton gather on CUDA)."""
    row_bytes = fp8_row_bytes(dim)
    table = make_table(rows, dim, seed).cuda()
    ids = make_ids(rows, tokens, per_token, None, seed).cuda()
    n = ids.numel()
    results = []
    raw_t = cuda_time(lambda: raw_gather(table, ids), repeats)
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(table.gather(ids, dtype), torch_reference(table, ids, dtype)):
            raise AssertionError(f"FP8Table.gather and the torch reference disagree on CUDA ({dtype})")
        ours = cuda_time(lambda dtype=dtype: table.gather(ids, dtype), repeats)
        ref = cuda_time(lambda dtype=dtype: torch_reference(table, ids, dtype), repeats)
        # bytes moved: the rows read plus the dequantised rows written
        moved = n * (row_bytes + dim * (4 if dtype == torch.float32 else 2))
        results.append(
            {
                "op": f"CUDA FP8Table.gather -> {str(dtype).removeprefix('torch.')}, uniform ids",
                "rows_per_s": n / ours,
                "gb_per_s": moved / ours / 1e9,
                "baseline": "F.embedding + dequantise (torch, CUDA)",
                "baseline_rows_per_s": n / ref,
                "ratio": ref / ours,
                "raw_rows_per_s": n / raw_t,
                "raw_gb_per_s": n * row_bytes / raw_t / 1e9,
                "ratio_vs_raw": raw_t / ours,
                "table_mb": rows * row_bytes / 1e6,
                "llc_mb": 0.0,
                "threads": 0,
                "device": torch.cuda.get_device_name(),
            }
        )
    return results


def run(
    rows: int | None = None,
    dim: int = 256,
    tokens: int = 8192,
    per_token: int = 24,
    repeats: int = 3,
    zipf: float | None = 1.2,
    seed: int = 0,
) -> list[dict]:
    row_bytes = fp8_row_bytes(dim)
    llc = llc_bytes()
    rows = default_rows(row_bytes) if rows is None else rows
    table = make_table(rows, dim, seed)
    table_mb = rows * row_bytes / 1e6
    results = []
    cases = [("uniform", make_ids(rows, tokens, per_token, None, seed))]
    if zipf is not None:
        cases.append((f"zipf {zipf}", make_ids(rows, tokens, per_token, zipf, seed)))
    for dist, ids in cases:
        n = ids.numel()
        uniq = int(torch.unique(ids).numel())
        raw_t = best_time(lambda ids=ids: raw_gather(table, ids), repeats)
        for dtype in (torch.float32, torch.bfloat16):
            if not torch.equal(table.gather(ids, dtype), torch_reference(table, ids, dtype)):
                raise AssertionError(f"FP8Table.gather and the torch reference disagree ({dtype})")
            ours = best_time(lambda ids=ids, dtype=dtype: table.gather(ids, dtype), repeats)
            ref = best_time(lambda ids=ids, dtype=dtype: torch_reference(table, ids, dtype), repeats)
            name = str(dtype).removeprefix("torch.")
            results.append(
                {
                    "op": f"FP8Table.gather -> {name}, {dist} ids ({uniq / n:.0%} distinct)",
                    "rows_per_s": n / ours,
                    "gb_per_s": n * row_bytes / ours / 1e9,
                    "baseline": "F.embedding + dequantise (torch)",
                    "baseline_rows_per_s": n / ref,
                    "ratio": ref / ours,
                    "raw_rows_per_s": n / raw_t,
                    "raw_gb_per_s": n * row_bytes / raw_t / 1e9,
                    "ratio_vs_raw": raw_t / ours,
                    "table_mb": table_mb,
                    "llc_mb": llc / 1e6,
                    "threads": torch.get_num_threads(),
                    "device": "cpu",
                }
            )
    if torch.cuda.is_available():
        results += run_cuda(dim=dim, repeats=max(repeats, 5), seed=seed)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, help="table rows (default: 4x the last-level cache, >= 2M)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--per-token", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--zipf", type=float, default=1.2, help="also time Zipfian ids with this exponent (0: off)"
    )
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args.rows, args.dim, args.tokens, args.per_token, args.repeats, args.zipf or None)
    r0 = results[0]
    print(
        f"table {r0['table_mb']:.0f} MB "
        f"({r0['table_mb'] / r0['llc_mb']:.1f}x the {r0['llc_mb']:.0f} MB LLC), "
        f"{args.tokens} tokens x {args.per_token} rows, {r0['threads']} threads"
    )
    for r in results:
        print(
            f"{r['op']:<58} {r['rows_per_s'] / 1e6:7.2f} M rows/s {r['gb_per_s']:6.2f} GB/s | "
            f"torch ref {r['baseline_rows_per_s'] / 1e6:6.2f} M rows/s, ratio {r['ratio']:.2f}x | "
            f"raw gather {r['raw_rows_per_s'] / 1e6:6.2f} M rows/s {r['raw_gb_per_s']:5.2f} GB/s, "
            f"ratio {r['ratio_vs_raw']:.2f}x"
        )


if __name__ == "__main__":
    main()
