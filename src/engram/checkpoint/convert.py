"""Making and converting Engram checkpoints: FP8 <-> float tables, and a scaled-down random V4.1
checkpoint for tests, examples and `engram run-layer`. The format itself is `engram.checkpoint.v41`'s;
`engram convert` is `engram.cli`'s. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engram.addressing.layout import Layout
from engram.checkpoint.v41 import DEFAULT_MAX_SHARD_BYTES, TableFormat, load_engram_modules, save_checkpoint
from engram.config import EngramConfig, Variant
from engram.model.module import Engram
from engram.model.table import FP8Table

__all__ = ["convert_table", "make_scaled_v41_checkpoint"]


# ------------------------------------------------------------------------------------------- convert


def convert_table(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    to: TableFormat | str = TableFormat.FP8,
    dtype: torch.dtype = torch.float32,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = False,
) -> list[Path]:
    """Rewrite a checkpoint with FP8 tables (quantised, `to="fp8"`) or float ones (`to="float"`, in `dtype`).

    The source is loaded (and checked) as `load_engram_modules` does; `verify` scans tables of any size
    for NaN / Inf (by default only those up to `SCAN_LIMIT_BYTES`), so damage is not copied on.

    The module weights keep their stored dtypes; config.json is carried over. Returns the shards written.
    FP8 -> float dequantises exactly (float32); float -> FP8 rounds each value to e4m3 within its block's
    power-of-two scale (relative error <= 2**-4 for all but the block's smallest values).
    """
    try:
        fmt = TableFormat(to)
    except ValueError:
        raise ValueError(f"to={to!r}: choose one of {', '.join(f.value for f in TableFormat)}") from None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype={dtype}: a float table is stored as float32, bfloat16 or float16")
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.exists() and src.resolve() == dst.resolve():
        raise ValueError(f"src and dst are the same directory {src}; convert into a new directory")
    config, modules = load_engram_modules(src, mmap=True, dtype=None, verify=verify)
    return save_checkpoint(
        dst, config, modules, fp8=fmt is TableFormat.FP8, max_shard_bytes=max_shard_bytes, float_dtype=dtype
    )


# ------------------------------------------------------------------------------------------- example


def make_scaled_v41_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    base: int = 4096,
    hidden_size: int = 64,
    hc_mult: int = 4,
    seed: int = 0,
    *,
    max_size_tables: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> EngramConfig:
    """Write a scaled-down DeepSeek-V4.1 Engram checkpoint with random weights; return its config.

    The deepseek-v4.1 preset with prime-search base `base` (instead of 16000000) for every order and a small
    `hidden_size`: same layers (1, 14), orders, heads, 256-wide FP8 rows, tensor names and dtypes; the
    compressed vocabulary (99092) and tokenizer are V4.1's, so real DeepSeek-V4 token ids hash into it.
    `max_size_tables` gives every layer the largest layer's row count (the scalar engram_num_embeddings form).
    """
    config = EngramConfig.preset("deepseek-v4.1").replace(
        engram_vocab_size=(base,) * 3,
        hidden_size=hidden_size,
        hc_mult=hc_mult,
        name=f"deepseek-v4.1-scaled-{base}",
    )
    assert config.variant is Variant.V4_1
    layout = Layout(config)
    g = torch.Generator().manual_seed(seed)
    modules: dict[int, Engram] = {}
    for layer_id in config.layer_ids:
        rows = max(layout.num_embeddings) if max_size_tables else layout.layer(layer_id).num_embeddings
        # Row magnitudes spread over ~2 octaves so the ue8m0 scales differ from row to row.
        spread = torch.exp(torch.randn(rows, 1, generator=g) * 0.7)
        weight = torch.randn(rows, config.head_dim, generator=g) * (0.02 * spread)
        module = Engram(config, layer_id, table=FP8Table.from_float(weight))
        with torch.no_grad():
            module.wkv.weight.normal_(0.0, config.engram_dim**-0.5, generator=g)
            module.q_weight.copy_(1.0 + 0.1 * torch.randn(module.q_weight.shape, generator=g))
            module.k_weight.copy_(1.0 + 0.1 * torch.randn(module.k_weight.shape, generator=g))
        modules[layer_id] = module
    save_checkpoint(ckpt_dir, config, modules, fp8=True, max_shard_bytes=max_shard_bytes)
    return config
