"""The commands on Hugging Face model folders: `hf-train` (attach Engram, train with the HF Trainer,
write one folder: `engram.apps.hf.train`), `hf-eval` (held-out loss of a folder, with memory patches
applied by `--patch`: `engram.apps.hf.folder`) and `hf-upgrade` (an older folder made an Engram
model's: `engram.apps.hf.upgrade`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from engram.cli.options import (
    SIZE_HELP,
    add_device_options,
    add_verify_option,
    device_from_args,
    input_file,
    input_folder,
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
    row_count,
    seed,
    set_threads,
    threads,
    whole_number,
)
from engram.config import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYER_ROWS
from engram.device import Precision

__all__ = ["register"]

MODES = ("frozen", "lora", "full")  # engram.apps.hf.train.TrainMode's values (apps imported only to run)
TABLE_SYNCS = ("sharded", "replicated")  # engram.apps.hf.settings.TABLE_SYNCS
# a block's loss predicts each token from those before it: one token has no next token to predict
block_length = whole_number(2, fix=" (a block of one token has no next token to predict)")


def layer_list(text: str) -> tuple[int, ...]:
    """argparse type of --layers: decoder layer ids, comma-separated ('1,14')."""
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of layer ids; write e.g. 1 or 1,14 (decoder layers, from 0)"
        ) from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids start at 0; write e.g. 1 or 1,14")
    return ids


def fraction(text: str) -> float:
    """argparse type of --held-out: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction such as 0.05") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a fraction in [0, 1), e.g. 0.05")
    return value


def cmd_hf_train(args: argparse.Namespace) -> int:
    from engram.apps.hf.train import HFTrainSettings, TrainMode

    device, precision = device_from_args(args, args.distributed)
    set_threads(args)
    s = HFTrainSettings(
        folder=args.folder,
        corpus=args.corpus,
        out=args.out,
        layers=args.layers,
        table_rows=args.table_rows,
        heads=args.heads,
        head_dim=args.head_dim,
        mode=TrainMode(args.mode),
        lora_rank=8 if args.lora_rank is None else args.lora_rank,
        engram=not args.no_engram,
        steps=args.steps,
        tokens=args.tokens,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        table_lr=args.table_lr,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        held_out=args.held_out,
        eval_blocks=args.eval_blocks,
        table_sync=args.table_sync,
    )
    if args.lora_rank is not None and s.mode is not TrainMode.LORA:
        raise ValueError(f"--lora-rank {args.lora_rank} applies to --mode lora; add it, or drop --lora-rank")
    if args.collective_timeout is not None and not args.distributed:
        raise ValueError("--collective-timeout applies across processes: add --distributed (under torchrun)")
    import transformers.utils.logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if args.no_progress:
        hf_logging.disable_progress_bar()  # transformers' loading / writing bars too
    try:
        if args.distributed:
            code, r = _train_distributed(s, args, device, precision)
        else:
            code, r = 0, _train(s, args, device, precision, distributed=False)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if r is None:  # a rank other than 0: rank 0 reports
        return code
    if args.json:
        print(json.dumps(r))
    else:
        held = r["held_out"]
        tail = f"; held-out loss {held['loss']:.4f} (perplexity {held['perplexity']:.2f})" if held else ""
        on = f" on {r['processes']} processes" if r["processes"] > 1 else ""
        print(f"{r['out']}: {r['steps']} steps{on}, {r['tokens']:,} tokens, mode {r['mode']}{tail}")
    return 0


def _train(
    s: Any, args: argparse.Namespace, device: torch.device, precision: Precision, *, distributed: bool
) -> dict[str, Any]:
    from engram.apps.hf.train import train_folder

    return train_folder(
        s,
        resume=args.resume,
        resume_if_possible=args.resume_if_possible,
        progress=not args.no_progress,
        distributed=distributed,
        timeout=args.collective_timeout,
        device=device,
        precision=precision,
    )


