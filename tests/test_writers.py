"""Every command that writes a folder: one writer a folder at a time (`engram.checkpoint.folder_lock`),
refused in one line naming the live process; a killed writer's temporaries cleared by the next run, a
failed write's (a full disk) removed at once; no file of an earlier output the new one does not describe
(`engram.checkpoint.temporaries`, the checkpoint writers)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hf_setup as S
from cli_setup import CPU, refused
from engram.checkpoint import folder_lock
from engram.checkpoint.convert import convert_table, make_scaled_v41_checkpoint
from engram.checkpoint.folder_lock import lock_path, write_lock
from engram.checkpoint.temporaries import clear_dead_temporaries
from engram.cli import main
from training_setup import tiny_cfg

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
CONVERTED = {
    "config.json",
    "model-00001-of-00001.safetensors",
    "engram_layer1.rows",
    "engram_layer14.rows",
}


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def start(code: str) -> subprocess.Popen:
    """A Python process running `code` (the tests folder and this interpreter's path importable)."""
    return subprocess.Popen(
        [sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 60) -> None:
    """Poll until `ready()`; fail with the process's output if it ends first or time runs out."""
    end = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def holder(folder: Path, command: str) -> subprocess.Popen:
    """A live process holding `folder`'s write lock as `command` (until killed). It loads the lock's
    module alone (standard library only), not the engram package: seconds saved a start."""
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('folder_lock', {folder_lock.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
        f"with m.write_lock({str(folder)!r}, {command!r}):\n    print('held', flush=True)\n    time.sleep(120)\n"
    )
    proc = start(code)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held", proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "model"
    S.save_folder(d)
    return d


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("v41") / "src"
    make_scaled_v41_checkpoint(d, base=512, hidden_size=32)
    return d


# ------------------------------------------------------------------------------------------ the lock
def test_lock_refuses_a_second_writer_naming_it_and_dies_with_its_holder(tmp_path):
    run = tmp_path / "run"
    proc = holder(run, "engram train --out run")
    try:
        with (
            pytest.raises(
                ValueError, match=rf"is being written by process {proc.pid} \(engram train --out run\)"
            ),
            write_lock(run, "engram train --out run --resume"),
        ):
            pass
    finally:
        kill(proc)  # SIGKILL: the kernel releases the lock; the file it left is taken over
    assert lock_path(run).exists()
    with write_lock(run, "engram train --out run") as path:
        assert json.loads(path.read_text()) == {"pid": os.getpid(), "command": "engram train --out run"}
    assert listing(tmp_path) == set()  # the lock file goes with its holder's release


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--preset", "tiny", "--out", "{out}", "--resume", *CPU],
        ["demo", "--steps", "1", "--out", "{out}", *CPU],
        ["study", "memory", "--out", "{out}", *CPU],
        ["convert", "{src}", "{out}", "--format", "int4"],
        ["hf-from-gguf", "{src}/config.json", "{out}"],
        ["hf-train", "{hf}", "--corpus", "{hf}/config.json", "--out", "{out}", *CPU],
        ["hf-upgrade", "{hf}"],
    ],
    ids=lambda a: a[0],
)
def test_every_folder_writer_is_refused_beside_a_live_one(argv, v41, hf, tmp_path, capsys):
    capsys.readouterr()  # transformers' progress bar (the hf fixture)
    out = hf if argv[0] == "hf-upgrade" else tmp_path / "out"
    (out / "checkpoints" / "step-0000001").mkdir(parents=True)  # a run to --resume
    (out / "checkpoints" / "step-0000001" / "state.json").write_text("{}")
    before = listing(out)
    args = [a.format(out=out, src=v41, hf=hf) for a in argv]
    proc = holder(out, "engram train --out out")
    try:
        refused(capsys, args, f"{out} is being written by process {proc.pid} (engram train --out out)")
    finally:
        kill(proc)
    assert listing(out) == before  # nothing written beside the live writer


def test_train_beside_a_live_train_is_refused_and_a_killed_one_blocks_nothing(corpus, tmp_path, capsys):
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(tiny_cfg(corpus, steps=100000, eval_every=0, checkpoint_every=1).to_dict()))
    run = tmp_path / "run"
    train = ["train", "--config", str(conf), "--out", str(run), "--no-progress", *CPU]
    proc = start(f"from engram.cli import main\nmain({[*train, '--json']!r})")
    try:  # it has written a checkpoint: a second train would resume it
        wait_for(proc, lambda: any((run / "checkpoints").glob("step-*")), "the first checkpoint")
        refused(capsys, [*train, "--resume"], f"is being written by process {proc.pid} (engram train --out")
    finally:
        kill(proc)
    last = int(max((run / "checkpoints").glob("step-*")).name[len("step-") :])
    assert main([*train, "--resume", "--until", str(last + 1)]) == 0
    capsys.readouterr()
    assert listing(tmp_path) == {"train.json", "run"}  # the lock file gone with the rerun
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------- killed and failed writes
def test_convert_killed_mid_shard_is_cleared_by_the_rerun(v41, tmp_path, capsys):
    dst = tmp_path / "dst"
    argv = ["convert", str(v41), str(dst), "--format", "int4", "--row-file"]
    code = (  # the shard's temporary written, then the process stalls there until it is killed
        "import time\nimport engram.checkpoint.v41.writer as w\nsave = w.save_tensors\n"
        "def stall(path, *a, **k):\n    n = save(path, *a, **k)\n    print('written', flush=True)\n"
        "    time.sleep(120)\n    return n\n"
        f"w.save_tensors = stall\nfrom engram.cli import main\nmain({argv!r})\n"
    )
    proc = start(code)
    try:
        wait_for(
            proc, lambda: any(dst.glob(".model-00001-of-00001.safetensors.tmp-*")), "the temporary shard"
        )
    finally:
        kill(proc)
    (orphan,) = dst.glob(".model-*.tmp-*")
    assert orphan.name == f".model-00001-of-00001.safetensors.tmp-{proc.pid}"
    assert main(argv) == 0
    capsys.readouterr()
    assert listing(dst) == CONVERTED  # the dead temporary removed
    assert listing(tmp_path) == {"dst"}  # and the killed run's lock file


