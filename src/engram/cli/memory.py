"""`engram memorize` (facts written into an HF model folder's Engram rows, as a memory patch file) and
`engram patch info` / `engram patch check` (what a patch file holds; whether a folder's model takes
patches): `engram.apps.memory` runs them on `engram.memory`. Only option checks, the run and the
printing here. `--patch` of `hf-eval` and `generate` is theirs (`engram.cli.hf`, `engram.cli.generate`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from engram.cli.options import (
    add_verify_option,
    input_file,
    input_folder,
    output_file,
    positive_float,
    positive_int,
    positive_or_all,
    seed,
    set_threads,
    threads,
)
from engram.memory import MemorizeSettings, ReaderSettings, RowChoice

__all__ = ["register"]

DEFAULTS = MemorizeSettings()
READER = ReaderSettings()


def rows_cap(text: str) -> int | None:
    """--rows-per-fact: a whole number >= 1, or 'all' (None: every chosen row)."""
    return None if text.strip().lower() == "all" else positive_int(text)


PATCH_CHECK_HELP = "whether an HF model folder's model takes memory patches, applied in the order given"
PATCH_INFO_HELP = "what a memory patch file holds: facts, rows per layer, bytes, row format, fingerprint"


def register(sub: Any) -> None:
    """Add `memorize` and `patch info|check` to the `engram` subparsers."""
    p = sub.add_parser(
        "memorize",
        help="write facts (a JSONL file) into an HF model folder's Engram rows, as a memory patch file",
    )
    p.add_argument(
        "folder", type=input_folder, help="an HF model folder with its Engram part (hf-train's --out)"
    )
    p.add_argument(
        "--facts",
        type=input_file,
        required=True,
        metavar="FACTS.jsonl",
        help='a JSONL file, one fact a line: {"prompt": ..., "target": " answer"}, optional "subject"',
    )
    p.add_argument(
        "--out",
        type=output_file,
        required=True,
        metavar="PATCH.safetensors",
        help="the patch file to write (a new file: *.safetensors)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULTS.steps,
        metavar="N",
        help=f"passes over the facts (default {DEFAULTS.steps})",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=DEFAULTS.lr,
        metavar="X",
        help=f"Adam learning rate on the rows (default {DEFAULTS.lr:g})",
    )
    p.add_argument(
        "--rows",
        choices=[c.value for c in RowChoice],
        default=DEFAULTS.choice.value,
        help="which rows carry a fact: those before the answer, those of its subject's n-grams, or both "
        f"(default {DEFAULTS.choice.value})",
    )
    p.add_argument(
        "--reference",
        type=input_file,
        metavar="TEXTFILE",
        help='a UTF-8 text file (or JSONL with a "text" field, as hf-eval\'s --corpus) whose rows no fact '
        "takes: text that must read none of the patch (e.g. the corpus Engram was trained on: common text "
        "then reads few of the patch's rows)",
    )
    p.add_argument(
        "--reference-tokens",
        type=positive_or_all,
        metavar="N",
        help="the --reference text's first N tokens, or 'all' (default: a layer's rows per hash head, "
        "rounded down to a power of two: text that reads about as many rows as a head has)",
    )
    p.add_argument("--name", help="the patch's name (default: the --out file's name less .patch.safetensors)")
    _fitting_options(p, DEFAULTS)
    p.set_defaults(func=cmd_memorize)

    p = sub.add_parser(
        "train-reader",
        help="train an HF model folder's Engram readers on training facts, so that memory patches written "
        "afterwards hold facts; writes a new model folder",
    )
    p.add_argument(
        "folder", type=input_folder, help="an HF model folder with its Engram part (hf-train's --out)"
    )
    p.add_argument(
        "--facts",
        type=input_file,
        required=True,
        metavar="FACTS.jsonl",
        help="training facts, as engram memorize reads them (other facts than those you will memorize)",
    )
    p.add_argument("--out", required=True, help="the model folder to write (new or empty)")
    p.add_argument(
        "--text",
        type=input_file,
        metavar="TEXTFILE",
        help='a UTF-8 text file (or JSONL with a "text" field), e.g. the corpus Engram was trained on: its LM '
        "loss keeps the model's other behaviour (recommended)",
    )
    p.add_argument(
        "--passes",
        type=positive_int,
        default=READER.passes,
        metavar="N",
        help=f"passes over the facts (default {READER.passes})",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=READER.lr,
        metavar="X",
        help=f"Adam learning rate on the readers (default {READER.lr:g})",
    )
    p.add_argument(
        "--row-lr",
        type=positive_float,
        default=READER.row_lr,
        metavar="X",
        help=f"Adam learning rate on the training facts' rows, which are dropped after (default {READER.row_lr:g})",
    )
    p.add_argument(
        "--text-weight",
        type=positive_float,
        default=READER.text_weight,
        metavar="X",
        help=f"weight of the text's loss beside the facts' (default {READER.text_weight:g})",
    )
    _fitting_options(p, READER)
    p.set_defaults(func=cmd_train_reader)

    patch = sub.add_parser(
        "patch", help="memory patch files: what one holds (info), what fits a model (check)"
    )
    what = patch.add_subparsers(dest="patch", metavar="WHAT", required=True)
    p = what.add_parser("info", help=PATCH_INFO_HELP)
    p.add_argument(
        "patch_file", type=input_file, metavar="PATCH", help="a patch file (engram memorize --out)"
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=cmd_patch_info)
    p = what.add_parser("check", help=PATCH_CHECK_HELP)
    p.add_argument("folder", type=input_folder, help="an HF model folder with its Engram part")
    p.add_argument("patches", nargs="+", metavar="PATCH", help="patch files, applied in this order")
    p.add_argument("--threads", type=threads, metavar="N", help="torch threads (default: the idle cores)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_verify_option(p)
    p.set_defaults(func=cmd_patch_check)


def _fitting_options(p: argparse.ArgumentParser, defaults: MemorizeSettings | ReaderSettings) -> None:
    """The options `memorize` and `train-reader` share (the rows a fact, batches, order, threads, output,
    --verify), with `defaults`' values."""
    p.add_argument(
        "--rows-per-fact",
        type=rows_cap,
        default=defaults.rows_per_fact,
        metavar="N",
        help=f"at most N rows a fact in each layer, or 'all': every row chosen (default {defaults.rows_per_fact})",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        metavar="N",
        help=f"facts a step (default {defaults.batch_size})",
    )
    p.add_argument(
        "--seed",
        type=seed,
        default=defaults.seed,
        metavar="N",
        help=f"the order of the facts (default {defaults.seed})",
    )
    p.add_argument("--threads", type=threads, metavar="N", help="torch threads (default: the idle cores)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verify_option(p)


def cmd_memorize(args: argparse.Namespace) -> int:
    from engram.apps.memory.memorize import memorize_folder

    if args.reference_tokens is not None and args.reference is None:
        n = args.reference_tokens or "all"
        raise ValueError(
            f"--reference-tokens {n}: give --reference FILE too (the text whose first tokens no fact takes)"
        )

    settings = MemorizeSettings(
        choice=RowChoice(args.rows),
        rows_per_fact=args.rows_per_fact,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    set_threads(args)
    with _bars(not args.no_progress, args.steps) as progress:
        r = memorize_folder(
            args.folder,
            args.facts,
            args.out,
            settings,
            reference=args.reference,
            reference_tokens=args.reference_tokens,
            name=args.name,
            progress=progress,
            verify=args.verify,
        )
    if args.json:
        print(json.dumps(r))
    else:
        layers = ", ".join(f"layer {k}: {n:,}" for k, n in r["rows_per_layer"].items())
        print(
            f"{r['patch']}: {r['facts']:,} facts in {r['rows']:,} rows ({layers}), {r['bytes']:,} bytes "
            f"({r['bytes_per_fact']:,.0f} a fact); loss {r['loss_first']:.4f} -> {r['loss']:.4f} after "
            f"{r['steps']} passes, {r['seconds']:.1f} s"
        )
    return 0


def cmd_train_reader(args: argparse.Namespace) -> int:
    from engram.apps.memory.reader import train_reader_folder

    settings = ReaderSettings(
        passes=args.passes,
        lr=args.lr,
        row_lr=args.row_lr,
        rows_per_fact=args.rows_per_fact,
        batch_size=args.batch_size,
        text_weight=args.text_weight,
        seed=args.seed,
    )
    set_threads(args)
    with _bars(not args.no_progress, args.passes, "train-reader") as progress:
        r = train_reader_folder(
            args.folder, args.facts, args.out, settings, text=args.text, progress=progress, verify=args.verify
        )
    if args.json:
        print(json.dumps(r))
    else:
        text = (
            ""
            if r["text_loss"] is None
            else f"; text loss {r['text_loss_first']:.4f} -> {r['text_loss']:.4f}"
        )
        print(
            f"{r['out']}: readers trained on {r['facts']:,} facts, loss {r['loss_first']:.4f} -> {r['loss']:.4f} "
            f"after {r['passes']} passes{text}, {r['seconds']:.1f} s; write patches for this folder"
        )
    return 0


@contextlib.contextmanager
def _bars(shown: bool, passes: int, what: str = "memorize") -> Iterator[Callable[[int, float], None] | None]:
    """The progress bar of `engram memorize` (a tick a pass, the loss beside it; drawn from the first
    pass on, once the model is loaded) and transformers' loading bars, shown or not: yields the callback
    `memorize` takes, or None."""
    import transformers.utils.logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    bars: list[Any] = []

    def progress(step: int, loss: float) -> None:
        if not bars:
            from tqdm.auto import tqdm

            bars.append(
                tqdm(total=passes, desc=what, unit="pass", mininterval=0.5 if sys.stderr.isatty() else 10)
            )
        bars[0].update(step - bars[0].n)
        bars[0].set_postfix(loss=f"{loss:.3f}")

    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield progress if shown else None
    finally:
        if bars:
            bars[0].close()
        if was and not shown:
            hf_logging.enable_progress_bar()


def cmd_patch_info(args: argparse.Namespace) -> int:
    from engram.apps.memory.files import describe, read_patches

    d = describe(read_patches([args.patch_file])[0])
    if args.json:
        print(json.dumps(d))
        return 0
    layers = ", ".join(f"layer {k}: {n:,} of {d['table_rows'][k]:,}" for k, n in d["rows_per_layer"].items())
    print(f"{d['path']}: memory patch {d['name']!r}")
    print(f"  facts        {d['facts']:,}")
    print(f"  rows         {d['rows']:,} ({layers})")
    print(
        f"  bytes        {d['bytes']:,} ({d['row_bytes']:,} of rows; {d['bytes'] / max(d['facts'], 1):,.0f} a fact)"
    )
    print(f"  row format   {d['row_format']}, {d['dim']} values a row")
    print(f"  fingerprint  {d['fingerprint']}")
    print(f"  fits         layout {d['layout'][:12]}, tokenizer {d['tokenizer'][:12]}")
    return 0


def cmd_patch_check(args: argparse.Namespace) -> int:
    from engram.apps.memory.memorize import check_patches

    set_threads(args)
    results = check_patches(args.folder, args.patches, verify=args.verify)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            if r["fits"]:
                shares = "".join(f"; {s}" for s in r["shares"])
                print(f"{r['path']}: fits ({r['rows']:,} rows){shares}")
            else:
                print(f"{r['path']}: does not fit: {r['error']}")
    refused = [r["path"] for r in results if not r["fits"]]
    if refused:
        print(
            f"engram patch: error: the model of {args.folder} refused {len(refused)} of the {len(results)} "
            f"patches ({', '.join(refused)}): each line above says why",
            file=sys.stderr,
        )
        return 2
    return 0
