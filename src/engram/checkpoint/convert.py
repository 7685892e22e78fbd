"""Making and converting Engram checkpoints: tables in any row format (FP8, INT8, 4-bit) <-> float, the
SSD row files beside them, and a scaled-down random V4.1 checkpoint for tests, examples and
`engram run-layer`. The format itself is `engram.checkpoint.v41`'s;
`engram convert` is `engram.cli`'s. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.files import member_file, open_tensors
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.checkpoint.tokenizer_fit import check_tokenizer_fit
from engram.checkpoint.v41 import (
    DEFAULT_MAX_SHARD_BYTES,
    TableFormat,
    load_engram_modules,
    row_file_name,
    save_checkpoint,
    stored_tables,
)
from engram.config import EngramConfig, Variant
from engram.model.module import Engram
from engram.model.table import FP8Table, QuantTable
from engram.storage.integrity import SCAN_LIMIT_BYTES, table_fingerprint
from engram.storage.rowfile import RowFile, write_row_file

__all__ = [
    "convert_table",
    "make_scaled_v41_checkpoint",
    "open_row_file",
    "row_file_path",
    "write_row_files",
]


# ------------------------------------------------------------------------------------------- convert


def convert_table(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    to: TableFormat | str = TableFormat.FP8,
    dtype: torch.dtype = torch.float32,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = False,
    row_file: bool = False,
) -> list[Path]:
    """Rewrite a checkpoint with quantised tables (`to` a row format: "fp8", "int8", "int8-row", "int4")
    or float ones (`to="float"`, in `dtype`).

    `row_file`: also write each layer's quantised table as an SSD row file (`write_row_files`). Row files
    an earlier conversion left in `dst_dir` are removed either way (they describe that one's tables), as
    are the temporaries of a conversion killed there (`save_checkpoint`); a failed write removes its own.

    The source is loaded (and checked) as `load_engram_modules` does; `verify` scans tables of any size
    for NaN / Inf (by default only those up to `SCAN_LIMIT_BYTES`), so damage is not copied on.

    The module weights keep their stored dtypes; config.json is carried over. Returns the shards written.
    Quantised -> float dequantises (float32: exactly); float -> FP8 rounds each value to e4m3 within its
    block's power-of-two scale (relative error <= 2**-4 for all but the block's smallest values), float
    -> INT8 / 4-bit to an integer times its block's (or row's) bfloat16 scale (error <= half a scale); a
    quantised table goes to another row format through float32, chunk by chunk (docs/storage.md).
    """
    try:
        fmt = TableFormat(to)
    except ValueError:
        raise ValueError(
            f"format {to!r} is not one engram writes: choose one of {', '.join(f.value for f in TableFormat)}"
        ) from None
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype={dtype}: a float table is stored as float32, bfloat16 or float16")
    if row_file and fmt is TableFormat.FLOAT:
        raise ValueError(
            "row files hold quantised rows: --row-file needs --format fp8, int8, int8-row or int4"
        )
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.exists() and src.resolve() == dst.resolve():
        raise ValueError(f"src and dst are the same directory {src}; convert into a new directory")
    config, modules = load_engram_modules(src, mmap=True, dtype=None, verify=verify)
    check_tokenizer_fit(src, config)  # as `engram run-layer` checks it: a config its tokenizer contradicts
    shards = save_checkpoint(
        dst,
        config,
        modules,
        fp8=fmt is not TableFormat.FLOAT,
        max_shard_bytes=max_shard_bytes,
        float_dtype=dtype,
        row_format=fmt.row_format,
    )
    return shards + (write_row_files(dst) if row_file else [])


# ------------------------------------------------------------------------------------------- row files


def row_file_path(ckpt_dir: str | os.PathLike[str], layer_id: int) -> Path:
    """Where a checkpoint keeps layer `layer_id`'s row file."""
    return Path(ckpt_dir) / row_file_name(layer_id)


