"""Decode-step hashing: `HashStream.step` (one numba call per step) against a straightforward torch
decoder that keeps a per-position history of compressed ids, measured in the same run.

    python benchmarks/bench_decode.py [--preset deepseek-v4.1] [--batch 1 256 1024] [--steps 300]
                                      [--torch-threads 1]

For each batch size: microseconds per step (median over `steps` steps after a warm-up) of
- the baseline, V4.1 reference style: compress the new ids, write them into a (B, positions)
  history, gather the last max_ngram ids (left-padded), multiply/XOR into the mixes, then one `%`
  per head, stacked, plus the offsets; a torch CPU tensor in, a torch tensor out;
- the same with one broadcast `%` over all heads (a stronger torch baseline);
- `HashStream.step` with torch ids in and rows out, with numpy ids and a preallocated `out`, and
  with `out` as int32.
Every variant's rows are checked equal to `NgramHasher.hash` of the whole sequence. The torch
baselines run on `--torch-threads` intra-op threads (default 1, like `step`; with more, OpenMP
spin-waits make the larger batches erratic on a busy machine). `run_cuda` is the GPU half (eager
step, CUDA graph replay and the torch baselines on the device, in one run; `gpu_check.py` calls it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from engram import EngramConfig, HashStream, NgramHasher, TokenizerCompression
from engram.addressing.stream_device import StreamGraph


class TorchHistoryDecoder:
    """The straightforward decoder: a growing (B, positions) history, last max_ngram ids gathered."""

    def __init__(
        self, hasher: NgramHasher, batch: int, max_len: int, per_head: bool = True, device: str = "cpu"
    ) -> None:
        c = hasher.config
        self.n = c.max_ngram_size
        self.k = c.n_heads
        self.per_head = per_head
        self.lookup = torch.tensor(hasher.compression.lookup, device=device)
        # history[:, n-1+t] is position t; the first n-1 columns are the start-of-sequence pads
        self.history = torch.full((batch, max_len + self.n - 1), hasher.pad, dtype=torch.int64, device=device)
        self.pos = 0
        self.mult = torch.tensor(hasher.multipliers, device=device)  # (L, n)
        self.primes = torch.tensor(hasher.primes, device=device)  # (L, orders, K)
        self.offsets = torch.tensor(hasher.offsets, device=device)
        self.prime_list = hasher.primes.tolist()

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows (B, L, orders*K) of one token per sequence."""
        x = self.lookup[ids]  # compress
        col = self.pos + self.n - 1
        self.history[:, col] = x
        last = self.history[:, col - self.n + 1 : col + 1].flip(-1)  # (B, n): x_t, x_{t-1}, ...
        self.pos += 1
        prod = last[:, None, :] * self.mult  # (B, L, n)
        mix = prod[..., 0]
        mixes = []
        for i in range(1, self.n):
            mix = torch.bitwise_xor(mix, prod[..., i])
            mixes.append(mix)
        if not self.per_head:
            mixed = torch.stack(mixes, dim=-1)  # (B, L, orders)
            return (mixed[..., None] % self.primes + self.offsets).flatten(-2)
        per_layer = []
        for li, layer_primes in enumerate(self.prime_list):
            heads = [mixes[o][:, li, None] % p for o, order in enumerate(layer_primes) for p in order]
            per_layer.append(torch.cat(heads, dim=-1) + self.offsets[li].reshape(-1))
        return torch.stack(per_layer, dim=1)


