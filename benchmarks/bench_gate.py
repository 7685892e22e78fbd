"""The V4.1 gate after wkv on CUDA: the fused Triton kernels (`engram.kernels.fused_gate`, forward and
backward) against the eager torch code of `Engram._forward_v41` (`engram.kernels.reference.gate`),
measured in the same run on the same tensors.

    python benchmarks/bench_gate.py [--tokens 8192] [--hc 4] [--dim 5120] [--dtype bf16] [--repeats 20]

Inputs are shaped as in the module: h (1, tokens, hc, dim), key and v views of one wkv output
(1, tokens, hc+1, dim), w (hc, dim), 1% dead tokens. Prints milliseconds (median of `repeats`, CUDA
events) of forward and of forward + backward, the GB/s of the tensors each must at least read and
write, and the ratio (eager time / fused time: > 1 means the fused kernels are faster). Both are
first checked against float64 math on the same inputs: every output within `BOUND` units of its
dtype's rounding times `rounding_scales` (the conditioning of the gate's two sums over dim). Needs a
CUDA device and triton; on a CPU it prints why it cannot run and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from engram import kernels
from engram.kernels import reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("out", "gates", "dh", "dkv", "dw")  # what `step` returns with backward, in this order
# A correct float computation of the gate, in any summation order, stays within this many units of
# rounding times `rounding_scales` (measured: eager fp32 and bf16 at most 2, the interpreted fused
# kernels 2.3, at dim 5120); a wrong formula, a lost term or a low-precision dot is far outside.
BOUND = 16.0


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


def rounding_scales(
    h: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dead: torch.Tensor | None,
    dout: torch.Tensor,
    dgates: torch.Tensor,
    eps: float = 1e-6,
    clamp: float = 1e-6,
) -> tuple[torch.Tensor, ...]:
    """How far a float computation of the gate may be off, per element of (out, gates, dh, dkv, dw) in
    units of its rounding: computed in float64 from the inputs and the incoming gradients dout (B, T,
    hc, dim) and dgates (B, T, hc); dkv is the gradient of the (B, T, hc + 1, dim) tensor whose views
    key and v are. A part that goes through the gate's z scales by 1 + kappa, kappa being the condition
    numbers of the two sums over dim that can cancel: sum|h w key| / |dot| (a small |z| is a dot that
    cancelled, where the slope 1 / (2 sqrt|z|) of the gradient is steep) and the same for dg."""
    h, key, v, w, dout, dgates = (t.detach().double() for t in (h, key, v, w, dout, dgates))
    dim = h.shape[-1]
    tiny = torch.finfo(torch.float64).tiny
    terms = h * w * key  # (B, T, hc, dim)
    dot = terms.sum(-1)
    rh = torch.rsqrt(h.pow(2).mean(-1) + eps)
    rk = torch.rsqrt(key.pow(2).mean(-1) + eps)
    z = dot * rh * rk * dim**-0.5
    g = torch.sigmoid(torch.copysign(z.abs().clamp_min(clamp).sqrt(), z))
    if dead is not None:
        g = g.masked_fill(dead[..., None], 0.0)
    dout_v = dout * v[:, :, None]
    dg = dout_v.sum(-1) + dgates
    slope = torch.where(z.abs() >= clamp, g * (1 - g) / (2 * z.abs().clamp_min(clamp).sqrt()), 0.0)
    a = dg * slope * rh * rk * dim**-0.5
    amp = 1 + terms.abs().sum(-1) / dot.abs().clamp_min(tiny)
    amp = amp + (dout_v.abs().sum(-1) + dgates.abs()) / dg.abs().clamp_min(tiny)
    amp, a, g = amp[..., None], a[..., None], g[..., None]
    b_h = -a * dot[..., None] * rh[..., None] ** 2 / dim
    b_k = -a * dot[..., None] * rk[..., None] ** 2 / dim
    out = h.abs() + amp * (g * v[:, :, None]).abs()
    dh = dout.abs() + amp * ((a * w * key).abs() + (b_h * h).abs())
    dk = amp * ((a * w * h).abs() + (b_k * key).abs())
    dv = (amp * (g * dout).abs()).sum(2, keepdim=True)
    dw = (amp * (a * h * key).abs()).sum((0, 1))
    return out, (amp * g)[..., 0], dh, torch.cat([dk, dv], 2), dw


def error_units(got: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest |got - truth| / (u * scale), u the unit rounding of got's dtype (eps / 2)."""
    err = (got.detach().double() - truth).abs()
    u = torch.finfo(got.dtype).eps / 2
    return float(torch.where(err == 0, 0.0, err / (u * scale)).max())


def float64_errors(
    x: dict[str, torch.Tensor], got: tuple[torch.Tensor, ...], chunk: int = 1024
) -> list[float]:
    """error_units of each of `step(fn, x, True)`'s outputs `got` against float64 math on the same
    inputs, taken over chunks of tokens (the float64 graph of a whole 8192-token batch is ~20 GB)."""
    hc, tokens = x["h"].shape[2], x["h"].shape[1]
    worst = [0.0] * 4
    dw_truth = dw_scale = torch.zeros((), dtype=torch.float64)  # sums over the chunks
    for t0 in range(0, tokens, chunk):
        part = {k: v[:, t0 : t0 + chunk] for k, v in x.items() if k != "w"}
        x64 = {k: v.double() if v.is_floating_point() else v for k, v in {**part, "w": x["w"]}.items()}
        truth = step(reference.gate, x64, True)
        kv = x64["kv"]
        ones = torch.ones_like(x64["h"])
        scales = rounding_scales(
            x64["h"], kv[:, :, :hc], kv[:, :, hc], x64["w"], x64["dead"], ones, ones[..., 0]
        )
        for i in range(4):
            worst[i] = max(worst[i], error_units(got[i][:, t0 : t0 + chunk], truth[i].detach(), scales[i]))
        dw_truth, dw_scale = dw_truth + truth[4].detach(), dw_scale + scales[4]
    return [*worst, error_units(got[4], dw_truth, dw_scale)]


def run(
    tokens: int = 8192, hc: int = 4, dim: int = 5120, dtype: str = "bf16", repeats: int = 20
) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA device (the fused gate is a Triton kernel)")
    dt = DTYPES[dtype]
    x = make_inputs(tokens, hc, dim, dt)
    errors = {
        name: float64_errors(x, step(fn, x, True))
        for name, fn in (("fused", kernels.fused_gate), ("eager", reference.gate))
    }
    for i, name in enumerate(OUTPUTS):
        if errors["fused"][i] > BOUND:
            raise AssertionError(
                f"fused {name} is off by {errors['fused'][i]:.3g} units of {dtype} rounding x conditioning "
                f"(eager: {errors['eager'][i]:.3g}; a correct kernel stays within {BOUND:g})"
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
