"""The training commands of `engram`: `demo`, `train`, `eval` (registered by `engram.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engram.checkpoint.folder_lock import write_lock
from engram.cli.options import (
    add_device_options,
    add_verify_option,
    corpus_source,
    device_from_args,
    input_file,
    input_folder,
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
    seed,
    set_threads,
    threads,
    tokenizer_source,
)

__all__ = ["add_training_commands"]

# TableOptimizer's and EmbeddingOptimizer's values (engram.apps is imported only to run)
TABLE_OPTIMIZERS = ("adam", "adagrad", "sinkhorn", "dense-adam")
EMBEDDING_OPTIMIZERS = ("adamw", "sinkhorn")


def cmd_demo(args: argparse.Namespace) -> int:
    from engram.apps.lm.demo import DEMO_CONFIG, print_summary, run_demo

    device, precision = device_from_args(args)
    set_threads(args)
    cfg = DEMO_CONFIG
    if args.steps is not None:
        cfg = cfg.replace(steps=args.steps, warmup=min(cfg.warmup, max(1, args.steps // 5)))
    if args.corpus is not None:
        cfg = cfg.replace(corpus=args.corpus)
    if args.tokenizer is not None:
        cfg = cfg.replace(tokenizer=args.tokenizer)
    command = (
        "engram demo " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["demo"]
        else "engram demo"
    )
    with write_lock(args.out, _command("demo", args.out)):
        results = run_demo(
            cfg,
            seeds=tuple(range(args.seeds)),
            minutes=args.minutes,
            out_dir=args.out,
            progress=not args.no_progress,
            command=command.strip(),
            device=device,
            precision=precision,
        )
    if args.json:
        print(json.dumps({"summary": results["summary"], "report": str(Path(args.out) / "report.md")}))
    else:
        print_summary(results, args.out)
    return 0


def _train_config(args: argparse.Namespace) -> Any:
    from engram.apps.lm.train import TRAIN_PRESETS, TrainConfig

    if args.config and args.preset:
        raise ValueError("give --config or --preset, not both")
    if args.config:
        cfg = TrainConfig.from_file(args.config)
    else:
        cfg = TRAIN_PRESETS[args.preset or "demo"]
    overrides: dict[str, Any] = {}
    for key in (
        "steps",
        "seed",
        "checkpoint_every",
        "table_optimizer",
        "embedding_optimizer",
        "embedding_lr",
    ):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    if args.no_engram:
        overrides["engram"] = None  # the baseline backbone
    embedding = overrides.get("embedding_optimizer", cfg.embedding_optimizer)
    if args.embedding_lr is not None and embedding != "sinkhorn":
        raise ValueError(
            f"--embedding-lr {args.embedding_lr:g} is the Sinkhorn embedding's learning rate, but the "
            f"embedding optimizer is {str(embedding)!r} (AdamW, at the config's lr), which would ignore it: "
            "add --embedding-optimizer sinkhorn, or drop --embedding-lr"
        )
    return cfg.replace(**overrides) if overrides else cfg


def cmd_train(args: argparse.Namespace) -> int:
    if args.distributed:
        return _cmd_train_distributed(args)
    if args.table_init is not None:
        raise ValueError("--table-init applies to sharded tables: add --distributed (under torchrun)")
    if args.table_ranks is not None:
        raise ValueError("--table-ranks applies to sharded tables: add --distributed (under torchrun)")
    if args.sharded_checkpoints:
        raise ValueError(
            "--sharded-checkpoints applies to sharded tables: add --distributed (under torchrun); one "
            "process writes whole tables"
        )
    from engram.apps.lm.train import Trainer, build_model, prepare_data

    device, precision = device_from_args(args)
    set_threads(args)
    cfg = _train_config(args)
    out = Path(args.out)
    with write_lock(out, _command("train", args.out)):  # one writer a run folder, for the whole run
        _check_resume(args, out)
        _check_memory(cfg)
        data = prepare_data(cfg)
        model = build_model(cfg, data)
        out.mkdir(parents=True, exist_ok=True)  # after every check: a refused run leaves no folder
        trainer = Trainer(cfg, data, model, out_dir=out, device=device, precision=precision)
        _resume(args, trainer, out, verbose=True)
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        _train_and_report(args, trainer, out, lambda m: m.num_params(), main_rank=True)
    return 0


def _command(name: str, out: str) -> str:
    """What a folder's write lock records of this command: `engram NAME --out OUT`."""
    return f"engram {name} --out {shlex.quote(str(out))}"


