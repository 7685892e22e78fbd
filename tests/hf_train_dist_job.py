"""One torchrun rank of tests/test_cli_hf_train_dist.py's job: `engram hf-train --distributed` runs
through the CLI's `main` in this process, the process group started here (gloo) and kept across the
runs, so that one launch runs them all.

argv: OUT (a folder), RUNS (JSON: a list of {"name", "argv", and optionally "interrupt_at",
"rank_argv", "fail_on_rank"}). Each run's outcome on each rank goes to OUT/<name>-rank-<R>.json:
{"code": main's exit status, or "interrupted", "err": what it printed on stderr, "whole_tables": how many
lazy tables (add_engram's under a process group) were drawn whole on this rank}. `interrupt_at` N:
every rank raises KeyboardInterrupt before step N+1 (as a Ctrl-C of the launch would), after the
checkpoints written so far. `rank_argv` {"R": [...]}: options added on rank R only. `fail_on_rank` R:
reading the corpus fails on rank R only (a ValueError), as a file only that rank cannot read would.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from engram.cli import main as engram_main

FAILURE = "this rank cannot read the corpus (a test's failure)"


def run(argv: list[str], interrupt_at: int | None, fail: bool) -> dict:
    import engram.apps.hf_train as H

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


def main(argv: list[str]) -> int:
    out, runs = Path(argv[0]), json.loads(argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        for r in runs:
            argv = [*r["argv"], *r.get("rank_argv", {}).get(str(rank), [])]
            res = run(argv, r.get("interrupt_at"), r.get("fail_on_rank") == rank)
            (out / f"{r['name']}-rank-{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