def _train_distributed(
    s: Any, args: argparse.Namespace, device: torch.device, precision: Precision
) -> tuple[int, dict[str, Any] | None]:
    """One rank of `torchrun ... -m engram hf-train ... --distributed`: the process group started here
    (unless the caller started one) and ended here; (exit status, the summary on rank 0, None on the
    others). A refusal every rank agreed on is printed by rank 0 alone: the others exit with 2 quietly."""
    import os

    import torch.distributed as dist

    from engram.apps.hf.ranks import LAUNCH, RefusedOnEveryRank
    from engram.distributed import TORCHRUN_VARS, Backend, init_distributed

    started = not dist.is_initialized()
    if started:
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ValueError(
                f"--distributed needs torchrun's environment, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: launch with `{LAUNCH}`"
            )
        backend = Backend.NCCL if device.type == "cuda" else Backend.GLOO  # NCCL: cuda:LOCAL_RANK
        init_distributed(backend, threads=args.threads, timeout=args.collective_timeout)
    try:
        r = _train(s, args, device, precision, distributed=True)
        return 0, (r if dist.get_rank() == 0 else None)
    except RefusedOnEveryRank:
        if dist.get_rank() == 0:
            raise
        return 2, None  # the same error, printed by rank 0
    finally:
        if started:
            dist.destroy_process_group()


def cmd_hf_eval(args: argparse.Namespace) -> int:
    from engram.apps.hf.folder import evaluate_folder

    device, precision = device_from_args(args)
    set_threads(args)
    r = evaluate_folder(
        args.folder,
        args.corpus,
        seq_len=args.seq_len,
        held_out=args.held_out,
        max_blocks=args.max_blocks,
        batch_size=args.batch_size,
        device=device,
        precision=precision,
        verify=args.verify,
        patches=args.patch or (),
    )
    if args.json:
        print(json.dumps(r))
    else:
        part = "with its Engram part" if r["engram"] else "without Engram"
        if r["patches"]:
            part += f" and the patch{'es' if len(r['patches']) > 1 else ''} "
            part += ", ".join(p["path"] for p in r["patches"])
        print(
            f"{r['folder']} ({part}): loss {r['loss']:.4f} nats/token (perplexity {r['perplexity']:.2f}) "
            "over "
            f"{r['tokens']:,} held-out tokens of {r['corpus']}"
        )
    return 0