def test_convert_without_row_files_removes_the_earlier_ones(v41, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert main(["convert", str(v41), str(dst), "--format", "int4", "--row-file"]) == 0
    assert listing(dst) == CONVERTED
    assert main(["convert", str(v41), str(dst), "--format", "fp8"]) == 0
    capsys.readouterr()
    assert listing(dst) == {"config.json", "model-00001-of-00001.safetensors"}


def _full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_shard_write_on_a_full_disk_removes_its_temporary(v41, tmp_path, monkeypatch):
    import engram.checkpoint.v41.writer as w

    dst = tmp_path / "dst"
    convert_table(v41, dst, to="int4", row_file=True)
    stamp = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    save = w.save_tensors

    def half(path, *a, **k):  # the temporary half written, then the disk is full
        save(path, *a, **k)
        _full_disk()

    monkeypatch.setattr(w, "save_tensors", half)
    with pytest.raises(OSError, match="No space left"):
        convert_table(v41, dst, to="int8")
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == stamp  # the earlier output intact


def test_a_row_file_write_on_a_full_disk_removes_its_temporary(v41, tmp_path, monkeypatch):
    import engram.storage.rowfile as rf

    dst = tmp_path / "dst"
    convert_table(v41, dst, to="int4")
    monkeypatch.setattr(rf, "_packed", _full_disk)
    with pytest.raises(OSError, match="No space left"):
        convert_table(v41, dst, to="int4", row_file=True)
    assert listing(dst) == {"config.json", "model-00001-of-00001.safetensors"}


def test_a_training_checkpoint_on_a_full_disk_removes_its_temporary(corpus, tmp_path, monkeypatch, capsys):
    import engram.apps.lm.train as T

    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(tiny_cfg(corpus, steps=2, eval_every=0, checkpoint_every=1).to_dict()))
    run = tmp_path / "run"
    train = ["train", "--config", str(conf), "--out", str(run), "--no-progress", *CPU]
    assert main([*train, "--until", "1"]) == 0
    save = T.save_tensors

    def full_at_optimizer(path, *a, **k):
        if Path(path).name == "optimizer.safetensors":
            _full_disk()
        return save(path, *a, **k)

    monkeypatch.setattr(T, "save_tensors", full_at_optimizer)
    capsys.readouterr()
    assert main([*train, "--resume"]) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1] == "engram train: error: [Errno 28] No space left on device"
    )
    assert listing(run / "checkpoints") == {"step-0000001"}  # the last checkpoint, and no temporary
    monkeypatch.setattr(T, "save_tensors", save)
    assert main([*train, "--resume"]) == 0
    assert listing(run / "checkpoints") == {"step-0000001", "step-0000002"}


def test_dead_temporaries_go_and_live_ones_stay(tmp_path):
    dead, live = tmp_path / f".a.safetensors.tmp-{dead_pid()}", tmp_path / f".b.rows.tmp-{os.getpid()}"
    folder = tmp_path / f".c.tmp-{dead_pid()}"
    for p in (dead, live):
        p.write_bytes(b"half")
    folder.mkdir()
    (folder / "x").write_bytes(b"half")
    (tmp_path / "model.safetensors").write_bytes(b"kept")
    assert [p for p, _ in clear_dead_temporaries(tmp_path)] == sorted([dead, folder])
    assert listing(tmp_path) == {live.name, "model.safetensors"}
