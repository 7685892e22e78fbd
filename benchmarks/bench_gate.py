"""The V4.1 gate after wkv on CUDA: the fused Triton kernels (`engram.kernels.fused_gate`, forward and
backward) against the eager torch code of `Engram._forward_v41` (`engram.kernels.reference.gate`),
measured in the same run on the same tensors.

    python benchmarks/bench_gate.py [--tokens 8192] [--hc 4] [--dim 5120] [--dtype bf16] [--repeats 20]

Inputs are shaped as in the module: h (1, tokens, hc, dim), key and v views of one wkv output
(1, tokens, hc+1, dim), w (hc, dim), 1% dead tokens. Prints milliseconds (median of `repeats`, CUDA
events) of forward and of forward + backward, the GB/s of the tensors each must at least read and
write, and the ratio (eager time / fused time: > 1 means the fused kernels are faster). Both are
first checked against float32 math on the same inputs (the fused error at most twice the eager one). Needs a CUDA device and
triton; on a CPU it prints why it cannot run and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from engram import kernels
from engram.kernels import reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of fn() on the current stream (two warm-up calls compile and cache)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_inputs(tokens: int, hc: int, dim: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "generator": g}
    return {
        "h": torch.randn(1, tokens, hc, dim, **kw).to(dtype),
        "kv": torch.randn(1, tokens, hc + 1, dim, **kw).to(dtype),
        "w": (1 + 0.1 * torch.randn(hc, dim, **kw)).to(dtype),
        "dead": torch.rand(1, tokens, **kw) < 0.01,
    }


def step(fn: Callable, x: dict[str, torch.Tensor], backward: bool) -> tuple[torch.Tensor, ...]:
    h, kv, w = (x[k].detach().requires_grad_(backward) for k in ("h", "kv", "w"))
    hc = h.shape[2]
    out, gates = fn(h, kv[:, :, :hc], kv[:, :, hc], w, x["dead"], 1e-6, 1e-6)
    if not backward:
        return out, gates
    loss = out.float().sum() + gates.float().sum()
    return (out, gates, *torch.autograd.grad(loss, (h, kv, w)))


def run(
    tokens: int = 8192, hc: int = 4, dim: int = 5120, dtype: str = "bf16", repeats: int = 20
) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA device (the fused gate is a Triton kernel)")
    dt = DTYPES[dtype]
    x = make_inputs(tokens, hc, dim, dt)
    # Check against float32 math on the same (rounded) inputs: in bf16 the eager backward rounds every
    # intermediate, so the fused kernels (float32 inside) must be at least about as close as eager is.
    as_fp32 = {k: v.float() if v.is_floating_point() else v for k, v in x.items()}
    truth = [t.detach() for t in step(reference.gate, as_fp32, True)]
    fused = step(kernels.fused_gate, x, True)
    eager = step(reference.gate, x, True)
    for name, a, e, t in zip(("out", "gates", "dh", "dkv", "dw"), fused, eager, truth, strict=True):
        err_fused = float((a.detach().float() - t).abs().max())
        err_eager = float((e.detach().float() - t).abs().max())
        floor = 1e-4 * max(1.0, float(t.abs().max()))
        if err_fused > max(2 * err_eager, floor):
            raise AssertionError(
                f"fused {name} is off by {err_fused:.3g} where eager is off by {err_eager:.3g}"
            )

    el = torch.finfo(dt).bits // 8
    act = tokens * hc * dim * el  # one (tokens, hc, dim) tensor
    vec = tokens * dim * el  # one (tokens, dim) tensor
    fwd_bytes = 3 * act + vec  # read h, key; write out; read v
    bwd_bytes = fwd_bytes + 5 * act + 2 * vec  # + read dout, h, key; write dh, dkey; read v, write dv
    results = []
    for label, backward, nbytes in (("forward", False, fwd_bytes), ("forward + backward", True, bwd_bytes)):
        t_fused = cuda_ms(lambda backward=backward: step(kernels.fused_gate, x, backward), repeats)
        t_eager = cuda_ms(lambda backward=backward: step(reference.gate, x, backward), repeats)
        results.append(
            {
                "op": f"gate {label}, {tokens} tokens x hc {hc} x dim {dim}, {dtype}",
                "fused_ms": t_fused,
                "eager_ms": t_eager,
                "fused_gb_per_s": nbytes / t_fused / 1e6,
                "eager_gb_per_s": nbytes / t_eager / 1e6,
                "baseline": "eager torch (Engram._forward_v41)",
                "ratio": t_eager / t_fused,
                "device": torch.cuda.get_device_name(),
            }
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hc", type=int, default=4)
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gate: no CUDA device here; the fused gate runs on CUDA only (nothing measured)")
        return
    if not kernels.triton_available():
        print("bench_gate: triton does not import here: `pip install -e .[gpu]` (nothing measured)")
        return
    results = run(args.tokens, args.hc, args.dim, args.dtype, args.repeats)
    print(f"device: {results[0]['device']}")
    for r in results:
        print(
            f"{r['op']:<58} fused {r['fused_ms']:7.3f} ms {r['fused_gb_per_s']:7.1f} GB/s | "
            f"eager {r['eager_ms']:7.3f} ms {r['eager_gb_per_s']:7.1f} GB/s | ratio {r['ratio']:5.2f}x"
        )


if __name__ == "__main__":
    main()
