"""`engram quantise-check`: a trained model's held-out loss and accuracy with its Engram tables in each
row format, against the float tables, as a report or a gate (engram.apps.tools.quantise_check)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from engram.apps.tools.quantise_check import NGRAM_MAX
from engram.cli.hf import block_length, fraction
from engram.cli.options import (
    add_device_options,
    device_from_args,
    input_file,
    input_folder,
    non_negative_int,
    positive_int,
    set_threads,
    threads,
    whole_number,
)
from engram.rowformat.formats import RowFormat, as_row_format

__all__ = ["register"]

GATE_FAILED = 1  # the exit status when a format costs more than --max-loss-increase


def format_list(text: str) -> tuple[RowFormat, ...]:
    """argparse type of --formats: row format names, comma-separated ('fp8,int8,int4')."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        known = ",".join(f.value for f in RowFormat)
        raise argparse.ArgumentTypeError(f"{text!r} names no format; give e.g. {known}")
    try:
        return tuple(dict.fromkeys(as_row_format(n, "--formats") for n in names))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def loss_increase(text: str) -> float:
    """argparse type of --max-loss-increase: nats/token, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give nats/token, e.g. 0.01") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a finite number >= 0 (nats/token)")
    return value


def cmd_quantise_check(args: argparse.Namespace) -> int:
    from engram.apps.tools.quantise_check import check_folder, check_ngram, comparable
    from engram.apps.tools.quantise_report import format_report, format_summary, gate_failures, seed_summary

    # every folder read before any work: one kind, each once, configs equal but for the seed, --ngram
    # no longer than their blocks
    for record in comparable(args.folders, args.seq_len):
        check_ngram(args.ngram, record)
    device, precision = device_from_args(args)
    set_threads(args)
    results = []
    for folder in args.folders:
        results.append(
            check_folder(
                folder,
                args.formats,
                top=args.worst,
                ngram=args.ngram,
                batch_size=args.batch_size,
                max_tokens=args.max_tokens,
                corpus=args.corpus,
                held_text=args.held_text,
                seq_len=args.seq_len,
                held_out=args.held_out,
                max_blocks=args.max_blocks,
                device=device,
                precision=precision,
            )
        )
        if not args.json:
            print("\n".join(format_report(results[-1])), flush=True)
    summary = seed_summary(results) if len(results) > 1 else None
    failed = [] if args.max_loss_increase is None else gate_failures(results, args.max_loss_increase)
    if args.json:
        out: dict[str, Any] = {"folders": results, "seed_summary": summary}
        if args.max_loss_increase is not None:
            out["gate"] = {"max_loss_increase": args.max_loss_increase, "failed": failed}
        print(json.dumps(out))
    elif summary is not None:
        print("\n".join(format_summary(summary, len(results))))
    for line in failed:
        print(f"engram quantise-check: gate: {line}", file=sys.stderr)
    if args.max_loss_increase is not None and not failed and not args.json:
        print(f"gate passed: no format raises the held-out loss by more than {args.max_loss_increase:g}")
    return GATE_FAILED if failed else 0


def register(sub: Any) -> None:
    known = ",".join(f.value for f in RowFormat)
    p = sub.add_parser(
        "quantise-check",
        help="held-out loss and accuracy of a trained model with its Engram tables in each row format",
        description="Quantise the trained Engram tables of each FOLDER to every row format of --formats and "
        "score the model on held-out text: bytes a row, V4.1's tables in GB, held-out loss and its change "
        "against the float tables, next-token accuracy split into memory (the n-gram ending at the target "
        "occurs in the training text) and generalisation, the rows with the largest error. Several FOLDERs "
        "(seeds of one model) add each format's loss change against the float table's seed spread. "
        f"Exit status: 0, or {GATE_FAILED} when a format raises the loss more than --max-loss-increase, "
        "2 for input refused.",
    )
    p.add_argument(
        "folders",
        nargs="+",
        type=input_folder,
        metavar="FOLDER",
        help="a training run (`engram train --out`) or an engram.hf folder (`engram hf-train --out`)",
    )
    p.add_argument(
        "--formats",
        type=format_list,
        default=tuple(RowFormat),
        help=f"row formats to check, comma-separated (default all: {known}); the float table is always "
        "the reference",
    )
    p.add_argument(
        "--max-loss-increase",
        type=loss_increase,
        metavar="NATS",
        help=f"a gate: exit {GATE_FAILED} naming each format (and folder) whose held-out loss rises more "
        "than this many nats/token over the float tables'",
    )
    p.add_argument(
        "--worst", type=non_negative_int, default=5, help="rows of largest error listed (default 5)"
    )
    p.add_argument(
        "--ngram",
        type=whole_number(2, NGRAM_MAX, " (and at most the block length)"),
        help="the memory probe's n-gram: context tokens and the target, from 2 to the block length and at "
        f"most {NGRAM_MAX} (default: Engram's longest key + 1)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, help="sequences a forward (default: 32 for a run, 8 HF)"
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        help="a training run: score a fixed sample of about N held-out tokens (default: all, as `engram eval`)",
    )
    p.add_argument(
        "--corpus",
        type=input_file,
        help="an HF folder: the training corpus, its held-out blocks split as hf-train split it (default: "
        "the one its engram_train.json records)",
    )
    p.add_argument(
        "--held-text",
        type=input_file,
        help="an HF folder: a held-out text file to score instead (the whole corpus is then the training "
        "text; for `study pretrained` runs: OUT/corpus/held.txt)",
    )
    p.add_argument(
        "--held-out", type=fraction, help="an HF folder: the corpus's held-out fraction (default: the run's)"
    )
    p.add_argument(
        "--seq-len",
        type=block_length,
        help="an HF folder: block length, 2 or more (default: the run's, else 128)",
    )
    p.add_argument(
        "--max-blocks",
        type=non_negative_int,
        help="an HF folder: held-out blocks scored (default: the run's eval_blocks, else 64; 0: all)",
    )
    add_device_options(p, "evaluate")
    p.add_argument("--threads", type=threads, help="torch threads (default: one per idle core)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_quantise_check)
