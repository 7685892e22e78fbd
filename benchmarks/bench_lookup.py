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
`run_cuda` is the GPU half (`gpu_check.py` calls it): the Triton gather as a fraction of a device
copy measured in the same run, fp32 and bf16, uniform and Zipf ids, with and without dedup.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engram.benchmarks.timing import best_time
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


def _event_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None], cuda: bool) -> float:
    """Best seconds of fn() over `repeats` calls after a warm-up: CUDA events on a GPU, else a timer."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


# (rows per program, warps, GPU e4m3 conversion) tried by the sweep of run_cuda
SWEEP = [(8, 4, True), (16, 4, True), (16, 8, True), (32, 8, True), (64, 8, True), (16, 4, False)]


class _Gathers:
    """The kernel's variants on one table and one set of ids, each checked exactly, then timed."""

    def __init__(self, table: FP8Table, ids: torch.Tensor, repeats: int, cuda: bool) -> None:
        self.table, self.ids, self.flat = table, ids, ids.reshape(-1)
        self.repeats, self.cuda = repeats, cuda
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def time(self, fn: Callable[[], object]) -> float:
        return _event_time(fn, self.repeats, self.sync, self.cuda)

    def kernel(self, dtype: torch.dtype, want: torch.Tensor, what: str, **kw: object) -> float:
        """Seconds of `kernels.fp8_gather` with `kw`; `sort=True` times `dedup_order` in the call."""
        from engram import kernels

        t = self.table
        out = torch.empty_like(want)
        sort = kw.pop("sort", False)

        def fn() -> object:
            order = kernels.dedup_order(self.flat) if sort else kw.get("order")
            rest = {k: v for k, v in kw.items() if k != "order"}
            return kernels.fp8_gather(
                t.weight, t.scale, self.flat, dtype, out.view(-1, t.dim), order=order, **rest
            )

        fn()
        if not torch.equal(out, want):
            raise AssertionError(f"fp8_gather ({what}) disagrees with the torch reference")
        return self.time(fn)


def run_cuda(
    rows: int = 16 << 20,
    dim: int = 256,
    tokens: int = 65536,
    per_token: int = 24,
    repeats: int = 10,
    seed: int = 0,
    zipf: float = 1.2,
    device: str = "cuda",
    sweep: bool = True,
) -> list[dict]:
    """The FP8 gather with the table resident on the GPU (the Triton kernel), as a fraction of the
    device-to-device copy bandwidth measured in the same run: output float32 and bfloat16, uniform and
    Zipf ids, without dedup, with the dedup order precomputed (the ids sorted when they were hashed,
    as a prefetch planner would) and with the sort timed too (`dedup_order` + gather). Bytes moved per
    row: the 264 B read (256 fp8 values + 8 scale bytes) plus the row written (1024 B fp32, 512 B
    bf16): the traffic a copy of the same bytes would need. `FP8Table.gather` (the public path: the id
    range check, one sync, plus the kernel) against `F.embedding` + dequantise gives the ratio. The
    sweep times the kernel's (rows per program, warps, e4m3 decode) choices on uniform ids and reports
    the best. Every variant is checked exactly against the torch reference first. `device="cpu"` (a
    test, the kernel interpreted) runs the same code on small sizes."""
    from engram import kernels
    from engram.apps.tools.bench import device_copy_gb_per_s

    cuda = torch.device(device).type == "cuda"
    copy = device_copy_gb_per_s() if cuda else None
    row_bytes = fp8_row_bytes(dim)
    host = make_table(rows, dim, seed)
    table = FP8Table(host.weight.to(device), host.scale.to(device))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    results = []

    def row(op: str, n: int, dtype: torch.dtype, seconds: float, **extra: object) -> dict:
        gbs = n * (row_bytes + dim * (4 if dtype == torch.float32 else 2)) / seconds / 1e9
        pct = f": {gbs / copy:.0%} of copy" if copy else ""
        frac = None if copy is None else gbs / copy
        return {"op": f"{op}{pct}", "rows_per_s": n / seconds, "gb_per_s": gbs, "copy_gb_per_s": copy,
                "fraction_of_copy": frac, "device": name, **extra}  # fmt: skip

    for dist in ("uniform", f"zipf {zipf}"):
        ids = make_ids(rows, tokens, per_token, None if dist == "uniform" else zipf, seed).to(device)
        g = _Gathers(table, ids, repeats, cuda)
        n = ids.numel()
        order = kernels.dedup_order(g.flat)
        label = f"{dist.split()[0]} ({int(torch.unique(g.flat).numel()) / n:.0%} distinct)"
        for dtype in (torch.float32, torch.bfloat16):
            dn = "fp32" if dtype == torch.float32 else "bf16"
            want = torch_reference(table, ids, dtype)
            for variant, kw in (
                ("no dedup", {}),
                ("dedup", {"order": order}),
                ("dedup+sort", {"sort": True}),
            ):
                t = g.kernel(dtype, want, f"{variant}, {dn}, {dist}", **kw)
                results.append(row(f"CUDA fp8_gather->{dn} {label} {variant}", n, dtype, t))
            if dist != "uniform":
                continue
            if not torch.equal(table.gather(ids, dtype), want):  # the public path against the plain torch one
                raise AssertionError(f"FP8Table.gather and the torch reference disagree ({dtype})")
            ours = g.time(functools.partial(table.gather, ids, dtype))
            ref = g.time(functools.partial(torch_reference, table, ids, dtype))
            results.append(
                row(f"CUDA FP8Table.gather->{dn} uniform, id check+kernel", n, dtype, ours,
                    baseline="F.embedding + dequantise (torch, CUDA)", baseline_rows_per_s=n / ref, ratio=ref / ours)
            )  # fmt: skip
            if not sweep:
                continue
            timed = []
            for bn, warps, hw in SWEEP if cuda else SWEEP[:2]:
                kw = {"block_n": bn, "num_warps": warps, "hw_convert": hw and cuda}
                timed.append((g.kernel(dtype, want, f"sweep {kw}", **kw), bn, warps, hw and cuda))
            t, bn, warps, hw = min(timed)
            results.append(
                row(f"CUDA fp8_gather->{dn} uniform, sweep best {bn}x{warps}w hw={int(hw)}", n, dtype, t,
                    block_n=bn, num_warps=warps, hw_convert=hw, sweep=[(b, w, h, n / s) for s, b, w, h in timed])
            )  # fmt: skip
            del want
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
        results += run_cuda(dim=dim, repeats=max(repeats, 5), seed=seed, sweep=False)
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
