"""`engram convert` and `engram run-layer`: checkpoints from the command line.

`convert` rewrites a checkpoint's tables in a row format (FP8, INT8, 4-bit) or as float
(`engram.checkpoint.convert.convert_table`);
`run-layer` runs the V4.1 Engram layers of a checkpoint, or of a scaled one it builds, over a text
(`engram.apps.tools.run_layer.run_layer`) and prints the report. Only argument handling and printing here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from engram.apps.tools.run_layer import DEFAULT_BASE, DEFAULT_HIDDEN_SIZE, DEFAULT_TEXT, run_layer
from engram.checkpoint.convert import convert_table
from engram.checkpoint.folder_lock import write_lock
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.v41 import DEFAULT_MAX_SHARD_BYTES, TableFormat
from engram.cli.options import (
    SIZE_HELP,
    add_verify_option,
    byte_size,
    input_folder,
    output_folder,
    positive_int,
    seed,
    utf8_text,
)

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add convert and run-layer to the `engram` subparsers."""
    p = sub.add_parser(
        "convert",
        help="rewrite a checkpoint's Engram tables in a row format (fp8, int8, int8-row, int4) or as float",
    )
    p.add_argument(
        "src",
        type=input_folder,
        help="checkpoint directory to read (config.json + *.safetensors), or an Engram model's folder "
        "(save_pretrained, hf-train: its engram/ part converted, HF's files copied)",
    )
    p.add_argument("dst", type=output_folder, help="directory to write (created; must differ from src)")
    p.add_argument(
        "--format",
        "--to",
        dest="to",
        choices=[f.value for f in TableFormat],
        default=TableFormat.FP8.value,
        help="how the tables are stored (bytes a 256-wide row): fp8 = V4.1's e4m3 + ue8m0 per 32 (264), "
        "int8 = int8 + a bfloat16 scale per 32 (272), int8-row = one scale a row (258), int4 = 4-bit + a "
        "bfloat16 scale per 32 (144), float (see --dtype); default fp8",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="float table dtype (--format float)",
    )
    p.add_argument(
        "--max-shard-size",
        type=byte_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        help=f"bytes per shard file, e.g. 5GB (the default), 500MB, 2GiB ({SIZE_HELP})",
    )
    p.add_argument(
        "--row-file",
        action="store_true",
        help="also write each layer's quantised table as an SSD row file (engram_layer<L>.rows: one page per "
        "row read)",
    )
    add_verify_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "run-layer",
        help="tokenize, hash and run the Engram layers (1, then 14) of a (scaled) V4.1 checkpoint",
    )
    p.add_argument(
        "--checkpoint",
        type=input_folder,
        help="a checkpoint directory (default: build a scaled-down V4.1 checkpoint in a temporary directory)",
    )
    p.add_argument(
        "--text", type=utf8_text, default=DEFAULT_TEXT, help=f"text to run (default: {DEFAULT_TEXT!r})"
    )
    p.add_argument(
        "--base",
        type=positive_int,
        help=f"prime-search base of the built checkpoint (default {DEFAULT_BASE}; V4.1 uses 16000000)",
    )
    p.add_argument(
        "--hidden-size",
        type=positive_int,
        help=f"residual width of the built checkpoint (default {DEFAULT_HIDDEN_SIZE})",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the built weights and the pseudo-embeddings")
    add_verify_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_run_layer)


def check_has_config(folder: str, what: str) -> None:
    """Refuse a folder without config.json in the CLI's words (the library's says `config=...`, an
    argument the command line does not have): a training run named as such. A missing folder is left
    to the loader."""
    d = Path(folder)
    if path_kind(d) != "a folder" or os.path.lexists(d / "config.json"):
        return
    if path_kind(d / "state.json") == "a file" or os.path.lexists(d / "checkpoints"):
        raise ValueError(
            f"{folder} is a training run of `engram train` (state.json / checkpoints/), not a checkpoint in "
            f"the V4.1 format: {what} reads a folder with config.json + *.safetensors (what `engram convert` "
            "and `engram hf-train` write); a run is read by `engram eval`, `generate` and `quantise-check`"
        )
    raise ValueError(
        f"{folder} has no config.json: {what} reads a checkpoint in the V4.1 format (config.json + "
        "*.safetensors); give its folder, or restore its config.json"
    )


