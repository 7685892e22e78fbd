"""Every compiled path of engram, each with a plain twin it is tested against.

CPU (numba): `cpu_hash` (its reductions in `cpu_modulo`), `cpu_lookup`, `cpu_lookup_int`, `cpu_cache`, `cpu_gate`, `cpu_sinkhorn`, run over
the cores by `threads`. CUDA (Triton): `hash_rows`, the decode step on a packed stream state
(`stream_hash`, `stream_commit`; its layout in `stream_state`), `fp8_gather` (with `dedup_order`),
`int_gather`, the device-indexed cache's `cache_lookup` and `copy_rows`, `fused_gate`, and the passes
of the Sinkhorn-balanced table update (`sinkhorn_blend`, `sinkhorn_rows`, `sinkhorn_cols_rows`,
`sinkhorn_apply`), with their torch twins in `reference`.
Importing this package imports neither numba nor triton: CPU kernel modules are imported where
they are needed, the Triton entries load through the lazy names below on first use (under
triton's interpreter on a CPU when TRITON_INTERPRET=1 is set first). Design: docs/kernels.md.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engram.kernels.triton_gate import fused_gate
    from engram.kernels.triton_hash import hash_rows, stream_commit, stream_hash
    from engram.kernels.triton_lookup import dedup_order, fp8_gather, int_gather
    from engram.kernels.triton_rows import cache_lookup, copy_rows
    from engram.kernels.triton_sinkhorn import (
        sinkhorn_apply,
        sinkhorn_blend,
        sinkhorn_cols_rows,
        sinkhorn_rows,
    )

__all__ = [
    "cache_lookup",
    "copy_rows",
    "dedup_order",
    "fp8_gather",
    "fused_gate",
    "hash_rows",
    "int_gather",
    "sinkhorn_apply",
    "sinkhorn_blend",
    "sinkhorn_cols_rows",
    "sinkhorn_rows",
    "stream_commit",
    "stream_hash",
    "triton_available",
    "use_triton",
]

# name -> the module that defines it (imported, with triton, on first access)
_TRITON_ENTRIES = {
    "hash_rows": "triton_hash",
    "stream_hash": "triton_hash",
    "stream_commit": "triton_hash",
    "fp8_gather": "triton_lookup",
    "int_gather": "triton_lookup",
    "dedup_order": "triton_lookup",
    "copy_rows": "triton_rows",
    "cache_lookup": "triton_rows",
    "fused_gate": "triton_gate",
    "sinkhorn_blend": "triton_sinkhorn",
    "sinkhorn_rows": "triton_sinkhorn",
    "sinkhorn_cols_rows": "triton_sinkhorn",
    "sinkhorn_apply": "triton_sinkhorn",
}


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


def __getattr__(name: str) -> Any:
    """The Triton entry points, imported on first access (module attributes, PEP 562)."""
    module = _TRITON_ENTRIES.get(name)
    if module is None:
        raise AttributeError(f"module 'engram.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engram.kernels.{module}"), name)
    globals()[name] = value  # later accesses are plain lookups
    return value
