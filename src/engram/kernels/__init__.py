"""Optional Triton kernels for CUDA, each with a plain torch twin in `engram.kernels.reference`.

Holds:
- `triton_available()`: whether triton imports here (tried once, on the first call).
- `use_triton(*tensors)`: every tensor is on CUDA and triton is available, the test callers use to
  take the kernels (the eager torch code otherwise).
- `hash_rows(...)` (`triton_hash`): compressed ids (B, T) -> rows (B, T, L, orders*K), bit-exact to
  `engram.addressing.hashing`.
- `fp8_gather(...)` (`triton_lookup`): rows of an FP8 e4m3 table with ue8m0 scales -> dequantised
  rows, bit-exact to `engram.storage.lookup.dequantize_gather` for finite values.
- `fused_gate(...)` (`triton_gate`): the V4.1 gate after wkv with its backward, an autograd function.

Importing `engram.kernels` imports neither triton nor the kernel modules: each entry point imports
its module on its first call. On a CPU, the kernels run under triton's interpreter when
TRITON_INTERPRET=1 is set before they are first imported (the tests do that).
"""

from __future__ import annotations

import functools

import torch

from engram.kernels import reference

__all__ = ["fp8_gather", "fused_gate", "hash_rows", "reference", "triton_available", "use_triton"]


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (it is an optional dependency: `pip install engram-lm[gpu]`)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing on import
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device and triton imports."""
    return all(t.is_cuda for t in tensors) and triton_available()


def hash_rows(
    xc: torch.Tensor,
    dead: torch.Tensor | None,
    window: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `engram.kernels.triton_hash.hash_rows`."""
    from engram.kernels.triton_hash import hash_rows as impl

    return impl(xc, dead, window, multipliers, primes, offsets, pad, out)


def fp8_gather(
    values: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `engram.kernels.triton_lookup.fp8_gather`."""
    from engram.kernels.triton_lookup import fp8_gather as impl

    return impl(values, scales, rows, dtype, out)


def fused_gate(
    h: torch.Tensor,
    key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dead: torch.Tensor | None = None,
    eps: float = 1e-6,
    clamp: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `engram.kernels.triton_gate.fused_gate`."""
    from engram.kernels.triton_gate import fused_gate as impl

    return impl(h, key, v, w, dead, eps, clamp)