def _check_memory(cfg: Any, available: int | None = None) -> None:
    """Refuse a run whose parameters and tables would not fit in the memory available now (a lower
    bound, `TrainConfig.train_bytes`, estimated before anything is allocated or written)."""
    from engram.apps.hf.settings import available_memory

    need = cfg.train_bytes()
    available = available_memory() if available is None else available
    if available is not None and need > available:
        e = cfg.engram
        tables = (
            ""
            if e is None
            else f"; Engram: {e.n_layers} table(s) of about {e.n_heads * sum(e.engram_vocab_size):,} rows x {e.head_dim}"
        )
        raise ValueError(
            f"this run needs at least {need / 1e9:.3g} GB to train (dim {cfg.dim}, {cfg.n_layers} layers{tables}), "
            f"but this machine has {available / 1e9:.3g} GB available: give a smaller model or smaller "
            "engram_vocab_size bases (rows per head)"
        )


def _check_resume(args: argparse.Namespace, out: Path) -> None:
    """`--resume` where --out holds no checkpoint (a mistyped --out, most likely): refused before anything
    is written; `--resume-if-possible` starts afresh there instead."""
    from engram.apps.lm.train import latest_checkpoint

    if args.resume and latest_checkpoint(out) is None:
        raise ValueError(
            f"--resume: {out / 'checkpoints'} holds no checkpoint to resume from: check --out (the folder of "
            "the run to continue), or give --resume-if-possible to start afresh where there is none"
        )


def _resume(args: argparse.Namespace, trainer: Any, out: Path, verbose: bool) -> None:
    """Clear interrupted writes (main rank: `verbose`), then continue the newest intact checkpoint."""
    from engram.apps.lm.train import latest_checkpoint, remove_stale_tmp

    if verbose:
        for folder, why in remove_stale_tmp(out):
            print(f"removed {folder}: {why}", file=sys.stderr)
    ckpt = latest_checkpoint(out)
    if ckpt is None and args.resume_if_possible and verbose:
        print(
            f"--resume-if-possible: no checkpoint in {out / 'checkpoints'}: training from the start",
            file=sys.stderr,
        )
    if ckpt is not None:
        if not (args.resume or args.resume_if_possible):
            raise ValueError(
                f"{out} already holds checkpoint {ckpt.name}; pass --resume to continue it, "
                "or choose another --out"
            )
        ckpt, skipped = trainer.resume_latest()
        if verbose:
            for path, why in skipped:
                print(f"skipped damaged checkpoint {path}: {why}", file=sys.stderr)
            print(f"resumed from {ckpt} at step {trainer.step}", file=sys.stderr)


def _train_and_report(
    args: argparse.Namespace,
    trainer: Any,
    out: Path,
    num_params: Callable[[Any], dict[str, int]],
    main_rank: bool,
) -> None:
    """The training loop with a progress bar, then the final evaluation and the summary line
    (bar and summary on the main rank only; every rank runs the loop and the evaluation)."""
    from tqdm.auto import tqdm

    from engram.apps.lm.train import latest_checkpoint

    cfg = trainer.cfg
    bar = tqdm(
        total=cfg.steps,
        initial=trainer.step,
        desc="train",
        unit="step",
        disable=args.no_progress or not main_rank,
        mininterval=0.5 if sys.stderr.isatty() else 10,
    )

    def on_step(t: Any, loss: float) -> None:
        bar.update(1)
        held = t.history[-1].get("held_out_loss")
        bar.set_postfix(loss=f"{loss:.3f}", **({"held_out": f"{held:.3f}"} if held is not None else {}))

    trainer.run(on_step=on_step, until=args.until)
    bar.close()
    result = trainer.evaluate()
    params = num_params(trainer.model)
    if not main_rank:
        return
    summary = {
        "step": trainer.step,
        "held_out": result,
        "params": params,
        "checkpoint": str(latest_checkpoint(out)),
    }
    print(
        json.dumps(summary)
        if args.json
        else f"step {trainer.step}: held-out loss {result['loss']:.4f} (ppl {result['ppl']:.2f}); "
        f"checkpoint {summary['checkpoint']}"
    )


_RANK_SETTINGS = (
    "until",
    "table_ranks",
    "sharded_checkpoints",
    "resume",
    "resume_if_possible",
    "collective_timeout",
    "device",
)


