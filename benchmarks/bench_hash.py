"""Hashing throughput: `NgramHasher.hash` (numba kernels, one thread and all cores; the numpy twin)
against a plain numpy version of the published demo's algorithm, measured in the same run on the
same ids.

    python benchmarks/bench_hash.py [--preset deepseek-v4.1] [--batch 16] [--seq 4096] [--repeats 7]

Prints tokens/s of each (best of `repeats`) and its ratio to the demo baseline. The baseline
follows the Engram demo: compress, build each look-back by padding and shifting the whole batch,
chain the XOR mixes, take one modulo per head into a list, stack, then add the head offsets (the
demo adds them in its embedding module). Every variant is checked to give identical rows before
timing. On a shared machine the all-cores line measures what the other processes leave free.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from engram import EngramConfig, NgramHasher, TokenizerCompression


def demo_baseline(hasher: NgramHasher, token_ids: np.ndarray) -> np.ndarray:
    """(B, T, layers, heads) rows the way the published demo computes them (no dead tokens)."""
    c = hasher.config
    x = hasher.compression.lookup[token_ids]
    _b, t = x.shape
    shifts = [x] + [
        np.pad(x, ((0, 0), (k, 0)), constant_values=hasher.pad)[:, :t] for k in range(1, c.max_ngram_size)
    ]
    per_layer = []
    for li, layer in enumerate(hasher.layout.layers):
        m = hasher.multipliers[li]
        heads = []
        for oi, n in enumerate(c.orders):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
            for p in layer.primes[oi]:
                heads.append(mix % p)
        per_layer.append(np.stack(heads, axis=2) + layer.offsets)
    return np.stack(per_layer, axis=2)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(preset: str = "deepseek-v4.1", batch: int = 16, seq: int = 4096, repeats: int = 7) -> list[dict]:
    hasher = NgramHasher(EngramConfig.preset(preset), TokenizerCompression.from_tokenizer("deepseek-v4"))
    tables = hasher.kernel_tables("numba")  # raises ImportError without numba
    cores = tables.module.available_cores()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hasher.config.vocab_size, size=(batch, seq))
    dead = rng.random((batch, seq)) < 0.01
    n = ids.size

    t0 = time.perf_counter()
    first = hasher.hash(ids, threads=1)  # compiles, or loads the on-disk cache
    first_call = time.perf_counter() - t0
    want = demo_baseline(hasher, ids)
    checks = {
        "numba 1 thread": first,
        f"numba {cores} threads": hasher.hash(ids, threads=cores),
        "numba int32": hasher.hash(ids, threads=1, out_dtype=np.int32),
        "numpy twin": hasher.hash(ids, backend="numpy"),
    }
    for name, rows in checks.items():
        if not np.array_equal(rows, want):
            raise AssertionError(f"{name} and the demo baseline disagree")
    if not np.array_equal(hasher.hash(ids, dead, threads=1), hasher.hash(ids, dead, backend="numpy")):
        raise AssertionError("numba and numpy disagree with dead tokens")

    base = best_time(lambda: demo_baseline(hasher, ids), repeats)
    timed = [
        ("numpy twin (backend='numpy')", lambda: hasher.hash(ids, backend="numpy")),
        ("numba, 1 thread", lambda: hasher.hash(ids, threads=1)),
        (f"numba, {cores} threads", lambda: hasher.hash(ids, threads=cores)),
        ("numba, 1 thread, int32 rows", lambda: hasher.hash(ids, threads=1, out_dtype=np.int32)),
        (f"numba, {cores} threads, int32 rows", lambda: hasher.hash(ids, threads=cores, out_dtype=np.int32)),
        ("numba, 1 thread, 1% dead tokens", lambda: hasher.hash(ids, dead, threads=1)),
    ]
    results = []
    one_thread = None
    for name, fn in timed:
        t = best_time(fn, repeats)
        if name == "numba, 1 thread":
            one_thread = t
        results.append(
            {
                "op": f"hash {preset} ({hasher.config.n_layers} layers), B*T={n}: {name}",
                "tokens_per_s": n / t,
                "baseline": "numpy demo algorithm",
                "baseline_tokens_per_s": n / base,
                "ratio": base / t,
                "seconds": t,
            }
        )
    for r in results:
        r["vs_one_thread"] = one_thread / r["seconds"]
    results.append({"op": "first numba call (compile or cache load)", "seconds": first_call, "cores": cores})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v4.1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    results = run(args.preset, args.batch, args.seq, args.repeats)
    base = results[0]["baseline_tokens_per_s"]
    print(f"baseline (numpy demo algorithm): {base / 1e6:8.2f} M tok/s")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['op']}: {r['seconds']:.2f} s ({r['cores']} cores available)")
            continue
        print(
            f"{r['op']:<88} {r['tokens_per_s'] / 1e6:8.2f} M tok/s   {r['ratio']:6.2f}x baseline   "
            f"{r['vs_one_thread']:5.2f}x numba 1 thread"
        )


if __name__ == "__main__":
    main()