def cmd_hf_upgrade(args: argparse.Namespace) -> int:
    from engram.apps.hf.upgrade import upgrade_folder

    r = upgrade_folder(args.folder, verify=args.verify)
    if args.json:
        print(json.dumps(r))
    elif not r["upgraded"]:
        print(f"{r['folder']} is an Engram model's folder already ({r['architecture']}): nothing to do")
    else:
        dropped = r["weight_files_rewritten"]
        extra = f"; the tables' second copy removed from {', '.join(dropped)}" if dropped else ""
        print(
            f"{r['folder']}: now {r['architecture']} (model type engram): AutoModelForCausalLM.from_pretrained "
            f"loads it with Engram after `import engram`, or with trust_remote_code=True{extra}"
        )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "folder", type=input_folder, help="an HF causal-LM folder (config.json, weights, tokenizer)"
    )
    p.add_argument(
        "--corpus",
        type=input_file,
        required=True,
        help='a UTF-8 text file, or JSONL (.jsonl) with a "text" field',
    )
    p.add_argument("--threads", type=threads, help="torch threads (default: the idle cores)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "hf-train",
        help="attach Engram to an HF model folder, train it on a corpus (HF Trainer), write one folder",
    )
    _common(p)
    add_device_options(p)
    p.add_argument("--out", type=output_folder, required=True, help="the folder to write (new or empty)")
    p.add_argument(
        "--layers", type=layer_list, help="decoder layers for Engram, e.g. 1,14 (default: from depth)"
    )
    p.add_argument(
        "--table-rows",
        type=row_count,
        help=f"table rows per layer, e.g. 500K, at most {MAX_LAYER_ROWS:,} (default: half the backbone's "
        f"parameters; {SIZE_HELP})",
    )
    p.add_argument(
        "--heads",
        type=positive_int,
        default=4,
        help=f"hash heads per n-gram order (default 4; 1 to {MAX_HEADS})",
    )
    p.add_argument(
        "--head-dim",
        type=positive_int,
        help=f"width of a table row (default 32, 64 from hidden 256; at most {MAX_HEAD_DIM})",
    )
    p.add_argument(
        "--mode", choices=MODES, default="frozen", help="what trains besides Engram (default frozen)"
    )
    p.add_argument("--lora-rank", type=positive_int, help="LoRA rank with --mode lora (default 8)")
    p.add_argument("--no-engram", action="store_true", help="no Engram: a LoRA or full fine-tuning baseline")
    p.add_argument("--steps", type=positive_int, help="training steps (default 200)")
    p.add_argument("--tokens", type=row_count, help="training tokens instead of --steps (e.g. 2M)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument(
        "--seq-len", type=block_length, default=128, help="tokens a block (default 128; 2 or more)"
    )
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--table-lr", type=positive_float, default=1e-2, help="table learning rate (default 1e-2)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--held-out", type=fraction, default=0.05, help="fraction of the corpus held out, from its end (0.05)"
    )
    p.add_argument(
        "--checkpoint-every", type=non_negative_int, default=0, help="steps between checkpoints (0: none)"
    )
    p.add_argument(
        "--eval-blocks",
        type=non_negative_int,
        default=64,
        help="held-out blocks evaluated before and after training (default 64; 0: all)",
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run for --out (refused where there is none)",
    )
    again.add_argument(
        "--resume-if-possible",
        action="store_true",
        help="continue the interrupted run for --out if there is one, else start from the beginning",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one rank of a data-parallel run, --batch-size split over the ranks; launch with "
        "`torchrun --nproc_per_node N -m engram hf-train ... --distributed` (gloo on the CPU; NCCL with "
        "--device cuda, or auto when every rank of the node has a GPU of its own: one GPU a rank)",
    )
    p.add_argument(
        "--table-sync",
        choices=TABLE_SYNCS,
        help="with --distributed: 'sharded' (the default on 2 or more ranks) gives each rank 1/N of every "
        "table's rows and their optimizer state; 'replicated' keeps every table whole on every rank",
    )
    p.add_argument(
        "--collective-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="with --distributed: a collective waiting longer than this for the other ranks ends the run "
        "(default 300)",
    )
    p.set_defaults(func=cmd_hf_train)

    p = sub.add_parser(
        "hf-eval", help="held-out loss of an HF model folder (with its Engram part if it has one)"
    )
    _common(p)
    add_device_options(p, "evaluate")
    p.add_argument(
        "--held-out", type=fraction, help="fraction held out (default: the folder's run's, else 0.05; 0: all)"
    )
    p.add_argument(
        "--seq-len", type=block_length, help="block length, 2 or more (default: the folder's run's, else 128)"
    )
    p.add_argument(
        "--max-blocks",
        type=non_negative_int,
        help="blocks evaluated (default: the folder's run's, else 64; 0: all)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument(
        "--patch",
        action="append",
        type=input_file,
        metavar="PATCH",
        help="a memory patch file (engram memorize) applied before the evaluation; repeat it for several, "
        "applied in the order given",
    )
    add_verify_option(p)
    p.set_defaults(func=cmd_hf_eval)

    p = sub.add_parser(
        "hf-upgrade",
        help="make a folder written before Engram models had their own type (a plain config.json beside "
        "engram/) an Engram model's folder, which from_pretrained loads with Engram",
    )
    p.add_argument("folder", type=input_folder, help="an HF model folder with its Engram part in engram/")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_verify_option(p)
    p.set_defaults(func=cmd_hf_upgrade)