def _cmd_train_distributed(args: argparse.Namespace) -> int:
    """`engram train --distributed` on one rank of a torchrun launch: gloo on CPU, NCCL on GPU (one GPU a
    rank, cuda:LOCAL_RANK)."""
    import torch.distributed as dist

    from engram.distributed import Backend, init_distributed
    from engram.distributed.shard_checkpoint import agreed

    device, precision = device_from_args(args, distributed=True)  # refusals before any process group
    cfg = _train_config(args)  # config errors before any process group is started
    _check_resume(args, Path(args.out))
    backend = Backend.NCCL if device.type == "cuda" else Backend.GLOO
    env = init_distributed(backend, threads=args.threads, timeout=args.collective_timeout)
    try:
        with contextlib.ExitStack() as held:
            # one writer a run folder: rank 0 holds the lock for the launch (the other ranks write only
            # into the checkpoint folders rank 0 makes); a refusal is every rank's, so none waits
            with agreed(None, lambda: f"writing {args.out}"):
                if env.is_main:
                    held.enter_context(write_lock(args.out, _command("train --distributed", args.out)))
            _train_ranks(args, cfg, env, device, precision)
    finally:
        dist.destroy_process_group()
    return 0


def _train_ranks(args: argparse.Namespace, cfg: Any, env: Any, device: Any, precision: Any) -> None:
    """_cmd_train_distributed's work on this rank, its process group started and the folder locked."""
    from engram.apps.lm.train import prepare_data
    from engram.apps.lm.train_distributed import DistributedTrainer, build_distributed_model
    from engram.distributed import TableInit, global_num_params, table_owners

    # --table-ranks N: rows on ranks 0..N-1 only (None: the tables' default, every rank)
    owners = None if args.table_ranks is None else table_owners(args.table_ranks, env.world)
    out = Path(args.out)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(cfg)  # every rank (deterministic; the trainer checks the ranks agree)
    # born sharded by default: no rank draws a whole table. COPY and CHUNKED build the same model
    # bit for bit (a row from (seed, layer, row) only) and checkpoints do not depend on it, so a
    # run started with either resumes under either
    init = TableInit(args.table_init or TableInit.CHUNKED)
    model = build_distributed_model(cfg, data, init=init, device=env.device, owners=owners)
    # what else changes what the ranks do: checked to be the same on every rank, with cfg
    settings = {f"--{k.replace('_', '-')}": getattr(args, k) for k in _RANK_SETTINGS}
    settings["--table-init"] = init.value
    trainer = DistributedTrainer(
        cfg,
        data,
        model,
        out_dir=out,
        device=env.device,
        sharded_checkpoints=args.sharded_checkpoints,
        settings=settings,
        precision=precision,
    )
    trainer.barrier()  # every rank sees the same checkpoints: none is written before all have looked
    _resume(args, trainer, out, verbose=env.is_main)
    if env.is_main:
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    _train_and_report(args, trainer, out, global_num_params, main_rank=env.is_main)


def cmd_eval(args: argparse.Namespace) -> int:
    from engram.apps.lm.run_checkpoint import check_run_tokenizer
    from engram.apps.lm.train import checkpoint_tokenizer, evaluate, load_trained_model, prepare_data

    device, precision = device_from_args(args)
    set_threads(args)
    cfg, model, state = load_trained_model(args.checkpoint, verify=args.verify, device=device)
    if args.mask_engram and not model.engrams:
        raise ValueError(f"{state['path']} has no Engram modules to mask")
    # the saved tokenizer (a damaged one refused first), then the one the data is scored with: the same
    saved = checkpoint_tokenizer(state["path"], model.config.vocab_size)
    data = prepare_data(cfg)
    check_run_tokenizer(Path(state["path"]), saved, data.tokenizer, cfg.tokenizer)
    rows = data.held_rows if model.needs_rows else None
    scales = [("engram", 1.0), ("engram masked", 0.0)] if args.mask_engram else [("model", 1.0)]
    results = {
        name: evaluate(model, data.held_out, rows, cfg.seq_len, engram_scale=s, precision=precision)
        for name, s in scales
    }
    if args.json:
        print(json.dumps({"checkpoint": state["path"], "step": state["step"], "results": results}))
        return 0
    print(
        f"{state['path']} (step {state['step']}), held-out tokens {next(iter(results.values()))['tokens']:,}"
    )
    names = list(results)
    print(f"{'category':<12} " + " ".join(f"{n:>14}" for n in names))
    for cat in next(iter(results.values()))["per_category"]:
        print(f"{cat:<12} " + " ".join(f"{results[n]['per_category'][cat]:>14.4f}" for n in names))
    print(f"{'all':<12} " + " ".join(f"{results[n]['loss']:>14.4f}" for n in names))
    return 0


