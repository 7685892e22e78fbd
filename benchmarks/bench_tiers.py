"""Storage tiers: `engram.systems.TieredTable` gathers from host DRAM and from SSD, with a hot-row cache
and with prefetch, against the plain tables measured in the same run on the same row ids.

V4.1-like rows: dim 256 (264 bytes a row with scales), 24 rows per token, Zipf(1.2) row ids scattered
over the table, batches of `tokens` tokens.

- host: `TieredTable(FP8Table, HOST, cache_rows=0 / 1 / 5 / 20 % of the rows)` vs `FP8Table.gather`
  (the table in DRAM, dequantised in place); steady state: the cache is warmed by one pass over the
  batches, then passes are timed. Reports the cache hit rate and bytes fetched per row asked.
- ssd: the table written to a temporary safetensors file (deleted afterwards), its pages dropped
  from the page cache (posix_fadvise DONTNEED) before each timed pass, so reads hit the device:
  `TieredTable(MmapFP8Table, SSD)` with and without a cache vs `MmapFP8Table.gather`.
- CUDA (`run_cuda`, in `benchmarks/gpu_check.py`): the table in host DRAM and the rows needed on the
  GPU, `TieredTable(HOST)` with and without a device cache against a host gather + copy, and the
  overlap loop with a GPU matmul.
- overlap: a loop of compute (a fixed matmul, torch on one thread) + gather of the next batch's rows:
  synchronous vs prefetched one batch ahead (`prefetch` on the background thread: the FP8 bytes
  only, or `prefetch(rows, torch.float32)`: bytes and dequantisation). Reports the ratio of loop
  times and the ideal ratio (compute + gather) / max(compute, gather), each measured alone; and, the
  fair measure of overlap, a prefetched step once the pipeline is full (steps 2..k) against
  max(compute, gather) (1.0: the fetch hides entirely behind the compute, or the compute behind it).
  Compute runs on one torch thread, the fetch (and dequantisation) on the worker's one thread. The
  controls time each half while the other runs non-stop on another thread: two hardware threads of
  one core (or one memory bus) slow both, which no pipeline can hide, so the step is also reported
  against the longer half *as measured side by side* (1.0: the pipeline adds nothing to that).

    python benchmarks/bench_tiers.py [--rows 4000000] [--tokens 4096] [--batches 8] [--repeats 3] [--quick]

On a CPU the "device" is the CPU itself, so this measures the host side of the tiers (dedup, cache
index, byte gather, dequantisation); the PCIe copy of a CUDA device is not in these numbers. Timings
are best of `repeats`, variants interleaved round by round; on a shared 2-core machine they are
noisy: read the ratios. Every variant is first checked to be bit-identical to the plain gather.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engram.benchmarks.bench_lookup import make_ids, make_table
from engram.benchmarks.timing import drop_pages
from engram.checkpoint.files import save_tensors
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.table import FP8Table
from engram.rowformat.fp8 import fp8_row_bytes
from engram.storage import lookup
from engram.systems import Placement, TieredTable


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _pass_time(fn: Callable[[torch.Tensor], object], batches: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    return time.perf_counter() - t0


def _best(
    fns: dict[str, Callable[[], float]], repeats: int, before: Callable[[], None] | None = None
) -> dict:
    """Best of `repeats` of each timed function (each returns its own seconds), interleaved round by round."""
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            best[name] = min(best[name], fn())
    return best


def _check(table: TieredTable, ref: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> None:
    if not torch.equal(_bits(table.gather(ids)), _bits(ref(ids))):
        raise AssertionError(f"{table!r} disagrees with the plain gather")


def bench_host(
    table: FP8Table, batches: list[torch.Tensor], fractions: list[float], repeats: int
) -> list[dict]:
    n_rows = sum(b.numel() for b in batches)
    row_bytes = fp8_row_bytes(table.dim)
    tiered = {f: TieredTable(table, Placement.HOST, cache_rows=int(f * table.num_rows)) for f in fractions}
    for t in tiered.values():
        _check(t, table.gather, batches[0])
        _pass_time(t.gather, batches)  # warm the cache (and compile the kernels)
        t.reset_stats()
    _pass_time(table.gather, batches)
    fns: dict[str, Callable[[], float]] = {"plain": lambda: _pass_time(table.gather, batches)}
    for f, t in tiered.items():
        fns[str(f)] = lambda t=t: _pass_time(t.gather, batches)
    best = _best(fns, repeats)
    out = []
    for f, t in tiered.items():
        s = t.stats()
        hit = s.get("cache_hit_rate", 0.0)
        out.append(
            {
                "op": f"tiers: host, cache {f:.0%} of rows (hit rate {hit:.0%})",
                "rows_per_s": n_rows / best[str(f)],
                "baseline": "FP8Table.gather (host)",
                "baseline_rows_per_s": n_rows / best["plain"],
                "ratio": best["plain"] / best[str(f)],
                "cache_fraction": f,
                "hit_rate": hit,
                "distinct_fraction": s["rows_distinct"] / s["rows_requested"],
                "fetched_bytes_per_row": s["bytes_fetched"] / s["rows_requested"],
                "row_bytes": row_bytes,
            }
        )
    return out


def bench_ssd(
    table: FP8Table, batches: list[torch.Tensor], fraction: float, repeats: int, folder: str | None
) -> list[dict]:
    n_rows = sum(b.numel() for b in batches)
    with tempfile.TemporaryDirectory(dir=folder, prefix="engram-bench-tiers-") as tmp:
        path = Path(tmp) / "table.safetensors"
        save_tensors(path, {"w": table.weight, "s": table.scale})
        mm = MmapFP8Table(path, "w", "s")
        variants = {
            "ssd": lambda: TieredTable(mm, Placement.SSD),
            "ssd_cache": lambda: TieredTable(mm, Placement.SSD, cache_rows=int(fraction * table.num_rows)),
        }
        _check(variants["ssd_cache"](), table.gather, batches[0])
        stats: dict[str, dict] = {}

        def cold(make: Callable[[], TieredTable], key: str) -> float:
            t = make()  # a cold cache too: the whole pass is the first contact with these rows
            seconds = _pass_time(t.gather, batches)
            stats[key] = t.stats()
            return seconds

        fns: dict[str, Callable[[], float]] = {"plain": lambda: _pass_time(mm.gather, batches)}
        for key, make in variants.items():
            fns[key] = lambda make=make, key=key: cold(make, key)
        best = _best(fns, repeats, before=lambda: drop_pages(path))
        size = path.stat().st_size
    out = []
    for key, label in (("ssd", "no cache"), ("ssd_cache", f"cache {fraction:.0%} of rows")):
        s = stats[key]
        out.append(
            {
                "op": f"tiers: ssd (cold pages), {label} (hit rate {s.get('cache_hit_rate', 0.0):.0%})",
                "rows_per_s": n_rows / best[key],
                "baseline": "MmapFP8Table.gather (cold pages)",
                "baseline_rows_per_s": n_rows / best["plain"],
                "ratio": best["plain"] / best[key],
                "file_mb": size / 1e6,
                "fetched_bytes_per_row": s["bytes_fetched"] / s["rows_requested"],
            }
        )
    return out


def bench_overlap(table: FP8Table, batches: list[torch.Tensor], fraction: float, repeats: int) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # compute on one core; the fetch thread gets the other
    try:
        t = TieredTable(table, Placement.HOST, cache_rows=int(fraction * table.num_rows), fetch_threads=1)
        _pass_time(t.gather, batches)  # warm the cache
        gather_alone = min(_pass_time(t.gather, batches) for _ in range(2)) / len(batches)
        # size the matmul so that one compute step takes about as long as one gather
        n = 256
        a = torch.randn(n, n)
        while True:
            a @ a  # warm-up: the first product of a size pays one-off costs
            t0 = time.perf_counter()
            a @ a
            step = time.perf_counter() - t0
            if step > gather_alone / 4 or n >= 4096:
                break
            n *= 2
            a = torch.randn(n, n)
        reps = max(1, round(gather_alone / step))

        def compute() -> None:
            for _ in range(reps):
                a @ a

        compute_alone = min(_pass_time(lambda _b: compute(), batches) for _ in range(2)) / len(batches)
        # control: the compute while another thread gathers non-stop (GIL released). 1.0 = a second core
        # is free; ~2 = the machine has none to give (a loaded shared machine), so nothing can overlap
        stop = threading.Event()
        out = torch.empty((*batches[0].shape, table.dim))

        def busy() -> None:
            while not stop.is_set():
                lookup.dequantize_gather(table.weight, table.scale, batches[0], torch.float32, out, threads=1)

        worker = threading.Thread(target=busy, daemon=True)
        worker.start()
        try:
            compute_busy = min(_pass_time(lambda _b: compute(), batches) for _ in range(2)) / len(batches)
        finally:
            stop.set()
            worker.join()
        # the other half of the control: the gather while another thread computes non-stop. Two hardware
        # threads of one core, or one memory bus, slow the gather beside a matmul even with a "free" core
        stop = threading.Event()

        def computing() -> None:
            while not stop.is_set():
                a @ a

        worker = threading.Thread(target=computing, daemon=True)
        worker.start()
        try:
            gather_busy = min(_pass_time(t.gather, batches) for _ in range(2)) / len(batches)
        finally:
            stop.set()
            worker.join()

        def sync_loop() -> float:
            t0 = time.perf_counter()
            for b in batches:
                compute()
                t.gather(b)
            return time.perf_counter() - t0

        steady: dict[object, float] = {}  # best seconds per step after the first (the pipeline is full)

        def prefetch_loop(dtype: torch.dtype | None) -> float:
            t0 = time.perf_counter()
            t.prefetch(batches[0], dtype)
            for i, b in enumerate(batches):
                if i + 1 < len(batches):
                    t.prefetch(batches[i + 1], dtype)  # fetched on the worker while this step computes
                compute()
                t.gather(b)
                if i == 0:
                    t1 = time.perf_counter()
            end = time.perf_counter()
            per_step = (end - t1) / max(1, len(batches) - 1)
            steady[dtype] = min(steady.get(dtype, math.inf), per_step)
            return end - t0

        for dtype in (None, torch.float32):  # both bit-identical to the synchronous gather
            t.prefetch(batches[0], dtype)
            if not torch.equal(_bits(t.gather(batches[0])), _bits(table.gather(batches[0]))):
                raise AssertionError("a prefetched gather disagrees with FP8Table.gather")
        t.reset_stats()
        best = _best(
            {
                "sync": sync_loop,
                "prefetch": lambda: prefetch_loop(None),
                "prefetch_dq": lambda: prefetch_loop(torch.float32),
            },
            repeats,
        )
        s = t.stats()
    finally:
        torch.set_num_threads(threads)
    k = len(batches)
    ideal = (compute_alone + gather_alone) / max(compute_alone, gather_alone)
    return [
        {
            "op": f"tiers: overlap, compute + gather, prefetch 1 ahead{label} (cache {fraction:.0%})",
            "seconds": best[key] / k,
            "baseline": "the same loop, synchronous gathers",
            "baseline_seconds": best["sync"] / k,
            "ratio": best["sync"] / best[key],
            "ideal_ratio": ideal,
            # the fair measure: the prefetched loop against the longer of its two halves (1.0 = full overlap)
            "vs_bound": steady[dtype] / max(compute_alone, gather_alone),
            # the same against the halves as they run side by side on this machine (1.0 = the pipeline
            # adds nothing to what the hardware allows two concurrent threads)
            "vs_concurrent_bound": steady[dtype] / max(compute_busy, gather_busy),
            "compute_slowdown_beside_a_gather": compute_busy / compute_alone,
            "gather_slowdown_beside_compute": gather_busy / gather_alone,
            "compute_ms": compute_alone * 1e3,
            "gather_ms": gather_alone * 1e3,
            "prefetch_hits": s["prefetch_hits"],
            "wait_ms_per_step": s["wait_seconds"] / max(1, s["prefetch_hits"]) * 1e3,
        }
        for key, label, dtype in (
            ("prefetch", " (bytes)", None),
            ("prefetch_dq", " + dequantise", torch.float32),
        )
    ]


def run_cuda(
    rows: int = 8_000_000,
    dim: int = 256,
    tokens: int = 16384,
    per_token: int = 24,
    batches: int = 8,
    repeats: int = 3,
    zipf: float = 1.2,
    fraction: float = 0.05,
    seed: int = 0,
    device: str = "cuda",
    matmul: int = 4096,
) -> list[dict]:
    """The tiers with a CUDA compute device: the table in host DRAM, rows needed on the GPU.

    Baseline (same run): `FP8Table.gather` on the host, then one copy of the dequantised bf16 rows to
    the device (what a table without tiers does). Ours: `TieredTable(HOST)` (distinct FP8 rows cross
    PCIe, dequantised on the device) without and with a device cache, then the overlap loop of a GPU
    matmul + gather, synchronous vs prefetched one batch ahead. (`device="cpu"` runs the same code on
    the CPU: a smoke test of this function, not a measurement.)
    """
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    table = make_table(rows, dim, seed)
    host_ids = [make_ids(rows, tokens, per_token, zipf, seed + i) for i in range(batches)]
    n_rows = sum(b.numel() for b in host_ids)
    bf16 = torch.bfloat16

    def timed(fn: Callable[[torch.Tensor], object]) -> Callable[[], float]:
        def one_pass() -> float:
            sync()
            t0 = time.perf_counter()
            for b in host_ids:
                fn(b)
            sync()
            return time.perf_counter() - t0

        return one_pass

    def baseline(b: torch.Tensor) -> torch.Tensor:
        return table.gather(b, bf16).to(dev)

    tiered = {
        "none": TieredTable(table, Placement.HOST, device=dev),
        "cache": TieredTable(table, Placement.HOST, device=dev, cache_rows=int(fraction * rows)),
    }
    for t in tiered.values():
        if not torch.equal(t.gather(host_ids[0], bf16), baseline(host_ids[0])):
            raise AssertionError(f"{t!r} on CUDA disagrees with the host gather")
        timed(lambda b, t=t: t.gather(b, bf16))()  # warm: kernels, staging buffers, the cache
        t.reset_stats()
    fns = {"plain": timed(baseline)} | {k: timed(lambda b, t=t: t.gather(b, bf16)) for k, t in tiered.items()}
    best = _best(fns, repeats)
    out = []
    for key, label in (("none", "no cache"), ("cache", f"cache {fraction:.0%} of rows")):
        st = tiered[key].stats()
        out.append(
            {
                "op": f"tiers CUDA: host table -> GPU, {label} (hit rate {st.get('cache_hit_rate', 0.0):.0%})",
                "rows_per_s": n_rows / best[key],
                "baseline": "host FP8Table.gather + copy of bf16 rows",
                "baseline_rows_per_s": n_rows / best["plain"],
                "ratio": best["plain"] / best[key],
                "fetched_bytes_per_row": st["bytes_fetched"] / max(1, st["rows_requested"]),
            }
        )

    # overlap: a GPU matmul about as long as one gather, then the gather; prefetch one batch ahead
    t = tiered["cache"]
    gather_alone = timed(lambda b: t.gather(b, bf16))() / batches
    a = torch.randn(matmul, matmul, device=dev, dtype=bf16)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    sync()
    reps = max(1, round(gather_alone / ((time.perf_counter() - t0) / 10)))

    def sync_loop() -> float:
        sync()
        t0 = time.perf_counter()
        for b in host_ids:
            for _ in range(reps):
                a @ a
            t.gather(b, bf16)
        sync()
        return time.perf_counter() - t0

    def prefetch_loop() -> float:
        sync()
        t0 = time.perf_counter()
        t.prefetch(host_ids[0])
        for i, b in enumerate(host_ids):
            if i + 1 < batches:
                t.prefetch(host_ids[i + 1])
            for _ in range(reps):
                a @ a
            t.gather(b, bf16)
        sync()
        return time.perf_counter() - t0

    best = _best({"sync": sync_loop, "prefetch": prefetch_loop}, repeats)
    out.append(
        {
            "op": f"tiers CUDA: overlap, GPU matmul + gather, prefetch 1 ahead (cache {fraction:.0%})",
            "seconds": best["prefetch"] / batches,
            "baseline": "the same loop, synchronous gathers",
            "baseline_seconds": best["sync"] / batches,
            "ratio": best["sync"] / best["prefetch"],
            "gather_ms": gather_alone * 1e3,
        }
    )
    for r in out:
        r.update(table_mb=rows * fp8_row_bytes(dim) / 1e6, tokens=tokens, per_token=per_token)
    return out


def run(
    rows: int = 4_000_000,
    dim: int = 256,
    tokens: int = 4096,
    per_token: int = 24,
    batches: int = 8,
    repeats: int = 3,
    zipf: float = 1.2,
    fractions: tuple[float, ...] = (0.0, 0.01, 0.05, 0.2),
    ssd: bool = True,
    folder: str | None = None,
    seed: int = 0,
) -> list[dict]:
    table = make_table(rows, dim, seed)
    ids = [make_ids(rows, tokens, per_token, zipf, seed + i) for i in range(batches)]
    results = bench_host(table, ids, list(fractions), repeats)
    if ssd:
        results += bench_ssd(table, ids, 0.05, repeats, folder)
    results += bench_overlap(table, ids, 0.05, repeats)
    for r in results:
        r.update(table_mb=rows * fp8_row_bytes(dim) / 1e6, tokens=tokens, per_token=per_token)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000, help="table rows (4M x 264 B = 1.06 GB)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--per-token", type=int, default=24)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--no-ssd", action="store_true", help="skip the SSD tier (writes a table-sized file)")
    ap.add_argument("--dir", help="folder for the temporary SSD file (default: the system temp folder)")
    ap.add_argument("--quick", action="store_true", help="256K rows, 1024 tokens, 4 batches (seconds)")
    args = ap.parse_args()
    kw = dict(rows=args.rows, tokens=args.tokens, batches=args.batches, repeats=args.repeats)
    if args.quick:
        kw = dict(rows=1 << 18, tokens=1024, batches=4, repeats=2)
    results = run(
        dim=args.dim, per_token=args.per_token, zipf=args.zipf, ssd=not args.no_ssd, folder=args.dir, **kw
    )
    r0 = results[0]
    print(
        f"table {r0['table_mb']:.0f} MB, batches of {r0['tokens']} tokens x {r0['per_token']} rows, Zipf ids"
    )
    for r in results:
        if "rows_per_s" in r:
            print(
                f"{r['op']:<66} {r['rows_per_s'] / 1e6:6.2f} M rows/s | {r['baseline']} "
                f"{r['baseline_rows_per_s'] / 1e6:6.2f} M rows/s | ratio {r['ratio']:.2f}x | "
                f"{r['fetched_bytes_per_row']:.1f} B fetched / row asked"
            )
        else:
            print(
                f"{r['op']:<66} {r['seconds'] * 1e3:7.1f} ms/step vs sync {r['baseline_seconds'] * 1e3:7.1f} | "
                f"ratio {r['ratio']:.2f}x (ideal {r['ideal_ratio']:.2f}x) | loop / max(compute, gather) "
                f"{r['vs_bound']:.2f}, / max of the two side by side {r['vs_concurrent_bound']:.2f} "
                f"(compute {r['compute_ms']:.1f} ms, {r['compute_slowdown_beside_a_gather']:.2f}x slower beside a "
                f"gather thread; gather {r['gather_ms']:.1f} ms, {r['gather_slowdown_beside_compute']:.2f}x slower "
                f"beside compute; waited {r['wait_ms_per_step']:.1f} ms/step)"
            )


if __name__ == "__main__":
    main()
