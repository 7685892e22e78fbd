"""Every multi-process job of the suite in one torchrun launch per world size (gloo, CPU: the ranks
see no GPU, CUDA_VISIBLE_DEVICES="", whatever the machine has).

A test module registers its jobs when it is imported (`register`): a name, a world size and the
function ("module:function") that every rank of the launch calls as `function(ctx, **kwargs)`, `ctx`
a `Context` (the launch folder, the session's corpus); it returns that rank's result (anything
torch.save writes), which the tests read back with `results(root, name)`.

The launches start in the background with the session's first test (tests/conftest.py), for the
jobs of the test modules collected in the session: the 2-rank launch first, then the 3- and 1-rank
ones together (their jobs resume its checkpoints); the session fixture `dist_launch(world)` waits
for that world's launch. In a launch every job runs in turn in one process group (`stage` 1 jobs,
which leave timed-out collectives behind, last). Starting a rank costs more CPU than most jobs
(python, torch, torch._dynamo, transformers), so the suite starts 6 ranks, not a world per job; and
the ranks run while the single-process tests before theirs do, on the core those leave idle.
`dist_launch.job(name)` waits for one job's results only (a test early in the suite, whose job runs
first in its launch).
Every launch has a time limit, and a job that raises records its traceback (`results` fails the
test with it) while the others run on: a rank that hangs fails the tests instead of the suite.
What each job took on each rank: ROOT/times-world-W-rank-R.json.

    python -m torch.distributed.run --standalone --nproc_per_node W tests/dist_launch.py ROOT SPEC
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

WORLD_ORDER = (2, 3, 1)  # launch order: the later worlds resume the 2-rank jobs' checkpoints
LAUNCH_TIMEOUT_S = 900  # one launch, every job of its world size; a hung collective ends in 60 s
EXIT_GRACE_S = 30  # after the jobs: the interpreter must be gone by then (else tracebacks, exit 1)
FAILED = "job_failed"  # a rank's result when the job raised: {FAILED: traceback}


@dataclasses.dataclass(frozen=True)
class Job:
    owner: str  # the test module that registered it (its jobs run when it is collected)
    world: int
    name: str
    call: str  # "module:function", called on every rank as function(ctx, **kwargs)
    kwargs: dict[str, Any]
    stage: int = 0  # the order within a launch: stage, then registration order


@dataclasses.dataclass(frozen=True)
class Context:
    root: Path  # the launch folder: results, and every job's files (name them after the job)
    corpus: str  # the session's training corpus (tests/conftest.py `corpus`)


JOBS: dict[str, Job] = {}


def register(owner: str, world: int, name: str, call: str, /, *, stage: int = 0, **kwargs: Any) -> str:
    """Register a job (JSON-serialisable kwargs; `name` unique in the suite, also a file name)."""
    job = Job(owner, world, name, call, kwargs, stage)
    if JOBS.get(name, job) != job:
        raise ValueError(f"two multi-process jobs are named {name!r}: {JOBS[name]} and {job}")
    if world not in WORLD_ORDER or "/" in name:
        raise ValueError(f"job {name!r}: world size {world} not in {WORLD_ORDER}, or a '/' in the name")
    JOBS[name] = job
    return name


def result_file(root: Path, name: str, rank: int) -> Path:
    return Path(root) / f"{name}-rank-{rank}.pt"


def results(root: Path, name: str) -> list[Any]:
    """Every rank's result of job `name` (the test fails with the traceback of a job that raised)."""
    import pytest
    import torch

    out = [torch.load(result_file(root, name, r), weights_only=False) for r in range(JOBS[name].world)]
    for rank, res in enumerate(out):
        if isinstance(res, dict) and FAILED in res:
            pytest.fail(f"multi-process job {name!r} raised on rank {rank}:\n{res[FAILED]}")
    return out