def time_steps(step: Callable[[int], object], first: int, steps: int) -> float:
    """Median seconds of step(pos) for pos in [first, first + steps)."""
    times = []
    for pos in range(first, first + steps):
        t0 = time.perf_counter()
        step(pos)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(preset: str, batch: int, steps: int, warmup: int = 20) -> list[dict]:
    hasher = NgramHasher(EngramConfig.preset(preset), TokenizerCompression.from_tokenizer("deepseek-v4"))
    hasher.kernel_tables("numba")  # raises ImportError without numba
    total = warmup + steps
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hasher.config.vocab_size, size=(batch, total))
    ids_t = torch.from_numpy(ids)
    cols = [ids_t[:, p].contiguous() for p in range(total)]  # (B,) torch ids per step
    cols_np = [np.ascontiguousarray(ids[:, p]) for p in range(total)]
    want = hasher.hash(ids)  # (B, total, L, heads)
    shape = hasher.output_shape((batch,))

    def check_and_time(name: str, make: Callable[[], Callable[[int], object]]) -> dict:
        step = make()
        for pos in range(warmup):  # also checks the rows
            rows = step(pos)
            rows = rows.numpy() if isinstance(rows, torch.Tensor) else rows
            if not np.array_equal(rows, want[:, pos]):
                raise AssertionError(f"{name} disagrees with NgramHasher.hash at position {pos}")
        return {"variant": name, "us_per_step": 1e6 * time_steps(step, warmup, steps)}

    def torch_history(per_head: bool) -> Callable[[], Callable[[int], object]]:
        def make() -> Callable[[int], object]:
            dec = TorchHistoryDecoder(hasher, batch, total, per_head=per_head)
            return lambda pos: dec.step(cols[pos])

        return make

    def stream(kind: str) -> Callable[[], Callable[[int], object]]:
        def make() -> Callable[[int], object]:
            s = HashStream(hasher, batch)
            if kind == "torch":
                return lambda pos: s.step(cols[pos])
            out = np.empty(shape, dtype=np.int32 if kind == "int32" else np.int64)
            return lambda pos: s.step(cols_np[pos], out=out)

        return make

    rows = [
        check_and_time("torch history, % per head (baseline)", torch_history(True)),
        check_and_time("torch history, one broadcast %", torch_history(False)),
        check_and_time("HashStream.step, torch ids -> torch rows", stream("torch")),
        check_and_time("HashStream.step, numpy ids, out= int64", stream("int64")),
        check_and_time("HashStream.step, numpy ids, out= int32", stream("int32")),
    ]
    base = rows[0]["us_per_step"]
    for r in rows:
        r["batch"] = batch
        r["baseline"] = "torch history, % per head"
        r["ratio"] = base / r["us_per_step"]
        r["tokens_per_s"] = batch / (r["us_per_step"] * 1e-6)
    return rows


def run_cuda(
    preset: str = "deepseek-v4.1", batch: int = 256, steps: int = 200, device: str = "cuda"
) -> list[dict]:
    """Decode steps on the GPU, against the torch history decoder on the same GPU, in one run.

    `HashStream.step` of CUDA ids is one Triton launch on the state kept on the device (no host sync):
    timed eagerly (a new rows tensor each step, then into a preallocated `out`, int64 and int32) and
    replayed as a CUDA graph (`HashStream.capture("step")`: the ids copied into the graph's buffer,
    then one replay; and the replay alone, the ids already in the buffer). Microseconds a step: `steps` consecutive steps with one sync at the end, divided
    by `steps` (the launch rate when the host is the bottleneck). Two more rows: the device time of one
    step alone (100 steps captured in one graph, replayed once) and a speculative round (a captured
    draft of 4 tokens and a captured commit), per round. Every variant's rows are checked against
    `NgramHasher.hash` of the whole sequences first. Ratios are against the stronger torch baseline
    (one broadcast `%` over the heads); `ratio_vs_per_head` against the V4.1-reference style one.
    `device="cpu"` (a test, with the kernels interpreted) runs the eager rows only."""
    hasher = NgramHasher(EngramConfig.preset(preset), TokenizerCompression.from_tokenizer("deepseek-v4"))
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, hasher.config.vocab_size, (steps, batch), device=device, generator=g)
    want = hasher.hash(ids.T.cpu().numpy())  # (B, steps, L, heads)
    shape = hasher.output_shape((batch,))

    def loop(make: Callable[[], Callable[[torch.Tensor], torch.Tensor]], check: bool) -> float:
        step = make()
        sync()
        t0 = time.perf_counter()
        if check:
            got = [step(ids[t]).clone() for t in range(steps)]  # a graph's out is overwritten each step
        else:
            for t in range(steps):
                step(ids[t])
        sync()
        seconds = time.perf_counter() - t0
        if check:
            rows = torch.stack([r.long() for r in got], dim=1).cpu().numpy()  # (B, steps, L, heads)
            if not np.array_equal(rows, want):
                raise AssertionError("a CUDA decode step disagrees with NgramHasher.hash")
        return seconds / steps

    def history(per_head: bool) -> Callable[[], Callable[[torch.Tensor], torch.Tensor]]:
        return lambda: TorchHistoryDecoder(hasher, batch, steps, per_head=per_head, device=device).step

    def stream(kind: str) -> Callable[[], Callable[[torch.Tensor], torch.Tensor]]:
        def make() -> Callable[[torch.Tensor], torch.Tensor]:
            s = HashStream(hasher, batch)
            s.to_device(device)
            if kind == "new":
                return s.step
            if kind == "graph":
                return s.capture("step")
            out = torch.empty(shape, dtype=torch.int32 if kind == "int32" else torch.int64, device=device)
            return lambda x: s.step(x, out=out)

        return make

    variants = [
        ("torch history % per head", history(True)),
        ("torch broadcast % (baseline)", history(False)),
        ("HashStream.step eager, new rows", stream("new")),
        ("HashStream.step eager, out=int64", stream("int64")),
        ("HashStream.step eager, out=int32", stream("int32")),
    ]
    if cuda:
        variants.append(("capture('step') graph replay", stream("graph")))
    results = []
    name = torch.cuda.get_device_name() if cuda else "cpu"
    for variant, make in variants:
        loop(make, check=True)  # warm-up (compiles the kernel) and the exactness check
        us = 1e6 * min(loop(make, check=False) for _ in range(3))
        results.append({"variant": variant, "us_per_step": us, "device": name})
    per_head = results[0]["us_per_step"]
    base = results[1]["us_per_step"]
    for r in results:
        r.update(ratio=base / r["us_per_step"], ratio_vs_per_head=per_head / r["us_per_step"])
        r["baseline"] = "torch history on CUDA, one broadcast %"
    if cuda:  # the graph's replay alone: the ids written into its buffer in place (by a sampler's graph)
        graph = stream("graph")()
        assert isinstance(graph, StreamGraph)
        graph.inputs["ids"].copy_(ids[0])  # type: ignore[union-attr]
        us = 1e6 * min(loop(lambda graph=graph: lambda x: graph.replay(), check=False) for _ in range(3))
        results.append({"variant": "graph.replay(), ids already in place", "us_per_step": us, "device": name})
        results[-1].update(ratio=base / us, ratio_vs_per_head=per_head / us)
        results[-1]["baseline"] = results[0]["baseline"]
    if cuda:  # no ratio: not the same quantity as a step timed from the host
        gpu_us = _device_step_us(hasher, batch, ids)
        results.append({"variant": "GPU time/step (100 in one graph)", "us_per_step": gpu_us})
        results.append(
            {"variant": "spec round draft(4)+commit graphs", "us_per_step": _spec_round_us(hasher, batch)}
        )
    for r in results:
        unit = "us/round" if r["variant"].startswith("spec") else "us/step"
        r.update(
            op=f"CUDA decode B={batch}, {r['variant']}: {r['us_per_step']:.1f} {unit}",
            batch=batch,
            device=name,
            tokens_per_s=batch * (4 if r["variant"].startswith("spec") else 1) / (r["us_per_step"] * 1e-6),
        )
    return results


