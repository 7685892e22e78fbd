"""One rank's part of tests/test_cli_hf_train_dist.py, a job of the suite's 2-rank launch
(tests/dist_launch.py): `engram hf-train --distributed` runs through the CLI's `main` in this process,
in the launch's process group (gloo), so that one launch runs them all.

`job(ctx, args, runs)`: rank 0 writes the tiny HF folder and the corpus (`inputs`) into
ctx.root/JOB_DIR, then every rank runs `runs` in turn, each {"name", "out" (a folder there), "extra"
(options after `args`), and optionally "interrupt_at", "rank_argv", "fail_on_rank"}; returns {name:
outcome}, an outcome being {"code": main's exit status (130: interrupted, as Ctrl-C), or "interrupted" (the interrupt escaped main), "err": what it printed on
stderr, "whole_tables": how many lazy tables (add_engram's under a process group) were drawn whole on
this rank}. `interrupt_at` N: every rank raises KeyboardInterrupt before step N+1 (as a Ctrl-C of the
launch would), after the checkpoints written so far. `rank_argv` {"R": [...]}: options added on rank R
only. `fail_on_rank` R: reading the corpus fails on rank R only (a ValueError), as a file only that
rank cannot read would.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch.distributed as dist
import transformers

from engram.cli import main as engram_main

JOB_DIR = "hf-train-dist"  # the job's name in the launch, and its folder there
VERSES = 160  # the corpus: the first verses of the King James Bible


def inputs(d: Path) -> tuple[Path, Path]:
    """(the tiny random Llama folder of tests/hf_setup.py, the corpus) written into `d`: the same files
    in every process that calls it."""
    import hf_setup as S
    from engram.apps.lm.corpus import kjv_path

    d.mkdir(parents=True, exist_ok=True)
    corpus = d / "genesis.jsonl"
    with kjv_path().open(encoding="utf-8") as f:
        corpus.write_text("".join(next(f) for _ in range(VERSES)), encoding="utf-8")
    return S.save_folder(d / "tiny-llama", layers=3, seed=1), corpus


FAILURE = "this rank cannot read the corpus (a test's failure)"


def run(argv: list[str], interrupt_at: int | None, fail: bool) -> dict:
    import engram.apps.hf.train as H

    step = transformers.Trainer.training_step
    read = H.read_documents

    def unreadable(path):
        raise ValueError(FAILURE)

    def interrupt(self, *a, **kw):
        if self.state.global_step == interrupt_at:
            raise KeyboardInterrupt
        return step(self, *a, **kw)

    from engram.model.table import TrainableTable

    materialize = TrainableTable.materialize
    whole = []

    def counted(table):
        if table.is_lazy:
            whole.append(table.num_rows)
        return materialize(table)

    TrainableTable.materialize = counted
    err = io.StringIO()
    try:
        if interrupt_at is not None:
            transformers.Trainer.training_step = interrupt
        if fail:
            H.read_documents = unreadable
        with contextlib.redirect_stderr(err):
            code: int | str = engram_main(argv)
    except KeyboardInterrupt:
        code = "interrupted"
    finally:
        transformers.Trainer.training_step = step
        H.read_documents = read
        TrainableTable.materialize = materialize
    return {"code": code, "err": err.getvalue(), "whole_tables": len(whole)}


def job(ctx: Any, args: list[str], runs: list[dict]) -> dict[str, dict]:
    """Every run of `runs` on this rank (module docstring), after rank 0 wrote the inputs."""
    d = Path(ctx.root) / JOB_DIR
    if dist.get_rank() == 0:
        inputs(d)
    dist.barrier()  # the inputs are written before any rank reads them
    rank = dist.get_rank()
    base = ["hf-train", str(d / "tiny-llama"), "--corpus", str(d / "genesis.jsonl"), *args, "--distributed"]
    base += ["--device", "cpu"]  # gloo, the launch's backend, whatever GPUs the machine has
    out = {}
    for r in runs:
        argv = [
            *base,
            "--out",
            str(d / r["out"]),
            *r.get("extra", []),
            *r.get("rank_argv", {}).get(str(rank), []),
        ]
        out[r["name"]] = run(argv, r.get("interrupt_at"), r.get("fail_on_rank") == rank)
    dist.barrier()  # the runs left the ranks in step: the launch's next job starts from here
    return out