def write_row_files(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Write a row file beside a checkpoint of quantised tables (any row format) for each of its layers,
    from the stored bytes; returns them.

    Each records the layout fingerprint and the fingerprint of the table it was copied from (the one
    the checkpoint records, else computed from the bytes), which `open_row_file` checks."""
    config, modules = load_engram_modules(ckpt_dir, mmap=True, dtype=None)
    _, stored = stored_tables(ckpt_dir, config)
    layout_fp = layout_fingerprint(Layout(config))
    out = []
    for layer_id, module in modules.items():
        table = module.table
        if not isinstance(table, QuantTable | MmapQuantTable):
            raise ValueError(
                f"{ckpt_dir}: layer {layer_id} has a {type(table).__name__}, not a quantised table; convert it "
                "with --format fp8 (or int8, int8-row, int4) first"
            )
        tables_fp = stored[layer_id].fingerprint or table_fingerprint(table.weight, table.scale)
        path = row_file_path(ckpt_dir, layer_id)
        out.append(
            write_row_file(
                path,
                table.weight,
                table.scale,
                layer_id=layer_id,
                identity=layout_fp,
                tables=tables_fp,
                label=config.name,
                fmt=table.row_format,
            )
        )
    return out


def open_row_file(
    ckpt_dir: str | os.PathLike[str],
    layer_id: int,
    *,
    direct: bool = False,
    io_threads: int = 1,
    verify: bool = False,
) -> RowFile:
    """Layer `layer_id`'s row file of the checkpoint `ckpt_dir`, checked against it: its rows, width and
    layer, the layout fingerprint and the fingerprint of the table it was written from (a file written
    for another checkpoint, even one of the same layout, raises, naming both values and the fix). The
    file must be a regular file inside the folder (no link out of it); its rows are scanned for NaN
    bytes as the checkpoint's tables are (by size, always with `verify`).

    The checkpoints `engram convert` writes record their tables' fingerprints; for one that does not
    (DeepSeek's own), the table's bytes are hashed: tables up to `SCAN_LIMIT_BYTES`, any with `verify`
    (else a warning says the row file was not matched to the table)."""
    ckpt_dir = Path(ckpt_dir)
    config, stored = stored_tables(ckpt_dir)
    if layer_id not in config.layer_ids:
        raise ValueError(
            f"layer_id={layer_id} is not an Engram layer of {ckpt_dir} (layers {list(config.layer_ids)})"
        )
    if layer_id not in stored:
        raise ValueError(
            f"{ckpt_dir}: layer {layer_id}'s table is a float table; row files hold quantised rows: convert "
            "with `engram convert SRC DST --format fp8 --row-file` (or int8, int8-row, int4)"
        )
    table = stored[layer_id]
    name = row_file_path(ckpt_dir, layer_id).name
    try:  # a plain file inside the folder, as every file a checkpoint names
        path = member_file(ckpt_dir, name, f"layer {layer_id}'s row file")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{ckpt_dir / name}: no row file; write it with `engram convert SRC DST --row-file`"
        ) from None
    tables_fp = table.fingerprint
    if tables_fp is None:
        f = open_tensors(table.weight.path)
        w = f.mapped(table.weight.name)
        s = open_tensors(table.scale.path).mapped(table.scale.name)
        nbytes = w.numel() * w.element_size() + s.numel() * s.element_size()
        if nbytes <= SCAN_LIMIT_BYTES or verify:
            tables_fp = table_fingerprint(w, s)
        else:
            warnings.warn(
                f"{path} was not matched to the table it was written from: {table.weight.path} records no "
                f"table fingerprint and hashing its {nbytes / 2**30:.1f} GiB is done only with verify=True; "
                "`engram convert` writes a checkpoint that records it",
                stacklevel=2,
            )
    return RowFile(
        path,
        expect_rows=table.weight.shape[0],
        expect_dim=config.head_dim,
        expect_identity=layout_fingerprint(Layout(config)),
        expect_tables=tables_fp,
        expect_layer_id=layer_id,
        expect_format=table.row_format,
        direct=direct,
        io_threads=io_threads,
        verify=verify,
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
    if max_size_tables:  # config.json then declares the scalar form: every table that many rows
        config = config.replace(declared_num_embeddings=max(layout.num_embeddings))
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