def _device_step_us(hasher: NgramHasher, batch: int, ids: torch.Tensor, n: int = 100) -> float:
    """Microseconds of GPU time per step: `n` steps captured in one graph, replayed (launch cost gone)."""
    s = HashStream(hasher, batch)
    s.to_device(ids.device)
    out = torch.empty(hasher.output_shape((batch,)), dtype=torch.int64, device=ids.device)
    for t in range(3):  # compile outside the capture
        s.step(ids[t], out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in range(n):
            s.step(ids[t % ids.shape[0]], out=out)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / n)
    s.check()
    return best


def _spec_round_us(hasher: NgramHasher, batch: int, rounds: int = 100) -> float:
    """Microseconds per speculative round: a captured draft of 4 tokens, then a captured commit of a
    device tensor of accepted counts (1..4), as a verifier leaves them."""
    s = HashStream(hasher, batch)
    draft = s.capture("draft", tokens=4)
    commit = s.capture("commit")
    g = torch.Generator(device="cuda").manual_seed(1)
    drafts = torch.randint(0, hasher.config.vocab_size, (rounds, batch, 4), device="cuda", generator=g)
    accepted = torch.randint(1, 5, (rounds, batch), device="cuda", generator=g)
    for r in range(3):
        draft(drafts[r])
        commit(accepted[r])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in range(rounds):
        draft(drafts[r])
        commit(accepted[r])
    torch.cuda.synchronize()
    s.check()
    return 1e6 * (time.perf_counter() - t0) / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="deepseek-v4.1")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256, 1024])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(f"decode step, {args.preset}, torch {torch.__version__} with {torch.get_num_threads()} threads")
    for b in args.batch:
        for r in run(args.preset, b, args.steps):
            print(
                f"B={r['batch']:<5} {r['variant']:<44} {r['us_per_step']:9.1f} us/step   "
                f"{r['tokens_per_s'] / 1e6:7.2f} M tok/s   {r['ratio']:6.1f}x baseline"
            )


if __name__ == "__main__":
    main()