def add_training_commands(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="train a baseline and an Engram LM on the King James Bible and compare them"
    )
    p.add_argument("--steps", type=positive_int, help="training steps per model (default 240)")
    p.add_argument(
        "--minutes", type=positive_float, help="fit the step count to this many minutes of training"
    )
    p.add_argument(
        "--seeds", type=positive_int, default=2, help="seeds to run (the spread tells noise from effect)"
    )
    p.add_argument(
        "--corpus", type=corpus_source, help="text file, folder of *.txt or glob instead of the Bible"
    )
    p.add_argument(
        "--tokenizer",
        type=tokenizer_source,
        help="'bpe' (default: trained on the training split), 'deepseek-v4' or a tokenizer.json path",
    )
    p.add_argument(
        "--out", type=output_folder, default="reports/demo", help="report folder (default reports/demo)"
    )
    add_device_options(p)
    p.add_argument("--threads", type=threads, help="torch threads (default: one per idle core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "train", help="train an LM (with Engram unless --no-engram) from a JSON config, with checkpoints"
    )
    p.add_argument("--config", type=input_file, help="JSON file of TrainConfig fields")
    p.add_argument("--preset", choices=["tiny", "demo", "small"], help="a named config (default: demo)")
    p.add_argument(
        "--out", type=output_folder, required=True, help="run folder: checkpoints/, train_config.json"
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (refused where there is none)",
    )
    again.add_argument(
        "--resume-if-possible",
        action="store_true",
        help="continue from the newest checkpoint in --out if there is one, else start from the beginning",
    )
    p.add_argument("--steps", type=positive_int, help="override the config's total steps")
    p.add_argument("--until", type=positive_int, help="stop at this step (the schedule still spans --steps)")
    p.add_argument("--seed", type=seed, help="override the config's seed")
    p.add_argument(
        "--checkpoint-every", type=non_negative_int, help="steps between checkpoints (0: only at the end)"
    )
    p.add_argument("--no-engram", action="store_true", help="train the baseline backbone without Engram")
    p.add_argument(
        "--table-optimizer",
        choices=TABLE_OPTIMIZERS,
        help="the Engram tables' optimizer: SparseRowAdam, SparseRowAdagrad, V4.1's Sinkhorn-balanced "
        "update, or the paper's dense Adam over the whole table (default: the config's, 'adam')",
    )
    p.add_argument(
        "--embedding-optimizer",
        choices=EMBEDDING_OPTIMIZERS,
        help="the token embedding's and LM head's optimizer: AdamW with the backbone, or 'sinkhorn', the "
        "Sinkhorn-balanced update, an optimizer of its own beside any --table-optimizer (V4.1's recipe is "
        "both: add --table-optimizer sinkhorn) (default: the config's, 'adamw')",
    )
    p.add_argument(
        "--embedding-lr",
        type=positive_float,
        help="with --embedding-optimizer sinkhorn (refused without it): its base learning rate (default: "
        "the config's lr)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one rank of a data-parallel run with row-sharded Engram tables; launch with "
        "`torchrun --nproc_per_node N -m engram train --distributed ...` (gloo on the CPU; NCCL with "
        "--device cuda, or auto when every rank of the node has a GPU of its own: cuda:LOCAL_RANK)",
    )
    p.add_argument(
        "--table-init",
        choices=["copy", "chunked"],  # TableInit's values (engram.distributed is imported only to run)
        help="with --distributed: 'chunked' (default) draws each rank's rows itself (no rank holds a full "
        "table); 'copy' builds the single-process model's whole tables on every rank, then shards them "
        "(the same initial table, more memory)",
    )
    p.add_argument(
        "--table-ranks",
        type=int,  # table_owners refuses N outside 1..world size, naming the world size
        metavar="N",
        help="with --distributed: only the first N ranks hold the Engram tables (num_rows / N rows each, "
        "and their optimizer state); the others hold none and run the backbone (default: every rank)",
    )
    p.add_argument(
        "--sharded-checkpoints",
        action="store_true",
        help="with --distributed: each table-owning rank writes its own rows (engram-shards/rank-R.safetensors) "
        "instead of gathering every table onto rank 0; resumes on any world size, and `engram eval` "
        "reads it (a run resumed from such a checkpoint keeps writing them)",
    )
    p.add_argument(
        "--collective-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="with --distributed: a collective waiting longer than this for the other ranks ends the "
        "job with an error naming the rank and the step (default 300)",
    )
    add_device_options(p)
    p.add_argument(
        "--threads", type=threads, help="torch threads (default: idle cores; per rank: cores / ranks)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval", help="held-out loss of a checkpoint, per category; --mask-engram for the ablation"
    )
    p.add_argument(
        "--checkpoint", type=input_folder, required=True, help="a run folder or a checkpoints/step-N folder"
    )
    p.add_argument("--mask-engram", action="store_true", help="also score with Engram's output masked")
    add_device_options(p, "evaluate")
    add_verify_option(p)
    p.add_argument("--threads", type=threads, help="torch threads (default: one per idle core)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)
