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
- CUDA (`run_cuda`, in `benchmarks/gpu_check.py`): the pinned host -> device copy bandwidth and the UVA
  gather as a fraction of it; the table in host DRAM, rows needed on the GPU: no cache (staged, UVA) and
  a device-indexed cache at 100 % / Zipf / 0 % hits (UVA or staged fills) against the table without a
  cache; a prefetched loop against max(compute, fetch) of a GPU matmul, all timed in the same run.
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


def pinned_copy_gb_per_s(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bandwidth (GB/s) of one non_blocking copy of `nbytes` from pinned host memory to `device`, best of
    `repeats` (CUDA events): the bus's practical peak that reads over UVA are measured against."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


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
    """The tiers with a CUDA compute device, each row against a baseline measured in the same run:

    1. bandwidth: a pinned host -> device copy (the bus's peak), and the FP8 gather kernel reading the
       rows of a pinned table in place over UVA (bytes of rows read per second, as a fraction of the
       copy; uniform ids, then Zipf ids);
    2. the table in host memory, rows needed on the GPU: no cache (staged through pinned memory, vs a
       host FP8Table.gather + copy of bf16 rows; UVA), then a device-indexed cache of `fraction` of the
       rows at 100 % hits (a hot set an eighth of the cache), Zipf ids (mixed) and 0 % hits (distinct
       never-seen rows, the cache emptied before each pass), filled over UVA or staged, each vs the UVA
       table without a cache on the same ids;
    3. overlap: steps of a GPU matmul then the gather of that step's rows, each step ending in a device
       sync (as a step that reads its result does); prefetched one step ahead vs max(compute, fetch),
       each timed alone, and vs the synchronous loop.

    Every tier is first checked bit-identical to FP8Table.gather. `device="cpu"` runs what a CPU can
    (no UVA, no pinned copy): a smoke test of this function, not a measurement.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    bf16 = torch.bfloat16
    row_bytes = fp8_row_bytes(dim)
    table = make_table(rows, dim, seed)
    pinned = FP8Table(table.weight.pin_memory(), table.scale.pin_memory()) if cuda else table
    zipf_ids = [make_ids(rows, tokens, per_token, zipf, seed + i) for i in range(batches)]
    uniform_ids = [make_ids(rows, tokens, per_token, None, seed + 100 + i) for i in range(batches)]
    n_per_pass = sum(b.numel() for b in zipf_ids)
    cache_rows = max(1, int(fraction * rows))
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(rows, generator=g)[: max(1, cache_rows // 8)]  # fits the cache's sets with room
    hot_ids = [hot[torch.randint(0, hot.numel(), (tokens, per_token), generator=g)] for _ in range(batches)]
    fresh = torch.randperm(rows, generator=g)[: min(rows, n_per_pass)]  # distinct rows, never repeated
    cold_ids = [c.view(-1, per_token) for c in fresh.split(tokens * per_token) if c.numel() % per_token == 0]

    def best_pass(fn: Callable[[torch.Tensor], object], ids: list[torch.Tensor], before=None) -> float:
        """Best seconds of one pass of fn over `ids` (synced at its end), of `repeats` passes after one warm."""
        times = []
        for i in range(repeats + 1):
            if before is not None:
                before()
            sync()
            t0 = time.perf_counter()
            for b in ids:
                fn(b)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        return min(times)

    def check(t: TieredTable, ids: torch.Tensor) -> None:
        if not torch.equal(_bits(t.gather(ids, bf16).cpu().float()), _bits(table.gather(ids, bf16).float())):
            raise AssertionError(f"{t!r} disagrees with FP8Table.gather")

    out: list[dict] = []
    # ---- 1. bandwidth: the pinned copy and the UVA gather
    copy_gbs = None
    if cuda:
        from engram import kernels
        from engram.systems.uva import uva_view

        copy_gbs = pinned_copy_gb_per_s(dev, min(1 << 30, rows * row_bytes))
        out.append(
            {
                "op": "tiers CUDA: pinned host->device copy, one 1 GiB non_blocking copy",
                "gb_per_s": copy_gbs,
                "baseline": "the bus's peak: the UVA rows below are a fraction of it (ratio)",
            }
        )
        uv, us = uva_view(pinned.weight, dev), uva_view(pinned.scale, dev)
        for label, ids in (("uniform ids", uniform_ids), (f"Zipf({zipf}) ids", zipf_ids)):
            on_dev = [b.to(dev) for b in ids]
            sec = best_pass(lambda b, uv=uv, us=us: kernels.fp8_gather(uv, us, b, bf16), on_dev)
            gbs = n_per_pass * row_bytes / sec / 1e9
            out.append(
                {
                    "op": f"tiers CUDA: UVA gather kernel reads pinned host rows, {label}",
                    "rows_per_s": n_per_pass / sec,
                    "gb_per_s": gbs,
                    "ratio": gbs / copy_gbs,
                    "baseline": f"pinned H2D copy {copy_gbs:.1f} GB/s (ratio: row bytes/s over it; target >= 0.70)",
                }
            )

    # ---- 2. tiers without and with a device-indexed cache
    staged = TieredTable(table, Placement.HOST, device=dev)
    check(staged, zipf_ids[0])
    plain = best_pass(lambda b: table.gather(b, bf16).to(dev), zipf_ids)
    sec = best_pass(lambda b: staged.gather(b, bf16), zipf_ids)
    out.append(
        {
            "op": "tiers CUDA: host table -> GPU, no cache, staged (Zipf ids)",
            "rows_per_s": n_per_pass / sec,
            "ratio": plain / sec,
            "baseline": f"host FP8Table.gather + copy of bf16 rows, {n_per_pass / plain / 1e6:.1f} M rows/s",
        }
    )
    base_name, base = "staged host table, no cache", staged
    if cuda:
        uva = TieredTable(pinned, Placement.HOST_UVA, device=dev)
        check(uva, zipf_ids[0])
        sec_uva = best_pass(lambda b: uva.gather(b, bf16), zipf_ids)
        out.append(
            {
                "op": "tiers CUDA: UVA table, no cache (Zipf ids)",
                "rows_per_s": n_per_pass / sec_uva,
                "ratio": sec / sec_uva,
                "baseline": f"staged host table, no cache, {n_per_pass / sec / 1e6:.1f} M rows/s",
            }
        )
        base_name, base = "UVA table, no cache", uva
    fills = [("staged fill", table, Placement.HOST)]
    if cuda:
        fills.insert(0, ("UVA fill", pinned, Placement.HOST_UVA))
    for fill, src, placement in fills:
        t = TieredTable(src, placement, device=dev, cache_rows=cache_rows, cache_index="device")
        check(t, zipf_ids[0])
        for label, ids, before in (
            ("100% hits", hot_ids, None),
            ("Zipf ids", zipf_ids, None),
            ("0% hits", cold_ids, t.device_cache.clear),
        ):
            n = sum(b.numel() for b in ids)
            ref = best_pass(lambda b: base.gather(b, bf16), ids)
            best_pass(lambda b, t=t: t.gather(b, bf16), ids[:1], before)  # warm (the cache too)
            t.reset_stats()
            sec = best_pass(lambda b, t=t: t.gather(b, bf16), ids, before)
            s = t.stats()
            out.append(
                {
                    "op": f"tiers CUDA: device cache {fraction:.0%}, {fill}, {label} (hit {s['cache_hit_rate']:.0%})",
                    "rows_per_s": n / sec,
                    "ratio": ref / sec,
                    "baseline": f"{base_name}, same ids, {n / ref / 1e6:.1f} M rows/s",
                    "hit_rate": s["cache_hit_rate"],
                    "host_syncs_per_batch": s["cache_host_syncs"] / max(1, s["gathers"]),
                    "fetched_bytes_per_row": s["bytes_fetched"] / max(1, s["rows_requested"]),
                }
            )
        # ---- 3. overlap, on the Zipf ids (a real fetch each step)
        out.append(_overlap_row(t, fill, zipf_ids, dev, matmul, repeats))
    for r in out:
        r.update(table_mb=rows * row_bytes / 1e6, tokens=tokens, per_token=per_token)
    return out


def _overlap_row(
    t: TieredTable, fill: str, ids: list[torch.Tensor], dev: torch.device, matmul: int, repeats: int
) -> dict:
    """Steps of compute (a GPU matmul) then the gather of the step's rows, each step ending in a sync of
    its stream (it reads its result, as a decode step does; a prefetch on the side stream runs on):
    prefetched one step ahead vs the longer of compute and fetch, each timed alone (same run)."""
    cuda = dev.type == "cuda"
    bf16 = torch.bfloat16

    def sync(everything: bool) -> None:
        if cuda:
            if everything:
                torch.cuda.synchronize(dev)
            else:
                torch.cuda.current_stream(dev).synchronize()

    def per_step(step: Callable[[int], None], everything: bool = False) -> float:
        best = math.inf
        for _ in range(repeats):
            sync(True)
            t0 = time.perf_counter()
            for i in range(len(ids)):
                step(i)
                sync(everything)  # the step reads its result
            sync(True)
            best = min(best, (time.perf_counter() - t0) / len(ids))
        return best

    fetch = per_step(lambda i: t.gather(ids[i], bf16), everything=True)
    a = torch.randn(matmul, matmul, device=dev, dtype=bf16 if cuda else torch.float32)
    one = per_step(lambda i: a @ a)
    reps = max(1, round(fetch / one))  # compute about as long as the fetch: the hardest case to hide

    def compute() -> None:
        for _ in range(reps):
            a @ a

    comp = per_step(lambda i: compute())

    def sync_step(i: int) -> None:
        compute()
        t.gather(ids[i], bf16)

    def ahead_step(i: int) -> None:
        if i == 0:
            t.prefetch(ids[0])
        if i + 1 < len(ids):
            t.prefetch(ids[i + 1])  # fetched on the side stream while this step computes
        compute()
        t.gather(ids[i], bf16)

    t.reset_stats()
    ahead = per_step(ahead_step)
    hits = t.stats()["prefetch_hits"]
    both = per_step(sync_step)
    bound = max(comp, fetch)
    return {
        "op": f"tiers CUDA: prefetch 1 ahead of a matmul, device cache, {fill}",
        "us_per_step": ahead * 1e6,
        "seconds": ahead,
        "ratio": bound / ahead,
        "baseline": (
            f"max(compute {comp * 1e3:.2f}, fetch {fetch * 1e3:.2f}) ms/step, same run (loop/max "
            f"{ahead / bound:.2f}, target <= 1.1; synchronous loop {both * 1e3:.2f} ms)"
        ),
        "vs_bound": ahead / bound,
        "sync_loop_seconds": both,
        "compute_seconds": comp,
        "fetch_seconds": fetch,
        "prefetch_hits": hits,
    }


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
