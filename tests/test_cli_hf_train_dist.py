"""`engram hf-train --distributed` on 2 gloo ranks (torchrun, 127.0.0.1) against one process, on the
tiny random Llama folder of tests/hf_setup.py and the first verses of the King James Bible (as
tests/test_cli_hf_train.py).

Two launches: the README's command itself (`torchrun --nproc_per_node 2 -m engram hf-train ...
--distributed`: the process group started and ended by the CLI), and tests/hf_train_dist_job.py, a job
of the suite's 2-rank launch (tests/dist_launch.py), which runs several hf-train runs in its process
group (interrupted and resumed, frozen, LoRA and full, row-sharded and replicated tables, a rank given
other options, a rank that fails alone). The 2-rank
runs split the global batch of 4 over the ranks, so OUT equals the one-process run's with batch 4:
float32, the weights to 1e-5 (full: 1e-4) and the held-out loss to 1e-6 (measured: 1.2e-7 frozen,
4.5e-6 LoRA; held-out loss 9e-10). A 2-rank run resumed from its sharded checkpoint equals the
uninterrupted one (measured: bit-exact). With row-sharded tables no rank draws a whole table (add_engram's
tables are lazy under a process group; each rank draws its own rows). Every launch has a timeout, so a
rank that hangs fails the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import dist_launch as L
import hf_train_dist_job as J
from cli_setup import CPU
from engram.apps.hf import folder as hf_folder
from engram.apps.hf import train as H
from engram.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

LAUNCH_TIMEOUT_S = 300
# the global batch of 4, 5 steps, checkpoints at 2 and 4 (test_cli_hf_train's resumable run)
ARGS = ("--batch-size", "4", "--seq-len", "32", "--no-progress", "--threads", "1", "--steps", "5",
        "--checkpoint-every", "2", "--lr", "3e-3")  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the tiny HF folder, the corpus, a folder for the runs): the job's inputs, written here too."""
    d = tmp_path_factory.mktemp("hf-dist")
    return (*J.inputs(d), d)


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", *args]  # --standalone: a free port
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun ran past {LAUNCH_TIMEOUT_S} s; its stderr ends:\n{str(e.stderr)[-6000:]}")
    print(f"torchrun, 2 ranks: {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _one_process(data, name: str, *extra: str) -> Path:
    """One process's run, on the CPU as the gloo ranks are (the Trainer's own choice is a GPU when the
    machine has one)."""
    folder, corpus, d = data
    out = d / name
    if not out.exists():
        args = ["hf-train", str(folder), "--corpus", str(corpus), "--out", str(out), *ARGS, *CPU]
        assert main([*args, *extra]) == 0
    return out


@pytest.fixture(scope="module")
def readme_run(data) -> tuple[Path, dict, str]:
    """The README's command on 2 ranks, frozen: (OUT, the summary it printed, its stderr). On the CPU
    (gloo) whatever GPUs the machine has: OUT is compared with a one-process run on the CPU."""
    folder, corpus, d = data
    out = d / "two-frozen"
    proc = _torchrun(["-m", "engram", "hf-train", str(folder), "--corpus", str(corpus), "--out", str(out),
                      *ARGS, "--distributed", "--json", *CPU])  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # rank 0 reports, the other rank says nothing
    return out, json.loads(lines[0]), proc.stderr


# the job's runs on 2 ranks (tests/hf_train_dist_job.py): each with --out OUT in the job's folder
RUNS = [
    {"name": "frozen-cut", "out": "frozen", "interrupt_at": 3},
    {"name": "frozen-resume", "out": "frozen", "extra": ["--resume"]},
    {"name": "lora-whole", "out": "lora-whole", "extra": ["--mode", "lora"]},
    {"name": "lora-cut", "out": "lora", "extra": ["--mode", "lora"], "interrupt_at": 3},
    {"name": "lora-resume", "out": "lora", "extra": ["--mode", "lora", "--resume"]},
    {"name": "replicated", "out": "replicated", "extra": ["--table-sync", "replicated"]},
    {"name": "full", "out": "full", "extra": ["--mode", "full"]},
    {"name": "left", "out": "left", "interrupt_at": 3},  # not resumed
    {"name": "other-lr", "out": "other-lr", "rank_argv": {"1": ["--lr", "1e-3"]}},
    {"name": "rank-1-fails", "out": "rank-1-fails", "fail_on_rank": 1},
]  # fmt: skip
L.register(__name__, 2, J.JOB_DIR, "hf_train_dist_job:job", args=list(ARGS), runs=RUNS)


@pytest.fixture(scope="module")
def job(dist_launch) -> Path:
    """The job's folder in the launch: its inputs (tiny-llama, genesis.jsonl) and its runs' OUT folders."""
    return dist_launch.job(J.JOB_DIR) / J.JOB_DIR  # the launch's first job: not the whole launch


def _outcome(job: Path, name: str) -> list[dict]:
    """Each rank's outcome of run `name`."""
    return [res[name] for res in L.results(job.parent, J.JOB_DIR)]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    """OUT's HF weights and its Engram part's, by name."""
    w = {f"hf:{k}": v for k, v in load_file(str(out / "model.safetensors")).items()}
    for f in sorted((out / "engram").glob("model*.safetensors")):
        w |= {f"engram:{k}": v for k, v in load_file(str(f)).items()}
    return w


def _assert_same_run(a: Path, b: Path, atol: float) -> None:
    ra, rb = (json.loads((o / hf_folder.RUN_FILE).read_text()) for o in (a, b))
    assert ra["steps"] == rb["steps"] == 5 and ra["tokens"] == rb["tokens"] == 5 * 4 * 32
    assert ra["held_out"]["loss"] == pytest.approx(rb["held_out"]["loss"], abs=1e-6)
    assert ra["final_train_loss"] == pytest.approx(rb["final_train_loss"], abs=1e-5)  # logged in float32
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and "engram:layers.1.engram.embed.weight" in wa  # the tables
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def test_two_ranks_equal_one_process(data, readme_run, capsys):
    """The README's torchrun command: the tables row-sharded over 2 ranks, micro-batches of 2; OUT (HF's
    files, the whole Engram part gathered to rank 0, the card) equals one process's with batch 4."""
    out, r, stderr = readme_run
    assert r["processes"] == 2 and r["table_sync"] == "sharded" and r["engram"]["rows_per_layer"] == 4096
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"]
    assert "on 2 processes (the batch split over them, the tables sharded)" in (out / "README.md").read_text()
    assert not H.partial_folder(out).exists() and "Traceback" not in stderr
    one = _one_process(data, "one-frozen")
    _assert_same_run(out, one, atol=1e-5)
    r1 = json.loads((one / hf_folder.RUN_FILE).read_text())
    assert r1["processes"] == 1 and r1["table_sync"] is None
    assert r["engram"] == r1["engram"]  # the whole tables' parameters counted, not a rank's shard
    # the part rank 0 wrote reads back in one process: hf-eval gives the run's own held-out loss
    capsys.readouterr()
    assert main(["hf-eval", str(out), "--corpus", str(data[1]), "--json", "--threads", "1", *CPU]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(r["held_out"]["loss"], abs=1e-6)


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_two_rank_resume_equals_uninterrupted(readme_run, job, data, mode):
    """Interrupted after the checkpoint of step 2 (each rank's rows of the sharded tables and their
    optimizer state in engram-shards/), resumed with --resume on 2 ranks: the same OUT as the
    uninterrupted 2-rank run (the cosine schedule's learning rate reaches the resumed table optimizer
    too); LoRA on 2 ranks also equals LoRA in one process."""
    cut, resumed = _outcome(job, f"{mode}-cut"), _outcome(job, f"{mode}-resume")
    assert [c["code"] for c in cut] == [130] * 2  # Ctrl-C: one line and exit 130 on every rank
    assert [c["code"] for c in resumed] == [0, 0], resumed
    assert "resuming from " in resumed[0]["err"] and "checkpoint-2" in resumed[0]["err"]
    assert resumed[1]["err"] == ""  # rank 0 speaks for the launch
    whole = readme_run[0] if mode == "frozen" else job / "lora-whole"
    _assert_same_run(job / mode, whole, atol=1e-6)
    assert [o["whole_tables"] for o in cut + resumed] == [0] * 4  # each rank drew its own rows only
    if mode == "lora":
        assert _outcome(job, "lora-whole")[0]["code"] == 0
        _assert_same_run(whole, _one_process(data, "one-lora", "--mode", "lora"), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "mode", "sync", "atol"),
    [("replicated", "frozen", "replicated", 1e-5), ("full", "full", "sharded", 1e-4)],
)
def test_replicated_tables_and_full_mode_equal_one_process(job, data, name, mode, sync, atol):
    """--table-sync replicated (every rank holds the whole tables, their row gradients averaged) and
    --mode full (the backbone under DDP too) on 2 ranks: OUT equals one process's. Full: 1e-4, as Adam
    divides a gradient near zero by its own size, so float32's other summation order on 2 ranks moves
    such an element by up to lr x a fraction (measured: 1 of 16,384 of Engram's wkv by 4.7e-5)."""
    outcome = _outcome(job, name)
    assert [o["code"] for o in outcome] == [0, 0]
    # add_engram's tables are lazy under a process group: drawn whole only where a rank holds them whole
    assert [o["whole_tables"] for o in outcome] == ([1, 1] if sync == "replicated" else [0, 0])
    r = json.loads((job / name / hf_folder.RUN_FILE).read_text())
    assert r["table_sync"] == sync and r["mode"] == mode
    _assert_same_run(job / name, _one_process(data, f"one-{mode}", "--mode", mode), atol=atol)


def test_resume_on_other_processes_refused(job, capsys):
    """A run interrupted on 2 ranks is refused on one process, naming the processes (its tables are in
    2 shard files), and left as it was."""
    folder, corpus = job / "tiny-llama", job / "genesis.jsonl"  # the run's own (its settings name them)
    assert _outcome(job, "left")[0]["code"] == 130
    out = job / "left"
    capsys.readouterr()
    argv = ["hf-train", str(folder), "--corpus", str(corpus), "--out", str(out), *ARGS, "--resume", *CPU]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "other settings (processes: 2): give the same options and processes" in err, err
    assert len(err.splitlines()) == 1 and H.partial_folder(out).exists()


def test_a_failure_on_one_rank_fails_every_rank_with_one_line(job):
    """Rank 1 launched with another --lr, or failing alone while it checks its input: both ranks exit
    with 2 within the launch (no hang); rank 0 prints the one line (naming the rank and the values),
    rank 1 nothing; nothing is written."""
    other = _outcome(job, "other-lr")
    assert [o["code"] for o in other] == [2, 2] and other[1]["err"] == ""
    line = other[0]["err"].strip()
    assert line.splitlines() == [line] and line.startswith("engram hf-train: error: the ranks of this launch")
    assert "--lr (rank 0: 0.003, rank 1: 0.001)" in line
    fails = _outcome(job, "rank-1-fails")
    assert [o["code"] for o in fails] == [2, 2] and fails[1]["err"] == ""
    line = fails[0]["err"].strip()
    assert line == "engram hf-train: error: rank 1 of 2: this rank cannot read the corpus (a test's failure)"
    for name in ("other-lr", "rank-1-fails"):
        assert not (job / name).exists() and not H.partial_folder(job / name).exists()
