"""`engram bench`: run the benchmark suite in `benchmarks/` and print one table.

Each benchmark module there has `run(**kwargs) -> list[dict]`; every dict names its operation,
its throughput, the baseline measured in the same run and the ratio. This module only finds the
folder (a source checkout: the benchmarks are not installed with the package), calls each `run`
and formats the rows.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["SUITE", "find_benchmarks", "run_suite"]

# name -> (module file, run() arguments, --quick arguments)
SUITE: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "hash": ("bench_hash.py", {}, {"repeats": 3}),
    "decode": (
        "bench_decode.py",
        {"preset": "deepseek-v4.1", "batch": 256, "steps": 200},
        {"preset": "deepseek-v4.1", "batch": 256, "steps": 50},
    ),
    "lookup": ("bench_lookup.py", {}, {"repeats": 1}),
    "lookup-fast": ("bench_lookup_fast.py", {}, {"repeats": 2}),
    "optim": ("bench_optim.py", {}, {"large_rows": 16 << 20}),
    "gate": ("bench_gate.py", {}, {}),
    "tiers": ("bench_tiers.py", {}, {"rows": 1 << 18, "tokens": 1024, "batches": 4, "repeats": 2}),
}

# (key, unit, scale) in order of preference for the throughput column
_THROUGHPUT = (
    ("tokens_per_s", "M tok/s", 1e-6),
    ("rows_per_s", "M rows/s", 1e-6),
    ("us_per_step", "us/step", 1.0),
    ("fused_ms", "ms", 1.0),
    ("seconds", "s", 1.0),
)


def find_benchmarks(start: Path | None = None) -> Path:
    """The `benchmarks/` folder of the source checkout this package runs from (or of the cwd)."""
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    if start is not None:
        candidates.insert(0, Path(start))
    for c in candidates:
        if (c / "bench_hash.py").is_file():
            return c
    raise FileNotFoundError(
        "engram bench runs the benchmarks of a source checkout (benchmarks/bench_*.py), which an installed wheel "
        "does not ship: run it from the repository (pip install -e .) or pass --dir PATH"
    )


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"engram_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_suite(names: list[str], *, quick: bool = False, folder: Path | None = None) -> list[dict[str, Any]]:
    """Run the named benchmarks; returns their rows, each tagged with `bench`."""
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(SUITE)}")
    root = find_benchmarks(folder)
    rows: list[dict[str, Any]] = []
    for name in names:
        file, args, quick_args = SUITE[name]
        t0 = time.perf_counter()
        try:
            result = _load(root / file).run(**(quick_args if quick else args))
        except (ImportError, RuntimeError) as e:  # e.g. no CUDA for the gate, no numba
            rows.append({"bench": name, "op": f"{name}: skipped ({e})", "skipped": True})
            continue
        for r in result:
            r["bench"] = name
            r.setdefault(
                "op", f"{name}: {r.get('variant', '?')}" + (f", batch {r['batch']}" if "batch" in r else "")
            )
            r["bench_seconds"] = time.perf_counter() - t0
        rows.extend(result)
    return rows


def device_copy_gb_per_s(nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Bandwidth of a plain device-to-device copy (bytes read + written per second) on CUDA: the
    practical peak the GB/s column is compared with. None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best / 1e9


def format_rows(rows: list[dict[str, Any]], peak_gb_per_s: float | None = None) -> list[str]:
    """One line per row; with `peak_gb_per_s`, rows that report GB/s also show the fraction of it."""
    lines = [f"{'operation':<70} {'throughput':>18} {'GB/s':>7} {'ratio':>8}  baseline (same run)"]
    for r in rows:
        if r.get("skipped"):
            lines.append(r["op"])
            continue
        thr = ""
        for key, unit, scale in _THROUGHPUT:
            if key in r:
                thr = f"{r[key] * scale:,.2f} {unit}"
                break
        gb = r.get("gb_per_s", r.get("fused_gb_per_s"))
        gbs = "" if gb is None else f"{gb:.2f}"
        if gbs and peak_gb_per_s and r.get("device", "cpu") != "cpu":
            gbs += f" ({gb / peak_gb_per_s:.0%} of peak)"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        lines.append(f"{r['op'][:70]:<70} {thr:>18} {gbs:>7} {ratio:>8}  {r.get('baseline', '')}")
    return lines


def cmd_bench(args: Any) -> int:
    names = args.only.split(",") if args.only else list(SUITE)
    rows = run_suite(names, quick=args.quick, folder=Path(args.dir) if args.dir else None)
    peak = device_copy_gb_per_s()
    if args.json:
        print(json.dumps({"rows": rows, "device_copy_gb_per_s": peak}, default=str))
    else:
        if peak is not None:
            print(f"device copy bandwidth (the peak GB/s is compared with): {peak:,.0f} GB/s")
        print("\n".join(format_rows(rows, peak)))
    return 0


def add_bench_command(sub: Any) -> None:
    p = sub.add_parser("bench", help="run the benchmark suite (benchmarks/) and print one table of ratios")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(SUITE)}")
    p.add_argument(
        "--quick", action="store_true", help="smaller sizes (the optimizer bench uses 16M rows, not 64M)"
    )
    p.add_argument("--dir", help="the benchmarks folder (default: the source checkout's)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_bench)
