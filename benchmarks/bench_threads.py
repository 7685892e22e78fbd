"""Training steps per second alone and beside one busy process, per torch thread setting.

    python benchmarks/bench_threads.py [--preset demo] [--steps 6] [--threads 1,2,auto]
                                       [--wait-policy passive]

Each setting trains the preset's Engram model (`engram train`'s Trainer) in a fresh process: one
warm-up step, then `steps` timed steps. It runs twice: alone, and beside one busy process (a Python
loop that never sleeps, started before the measurement, as `engram demo` beside another job).
`auto` is `engram.kernels.threads.default_threads()`, what `engram demo / train / eval` use without
--threads: measured in the child, so it sees the busy process. `--wait-policy passive` adds the
all-cores setting with OMP_WAIT_POLICY=PASSIVE (torch's OpenMP threads sleep at once instead of
spinning; it only takes effect before torch loads, hence the fresh processes). Reported: steps/s
alone, steps/s busy, and busy / alone (1.0: no slowdown; on 2 cores, losing one core to the busy
process explains 0.5), plus each setting's busy steps/s over all cores' busy steps/s (the
baseline, measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(preset: str, steps: int, threads: str) -> None:
    import torch

    from engram.apps.lm.train import TRAIN_PRESETS, Trainer, build_model, prepare_data
    from engram.kernels.threads import default_threads

    t0 = time.perf_counter()
    n = default_threads() if threads == "auto" else int(threads)
    choose = time.perf_counter() - t0
    torch.set_num_threads(n)
    cfg = TRAIN_PRESETS[preset].replace(eval_every=0, steps=10_000)
    data = prepare_data(cfg)
    trainer = Trainer(cfg, data, build_model(cfg, data))
    trainer.train_step()  # warm-up: first-step allocations
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"threads": n, "seconds": statistics.median(times), "choose_seconds": choose}))


def _measure(args: argparse.Namespace, threads: str, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--steps", str(args.steps)]
    out = subprocess.run([*cmd, "--threads", threads], env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{threads}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default="demo", help="engram train preset (default demo: `engram demo`'s model)"
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per measurement (median reported)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p.add_argument("--threads", default=f"1,{cores},auto" if cores > 1 else "1,auto")
    p.add_argument("--wait-policy", choices=["passive"], help="also all cores with OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.preset, args.steps, args.threads)
        return
    settings = [(t, {}) for t in args.threads.split(",")]
    if args.wait_policy:
        settings.append((str(cores), {"OMP_WAIT_POLICY": "PASSIVE"}))
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    print(f"preset {args.preset}, {cores} cores, median of {args.steps} steps; busy: one `while True: pass`")
    print(f"{'setting':<22} {'threads':>7} {'alone/s':>8} {'busy/s':>8} {'busy/alone':>10} {'vs all':>7}")
    rows = []
    for threads, extra in settings:
        env = {**base_env, **extra}
        alone = _measure(args, threads, env)
        busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # the busy process is running (and counted) before the child starts
            busy = _measure(args, threads, env)
        finally:
            busy_proc.kill()
            busy_proc.wait()
        name = threads + "".join(f" {k}={v}" for k, v in extra.items())
        rows.append((name, alone, busy))
    base = next((1 / b["seconds"] for name, _, b in rows if name == str(cores)), None)
    for name, alone, busy in rows:
        a, b = 1 / alone["seconds"], 1 / busy["seconds"]
        threads = f"{alone['threads']}/{busy['threads']}"  # alone / busy (auto may differ)
        vs = f"{b / base:>7.2f}" if base else f"{'':>7}"
        print(f"{name:<22} {threads:>7} {a:>8.3f} {b:>8.3f} {b / a:>10.2f} {vs}")


if __name__ == "__main__":
    main()
