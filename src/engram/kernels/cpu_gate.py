"""The V4.1 context gate (SPEC §6) as one numba kernel: the CPU path of `Engram` when no gradient is
needed (inference, evaluation, `generate()`).

`gate` computes what `engram.kernels.reference.gate` computes (its eager twin, which training
uses), reading each position's stream, key and value once instead of through some twenty torch
operations: one decode step of a batch of 8 costs a few microseconds instead of about a hundred.
Sums are taken in float64 and rounded once, so results agree with the twin to float32 rounding, not
bit for bit; every call without gradients goes through it, whatever the number of positions, so a
sequence scored whole and the same sequence decoded token by token see the same gate.
Compiles on first call (cached on disk). Design: docs/kernels.md.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from engram.kernels.reference import check_gate_inputs
from engram.kernels.threads import resolve_threads, run_chunks

__all__ = ["PARALLEL_MIN", "applies", "gate", "gate_range"]

PARALLEL_MIN = 16_384  # positions from which the kernel splits over every core
_DTYPES = (torch.float32, torch.float64)
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
_NO_DEAD = np.zeros((0, 0), dtype=np.bool_)

_jit = numba.njit(cache=True, nogil=True)


@_jit
def gate_range(h, key, v, w, dead, eps, clamp, out, gates, start, end):  # pragma: no cover - numba
    """Positions start..end (over B*T, batch-major) of h, key (B, T, hc, dim), v (B, T, dim), w (hc,
    dim), dead (B, T) bool (or shape (0, 0): none dead) -> out (B, T, hc, dim) = h + gates * v,
    gates (B, T, hc)."""
    seq, hc, dim = h.shape[1], h.shape[2], h.shape[3]
    scale = 1.0 / math.sqrt(dim)
    has_dead = dead.shape[0] > 0
    for n in range(start, end):
        b, t = n // seq, n % seq
        is_dead = has_dead and dead[b, t]
        for m in range(hc):
            hk = 0.0
            hh = 0.0
            kk = 0.0
            for d in range(dim):
                x = np.float64(h[b, t, m, d])
                k = np.float64(key[b, t, m, d])
                hk += x * np.float64(w[m, d]) * k
                hh += x * x
                kk += k * k
            dot = hk / math.sqrt(hh / dim + eps) / math.sqrt(kk / dim + eps) * scale
            g = 0.0
            if not is_dead:  # sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))
                g = 1.0 / (1.0 + math.exp(-math.copysign(math.sqrt(max(abs(dot), clamp)), dot)))
            gates[b, t, m] = g
            gf = gates[b, t, m]  # the gate in the output dtype, as the twin multiplies with it
            for d in range(dim):
                out[b, t, m, d] = h[b, t, m, d] + gf * v[b, t, d]


def applies(h: torch.Tensor, key: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gate` serves these inputs: all on the CPU, one float32 or float64 dtype, and no
    gradient wanted (grad mode off, or nothing requiring grad)."""
    dtype = h.dtype
    if dtype not in _DTYPES or key.dtype != dtype or v.dtype != dtype or w.dtype != dtype:
        return False
    if not (h.is_cpu and key.is_cpu and v.is_cpu and w.is_cpu):
        return False
    return not (
        torch.is_grad_enabled()
        and (h.requires_grad or key.requires_grad or v.requires_grad or w.requires_grad)
    )


def gate(
    h: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dead: torch.Tensor | None = None,
    eps: float = 1e-6,
    clamp: float = 1e-6,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (B, T, hc, dim), key (B, T, hc, dim), v (B, T, dim), w (hc, dim), dead (B, T) bool or None ->
    (h + gates * v, gates (B, T, hc)), as `engram.kernels.reference.gate`; inputs as `applies`
    accepts (key and v may be views of one `wkv` output). `threads`: None = every core from
    PARALLEL_MIN positions on."""
    if not applies(h, key, v, w):
        raise ValueError(
            "cpu_gate.gate takes CPU float32/float64 tensors of one dtype without gradients; "
            f"got h {h.dtype} on {h.device}, key {key.dtype}, v {v.dtype}, w {w.dtype}"
        )
    check_gate_inputs(h, key, v, w, dead)
    bsz, seq, hc, dim = h.shape
    n = bsz * seq
    dtype = _NUMPY[h.dtype]
    out, gates = np.empty((bsz, seq, hc, dim), dtype), np.empty((bsz, seq, hc), dtype)
    args = (_array(h), _array(key), _array(v), _array(w), _NO_DEAD if dead is None else dead.numpy())
    args += (float(eps), float(clamp), out, gates)
    if threads is None and n < PARALLEL_MIN:  # a decode step: no pool, no chunking
        gate_range(*args, 0, n)
    else:
        run_chunks(gate_range, args, n, resolve_threads(threads, n, PARALLEL_MIN))
    return torch.from_numpy(out), torch.from_numpy(gates)


def _array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (of its data alone when it requires grad)."""
    return (t.detach() if t.requires_grad else t).numpy()