def cmd_convert(args: argparse.Namespace) -> int:
    from engram.apps.hf.convert import convert_model_folder, is_model_folder

    check_has_config(args.src, "engram convert")
    t0 = time.perf_counter()
    options = dict(
        to=args.to,
        dtype=getattr(torch, args.dtype),
        max_shard_bytes=args.max_shard_size,
        verify=args.verify,
        row_file=args.row_file,
    )
    with write_lock(args.dst, f"engram convert {shlex.quote(args.src)} {shlex.quote(args.dst)}"):
        if is_model_folder(args.src):  # an Engram model's folder: HF's files copied, the part converted
            written = convert_model_folder(args.src, args.dst, **options)
        else:
            written = convert_table(args.src, args.dst, **options)
    elapsed = time.perf_counter() - t0
    shards = [p for p in written if p.suffix != ".rows"]
    row_files = [p for p in written if p.suffix == ".rows"]
    size = sum(p.stat().st_size for p in written)
    if args.json:
        print(
            json.dumps(
                {
                    "dst": str(args.dst),
                    "to": args.to,
                    "shards": [p.name for p in shards],
                    "row_files": [p.name for p in row_files],
                    "bytes": size,
                    "seconds": elapsed,
                }
            )
        )
    else:
        print(
            f"wrote {len(shards)} shard(s)"
            + (f" and {len(row_files)} row file(s)" if row_files else "")
            + f", {size / 1e6:.1f} MB, tables as {args.to}, to {args.dst} "
            f"({elapsed:.1f} s)"
        )
    return 0


def cmd_run_layer(args: argparse.Namespace) -> int:
    """0 when every row is in range and every gate in (0, 1), else 1."""
    if args.checkpoint is not None:
        check_has_config(args.checkpoint, "engram run-layer --checkpoint")
    report = run_layer(
        args.checkpoint,
        args.text,
        base=args.base,
        hidden_size=args.hidden_size,
        seed=args.seed,
        verify=args.verify,
    )
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_run_layer_report(report)
    return 0 if report["ok"] else 1


def print_run_layer_report(r: dict[str, Any]) -> None:
    """The readable view of a `run_layer` report."""
    where = r["checkpoint"] or "a scaled V4.1 checkpoint built in a temporary directory"
    print(
        f"{r['config']} ({r['variant']}) from {where}: hc={r['hc']} streams of dim {r['dim']}, "
        f"{r['rows_per_token']} rows per token per layer, compressed vocab {r['compressed_vocab_size']:,}"
    )
    for layer in r["layers"]:
        print(
            f"  layer {layer['layer_id']}: {layer['table']} {layer['table_rows']:,} rows x {layer['row_width']} "
            f"({layer['table_bytes'] / 1e6:.1f} MB, {layer['bytes_read_per_token']:,} B read per token)"
        )
    print(
        f"\n{r['n_tokens']} tokens ({r['tokenizer']} tokenizer); rows checked against each head's [offset, offset + prime)"
    )
    head = f"{'pos':>4} {'token':<14} {'cid':>6}"
    for lid in r["layer_ids"]:
        head += f" | layer {lid}: rows {'':<17} gates per stream"
    print(head)
    for tok in r["tokens"]:
        line = f"{tok['pos']:>4} {tok['text']!r:<14.14} {tok['compressed_id']:>6}"
        for lid in r["layer_ids"]:
            d = tok["layers"][str(lid)]
            status = "ok" if d["rows_ok"] else "OUT OF RANGE"
            span = f"{min(d['rows']):>9}..{max(d['rows']):<9}"
            line += f" | {len(d['rows'])} {status} {span} " + " ".join(f"{g:.3f}" for g in d["gates"])
        print(line)
    deltas = ", ".join(f"layer {layer['layer_id']} {layer['max_abs_delta_h']:.4f}" for layer in r["layers"])
    print(f"\nmax |delta h|: {deltas}; over all layers {r['max_abs_delta_h']:.4f}")
    secs = ", ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
    verdict = "ok" if r["ok"] else "FAILED: " + "; ".join(r["problems"])
    print(f"seconds: {secs}\n{verdict}")
