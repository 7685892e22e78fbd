"""Hashing throughput: `NgramHasher.hash` against a plain numpy version of the published demo's
algorithm, measured in the same run on the same ids.

    python benchmarks/bench_hash.py [--preset deepseek-v4.1] [--batch 16] [--seq 4096] [--repeats 5]

Prints tokens/s of each (best of `repeats`) and the ratio. The baseline follows the Engram demo:
compress, build each look-back by padding and shifting the whole batch, chain the XOR mixes,
take one modulo per head into a list, stack, then add the head offsets (the demo adds them in its
embedding module). Both are checked to give identical rows before timing.
"""

from __future__ import annotations

import argparse
import time

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


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(preset: str = "deepseek-v4.1", batch: int = 16, seq: int = 4096, repeats: int = 5) -> list[dict]:
    hasher = NgramHasher(EngramConfig.preset(preset), TokenizerCompression.from_tokenizer("deepseek-v4"))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hasher.config.vocab_size, size=(batch, seq))
    dead = rng.random((batch, seq)) < 0.01
    if not np.array_equal(hasher.hash(ids), demo_baseline(hasher, ids)):
        raise AssertionError("hash() and the demo baseline disagree")
    n = ids.size
    base = best_time(lambda: demo_baseline(hasher, ids), repeats)
    ours = best_time(lambda: hasher.hash(ids), repeats)
    ours_dead = best_time(lambda: hasher.hash(ids, dead), repeats)
    return [
        {
            "op": f"hash {preset} ({hasher.config.n_layers} layers), B*T={n}",
            "tokens_per_s": n / ours,
            "baseline": "numpy demo algorithm",
            "baseline_tokens_per_s": n / base,
            "ratio": base / ours,
        },
        {
            "op": f"hash {preset} with 1% dead tokens",
            "tokens_per_s": n / ours_dead,
            "baseline": "numpy demo algorithm (no dead tokens)",
            "baseline_tokens_per_s": n / base,
            "ratio": base / ours_dead,
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v4.1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for r in run(args.preset, args.batch, args.seq, args.repeats):
        print(
            f"{r['op']:<52} {r['tokens_per_s'] / 1e6:8.2f} M tok/s   baseline {r['baseline']}: "
            f"{r['baseline_tokens_per_s'] / 1e6:8.2f} M tok/s   ratio {r['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
