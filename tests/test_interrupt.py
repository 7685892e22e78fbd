"""Ctrl-C and SIGTERM stop a command with one line and exit status 130 (issue 46 item 7): `engram train`
in a subprocess, stopped while it trains, says which checkpoint is intact and the command that continues
it; that command then works. `main`'s SIGTERM handler lives only for the command's duration."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engram.cli import INTERRUPTED, Stopped, _stopped_line, main


def _train(out: Path, *extra: str) -> subprocess.Popen[str]:
    argv = ["train", "--preset", "tiny", "--out", str(out), "--no-progress", "--threads", "1"]
    argv += ["--device", "cpu", "--steps", "400", "--checkpoint-every", "3", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "engram", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop_when_training(proc: subprocess.Popen[str], out: Path, sig: int, after: set[str]) -> tuple[int, str]:
    """Send `sig` once a checkpoint not in `after` is written (training is under way); (exit, stderr)."""
    deadline = time.monotonic() + 60
    while not (set(p.name for p in (out / "checkpoints").glob("step-*")) - after):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint in 60 s"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _checks_line(err: str, out: Path, name: str) -> None:
    *before, line = err.strip().splitlines()  # before: a resumed run's own "resumed from ..." line
    assert "Traceback" not in err and all(b.startswith("resumed from ") for b in before), err
    assert line.startswith(f"engram train: stopped by {name}; the last checkpoint in {out} (step-"), err
    assert "is intact: continue with `engram train --preset tiny" in line and line.endswith("--resume`")
    assert not list(out.glob("checkpoints/.tmp-*")) and not list(out.glob(".tmp*"))


def _steps(out: Path) -> set[str]:
    return {p.name for p in (out / "checkpoints").glob("step-*")}


@pytest.mark.slow  # two training subprocesses stopped by signals, ~23 s
def test_train_stops_in_one_line_and_resumes(tmp_path):
    """Ctrl-C while it trains, then SIGTERM while the resumed run trains, then the command the line
    names continues the run (three processes: one run, stopped twice)."""
    out = tmp_path / "run"
    code, err = _stop_when_training(_train(out), out, signal.SIGINT, set())
    assert code == INTERRUPTED, err
    _checks_line(err, out, "Ctrl-C")
    code, err = _stop_when_training(_train(out, "--resume"), out, signal.SIGTERM, _steps(out))
    assert code == INTERRUPTED, err
    _checks_line(err, out, "SIGTERM")
    last = max(int(s.removeprefix("step-")) for s in _steps(out))
    done = _train(out, "--resume", "--until", str(last + 1))
    _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert f"step-{last + 1:07d}" in _steps(out)


def test_the_line_for_a_run_without_checkpoint_and_for_hf_train(tmp_path):
    a = argparse.Namespace(command="train", out=str(tmp_path / "none"), resume=False)
    assert _stopped_line(a, ["train", "--out", a.out], KeyboardInterrupt()) == (
        f"engram train: stopped by Ctrl-C; no checkpoint was written yet in {a.out}: start it again"
    )
    h = argparse.Namespace(command="hf-train", out="OUT", resume=True)
    line = _stopped_line(h, ["hf-train", "M", "--out", "OUT", "--resume"], Stopped())
    assert line.startswith("engram hf-train: stopped by SIGTERM; what it saved for OUT is kept")
    assert "`engram hf-train M --out OUT --resume-if-possible`" in line
    c = argparse.Namespace(command="hash", text="x")
    assert _stopped_line(c, ["hash"], KeyboardInterrupt()) == "engram hash: stopped by Ctrl-C"


def test_main_answers_an_interrupt_with_one_line_and_restores_sigterm(monkeypatch, capsys):
    import engram.cli.addressing as A

    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def interrupted(args):
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler main installed raises Stopped here
        time.sleep(5)
        raise AssertionError("not stopped")

    monkeypatch.setattr(A, "cmd_hash", interrupted)
    assert main(["hash", "--text", "in the beginning"]) == INTERRUPTED
    assert capsys.readouterr().err == "engram hash: stopped by SIGTERM\n"
    assert seen[0] is not before and signal.getsignal(signal.SIGTERM) is before


_SERVE = """
import signal, sys, time
from pathlib import Path
import engram.cli.serve as serve
from engram.cli import main
from engram.vllm.server import ServerPlan

# the server: a child that notes SIGTERM (and, told to, ignores it as a stuck server would)
CHILD = '''
import signal, sys, time
from pathlib import Path
def term(*_):
    Path(sys.argv[1]).write_text("SIGTERM")
    if sys.argv[2] == "exits":
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("serving", flush=True)
while True:
    time.sleep(0.05)
'''
serve.vllm_missing = lambda: None
serve.plan_server = lambda *a, **k: ServerPlan([sys.executable, "-c", CHILD, sys.argv[2], sys.argv[3]], {})
serve.STOP_GRACE_S = 1.0
sys.exit(main(["serve", sys.argv[1]]))
"""


@pytest.mark.parametrize("server", ["exits", "stuck"])
def test_serve_passes_sigterm_on_to_the_server(tmp_path, server):
    """SIGTERM reaches `engram serve` alone (not its process group): it is passed on to vLLM's server,
    whose exit status is the command's; a server that does not stop within the grace time is killed.
    Either way the command ends (it used to wait forever for a server that was never told)."""
    noted = tmp_path / "noted"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(tmp_path), str(noted), server],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "serving\n", proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert noted.read_text() == "SIGTERM"
    assert "Traceback" not in err, err
    assert proc.returncode == (0 if server == "exits" else 128 + signal.SIGKILL), err