class Launcher:
    """The launches of one session, in a background thread from `start()` on (they run while the
    tests before them do: most of the suite keeps one core busy, the ranks take the other):
    the 2-rank launch, then the 3- and 1-rank ones together (both resume its checkpoints; a lone rank
    leaves a core free). `launcher(world)` waits for that world's launch: its folder, or the test
    fails with why the launch failed."""

    def __init__(self, owners: set[str]) -> None:
        self.root, self.corpus = Path(), ""
        self.jobs = {w: sorted((j for j in JOBS.values() if j.world == w and j.owner in owners),
                               key=lambda j: j.stage) for w in WORLD_ORDER}  # fmt: skip
        self.failed: dict[int, str | None] = {}  # world -> None (ran) or why it failed
        self.ended = {w: threading.Event() for w in WORLD_ORDER}
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="dist-launch", daemon=True)

    def __bool__(self) -> bool:
        return any(self.jobs.values())

    def start(self, root: Path, corpus: str) -> None:
        """Launch in `root`; `corpus`: the session's training corpus (for the jobs' `Context`)."""
        self.root, self.corpus = root, corpus
        self.thread.start()

    def __call__(self, world: int) -> Path:
        import pytest

        if not self.thread.is_alive() and not self.ended[world].is_set():
            raise RuntimeError("dist_launch: the launches were not started")
        self.ended[world].wait()
        if self.failed[world] is not None:
            pytest.fail(self.failed[world])
        return self.root

    def job(self, name: str) -> Path:
        """Wait for job `name` only (every rank's result written), not for the rest of its launch: the
        launch folder. A test early in the suite gets its job's results while the launch runs on."""
        world = JOBS[name].world
        files = [result_file(self.root, name, r) for r in range(world)]
        while not all(f.exists() for f in files):
            if self.ended[world].is_set() or not self.thread.is_alive():
                return self(world)  # the launch ended (or never started) without them: why
            self.ended[world].wait(0.5)
        return self.root

    def stop(self) -> None:
        """At the session's end: any launch still running is stopped (a run stopped early): SIGTERM,
        which torchrun forwards to its ranks, then SIGKILL."""
        self.stopping = True
        running = [proc for proc in self.procs if proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.thread.is_alive():
            self.thread.join(timeout=60)

    def _run(self) -> None:
        first, *rest = WORLD_ORDER
        self._finish(first, self._start(first))
        started = [(w, self._start(w)) for w in rest]
        for w, proc in started:
            self._finish(w, proc)

    def _start(self, world: int) -> subprocess.Popen | None:
        if not self.jobs[world] or self.stopping:
            return None
        drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env["OMP_NUM_THREADS"] = "1"
        # every job is gloo on the CPU (the ranks' process group, `main`), but library code picks a GPU
        # when one is visible (an `auto` device, FSDP's default device mesh): on a GPU machine the jobs
        # would put tensors there, or ask NCCL for a GPU a rank. With none visible they stay where the
        # tests' CPU references are, whatever GPUs the machine has.
        env["CUDA_VISIBLE_DEVICES"] = ""
        spec = {"corpus": self.corpus, "jobs": [[j.name, j.call, j.kwargs] for j in self.jobs[world]]}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        cmd += [__file__, str(self.root), json.dumps(spec)]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.procs.append(proc)
        return proc

    def _finish(self, world: int, proc: subprocess.Popen | None) -> None:
        try:
            self.failed[world] = None if proc is None else self._wait(world, proc)
        except Exception as e:  # never leave a test waiting
            self.failed[world] = f"the {world}-rank launch: {e!r}"
        self.ended[world].set()

    def _wait(self, world: int, proc: subprocess.Popen) -> str | None:
        what = f"torchrun with {world} ranks ({len(self.jobs[world])} jobs, tests/dist_launch.py)"
        try:
            _stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # torchrun forwards SIGTERM to its ranks, which dump their threads' tracebacks (faulthandler)
            # and die; SIGKILL if that does not end it
            proc.terminate()
            try:
                _stdout, stderr = proc.communicate(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()
                _stdout, stderr = proc.communicate()
            return f"{what} ran past {LAUNCH_TIMEOUT_S} s; its stderr ends:\n{stderr[-8000:]}"
        if proc.returncode != 0:
            return f"{what} exited with {proc.returncode}; its stderr ends:\n{stderr[-6000:]}"
        return None


def _exit_report() -> None:
    """At interpreter exit: the threads still alive (stderr), and a watchdog that dumps every thread's
    traceback and exits 1 if the exit itself hangs (a thread joined at exit, an atexit hook)."""
    alive = [
        f"{t.name} (daemon={t.daemon})" for t in threading.enumerate() if t is not threading.main_thread()
    ]
    print(f"rank {os.environ.get('RANK')}: threads at exit: {alive}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


def main(argv: list[str]) -> int:
    """A rank of a launch: every job of SPEC in turn, each result saved as ROOT/<name>-rank-<r>.pt."""
    import torch
    import torch.distributed as dist

    root, spec = Path(argv[0]), json.loads(argv[1])
    ctx = Context(root, spec["corpus"])
    torch.set_num_threads(1)  # 2 or 3 ranks share 2 cores
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    start_cpu, times = time.process_time(), []  # what each job took on this rank (ROOT/times-*.json)
    try:
        for name, call, kwargs in spec["jobs"]:
            module, _, function = call.partition(":")
            t0, cpu0 = time.perf_counter(), time.process_time()
            try:
                res = getattr(importlib.import_module(module), function)(ctx, **kwargs)
            except Exception:
                res = {FAILED: traceback.format_exc()}
            final = result_file(root, name, rank)
            torch.save(res, final.with_suffix(".tmp"))
            os.replace(final.with_suffix(".tmp"), final)  # whole when it appears: Launcher.job reads it then
            torch.set_num_threads(1)  # whatever the job set
            seconds = (time.perf_counter() - t0, time.process_time() - cpu0)
            times.append({"job": name, "wall_s": round(seconds[0], 2), "cpu_s": round(seconds[1], 2)})
    finally:
        dist.destroy_process_group()
        times.append({"job": "(start-up: python, imports, process group)", "cpu_s": round(start_cpu, 2)})
        (root / f"times-world-{os.environ['WORLD_SIZE']}-rank-{rank}.json").write_text(
            json.dumps(times, indent=1)
        )
    return 0


if __name__ == "__main__":
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, chain=True)  # the launch's timeout: every thread's traceback
    code = main(sys.argv[1:])
    _exit_report()
    sys.exit(code)
