"""Hashing throughput: `NgramHasher.hash` (numba kernels, one thread and all cores; the numpy twin)
against a plain numpy version of the published demo's algorithm, measured in the same run on the
same ids.

    python benchmarks/bench_hash.py [--preset deepseek-v4.1] [--batch 16] [--seq 4096] [--repeats 7]

Prints tokens/s of each (best of `repeats`) and its ratio to the demo baseline. The baseline
follows the Engram demo: compress, build each look-back by padding and shifting the whole batch,
chain the XOR mixes, take one modulo per head into a list, stack, then add the head offsets (the
demo adds them in its embedding module). Every variant is checked to give identical rows before
timing. On a shared machine the all-cores line measures what the other processes leave free.

On CUDA (`run_cuda`, called by `run` when a GPU is present): `NgramHasher.hash` of a CUDA tensor
(the Triton kernel, with compression and the boundary check) and the kernel alone into a
preallocated int32 output, against the same demo algorithm written in torch on the GPU, on
B*T = `cuda_batch` x `cuda_seq` tokens; GB/s counts the ids read and the rows written.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from engram import EngramConfig, NgramHasher, TokenizerCompression
from engram.addressing.compression import known_compression
from engram.benchmarks.timing import best_time, cuda_time
from engram.kernels.threads import available_cores


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


def torch_demo_baseline(hasher: NgramHasher, token_ids: torch.Tensor) -> torch.Tensor:
    """`demo_baseline` in torch, on the ids' device (the GPU baseline): (B, T, layers, heads) int64."""
    c = hasher.config
    lut = torch.tensor(hasher.compression.lookup, device=token_ids.device)  # a copy: the map is read-only
    x = lut[token_ids]
    t = x.shape[1]
    shifts = [x] + [F.pad(x, (k, 0), value=hasher.pad)[:, :t] for k in range(1, c.max_ngram_size)]
    per_layer = []
    for li, layer in enumerate(hasher.layout.layers):
        m = [int(v) for v in hasher.multipliers[li]]
        heads = []
        for oi, n in enumerate(c.orders):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = torch.bitwise_xor(mix, shifts[k] * m[k])
            for p in layer.primes[oi]:
                heads.append(mix % p)
        offsets = torch.as_tensor(np.asarray(layer.offsets).reshape(-1), device=token_ids.device)
        per_layer.append(torch.stack(heads, dim=2) + offsets)
    return torch.stack(per_layer, dim=2)


def run_cuda(
    preset: str = "deepseek-v4.1", batch: int = 64, seq: int = 65536, repeats: int = 10
) -> list[dict]:
    """Hash throughput on the GPU: the Triton path against the demo algorithm in torch on the GPU."""
    from engram import kernels

    hasher = NgramHasher(EngramConfig.preset(preset), TokenizerCompression.from_tokenizer("deepseek-v4"))
    c = hasher.config
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (batch, seq), device="cuda", generator=g)
    dead = torch.rand((batch, seq), device="cuda", generator=g) < 0.01
    n = ids.numel()
    heads = c.n_layers * c.rows_per_token

    want = torch_demo_baseline(hasher, ids)
    got = hasher.hash(ids)
    if not torch.equal(got, want):
        raise AssertionError("NgramHasher.hash on CUDA (Triton) and the torch demo baseline disagree")
    if not np.array_equal(got[:2, :4096].cpu().numpy(), hasher.hash(ids[:2, :4096].cpu().numpy())):
        raise AssertionError("the Triton hash and the CPU hash disagree")
    if not np.array_equal(
        hasher.hash(ids[:2], dead[:2]).cpu().numpy(),
        hasher.hash(ids[:2].cpu().numpy(), dead[:2].cpu().numpy()),
    ):
        raise AssertionError("the Triton hash and the CPU hash disagree with dead tokens")
    del got, want

    dev = {
        a: torch.as_tensor(getattr(hasher, a), device="cuda") for a in ("multipliers", "primes", "offsets")
    }
    xc = torch.tensor(hasher.compression.lookup, device="cuda")[ids]
    out32 = torch.empty((batch, seq, c.n_layers, c.rows_per_token), dtype=torch.int32, device="cuda")

    def kernel_only() -> None:
        kernels.hash_rows(
            xc, None, None, dev["multipliers"], dev["primes"], dev["offsets"], hasher.pad, out32
        )

    base = cuda_time(lambda: torch_demo_baseline(hasher, ids), repeats)
    timed = [
        ("NgramHasher.hash (Triton), int64 rows", lambda: hasher.hash(ids), 8),
        ("NgramHasher.hash (Triton), int32 rows", lambda: hasher.hash(ids, out_dtype=np.int32), 4),
        ("NgramHasher.hash (Triton), int64, 1% dead", lambda: hasher.hash(ids, dead), 8),
        ("Triton kernel alone, compressed ids -> int32 out=", kernel_only, 4),
    ]
    results = []
    for name, fn, row_bytes in timed:
        t = cuda_time(fn, repeats)
        results.append(
            {
                "op": f"CUDA hash {preset} ({c.n_layers} layers), B*T={n}: {name}",
                "tokens_per_s": n / t,
                "gb_per_s": n * (8 + heads * row_bytes) / t / 1e9,  # ids read + rows written
                "baseline": "demo algorithm in torch (CUDA)",
                "baseline_tokens_per_s": n / base,
                "ratio": base / t,
                "seconds": t,
                "device": torch.cuda.get_device_name(),
            }
        )
    return results


def run(preset: str = "deepseek-v4.1", batch: int = 16, seq: int = 4096, repeats: int = 7) -> list[dict]:
    # the process's one DeepSeek-V4 map (built once, ~2 s): `engram bench` and the tests reuse it
    hasher = NgramHasher(EngramConfig.preset(preset), known_compression("deepseek-v4"))
    hasher.kernel_tables("numba")  # compiles (or loads) the kernels before timing
    cores = available_cores()
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
    if torch.cuda.is_available():
        results += run_cuda(preset, repeats=max(repeats, 5))
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
        if "cores" in r:
            print(f"{r['op']}: {r['seconds']:.2f} s ({r['cores']} cores available)")
            continue
        print(
            f"{r['op']:<88} {r['tokens_per_s'] / 1e6:8.2f} M tok/s   {r['ratio']:6.2f}x baseline   "
            + (f"{r['vs_one_thread']:5.2f}x numba 1 thread" if "vs_one_thread" in r else r["baseline"])
        )


if __name__ == "__main__":
    main()
