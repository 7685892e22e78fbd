"""The GPU half of the benchmarks in one short run, for a session lent a CUDA device.

    python benchmarks/gpu_check.py [--json PATH] [--only NAME ...]

Runs, each against its baseline measured in the same run: the hash on CUDA (`bench_hash.run_cuda`:
the Triton path against the demo algorithm in torch on the GPU), the decode step with the state on
the device (`bench_decode.run_cuda`: the eager step, its CUDA graph replay, its GPU time alone and a
speculative round, against the torch history decoder on the GPU), the FP8 gather with the table on
the device (`bench_lookup.run_cuda`: % of a device copy measured there, fp32 and bf16, uniform and
Zipf ids, with and without dedup, a sweep of the kernel's block sizes; `FP8Table.gather` against
`F.embedding` + dequantise), the gathers of the other row formats (`bench_formats.run_cuda`: INT8,
INT8 per row and 4-bit against FP8's, each as a fraction of copy), the fused gate forward and backward (`bench_gate.run`: against eager
torch), the host tiers (`bench_tiers.run_cuda`: the UVA gather against a pinned copy measured in the
same run, the device-indexed cache at 100 / Zipf / 0 % hits against the table without a cache, a
prefetched loop against max(compute, fetch)), and the sparse table optimizers (`bench_optim.run_cuda`:
against dense AdamW and the dense Sinkhorn update, with their host syncs a step). Prints one table
with each GB/s as a fraction of a device-to-device copy measured first. A benchmark that fails is
reported as failed (with the error) and the others still run. `benchmarks/gpu_check.sh` wraps this
with the CUDA tests for the `device` tool.
"""

from __future__ import annotations

import argparse
import importlib
import json
import traceback
from pathlib import Path
from typing import Any

import torch

from engram.apps.tools.bench import device_copy_gb_per_s, format_rows

# (name, module of engram.benchmarks, function, arguments)
CHECKS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("hash", "bench_hash", "run_cuda", {}),
    ("decode", "bench_decode", "run_cuda", {}),
    ("lookup", "bench_lookup", "run_cuda", {}),
    ("formats", "bench_formats", "run_cuda", {}),
    ("gate bf16", "bench_gate", "run", {"dtype": "bf16"}),
    ("gate fp32", "bench_gate", "run", {"dtype": "fp32"}),
    ("tiers", "bench_tiers", "run_cuda", {}),
    ("optim", "bench_optim", "run_cuda", {}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", help="also write the rows here as JSON")
    names = [name for name, *_ in CHECKS]
    ap.add_argument(
        "--only", nargs="+", choices=names, metavar="NAME", help=f"run only these: {', '.join(names)}"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (nothing measured)")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    peak = device_copy_gb_per_s()
    print(f"device copy bandwidth (bytes read + written): {peak:,.0f} GB/s")
    rows: list[dict[str, Any]] = []
    failed = 0
    for name, module, fn, kwargs in CHECKS:
        if args.only and name not in args.only:
            continue
        try:
            rows += getattr(importlib.import_module(f"engram.benchmarks.{module}"), fn)(**kwargs)
        except Exception as e:  # report it and go on: one device run must return every number it can
            failed += 1
            traceback.print_exc()
            rows.append({"op": f"{name}: FAILED ({type(e).__name__}: {e})", "skipped": True})
        torch.cuda.empty_cache()
    print("\n".join(format_rows(rows, peak)))
    if args.json:
        Path(args.json).write_text(json.dumps({"device_copy_gb_per_s": peak, "rows": rows}, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
