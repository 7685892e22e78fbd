"""What the command-line tests share: `refused` (one error line, exit 2, no traceback), a finished
tiny training run to damage (`train_tiny_run`) and the commands that load a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engram.cli import main

# the training commands (train, demo, study, eval, generate, hf-train, hf-eval) on the CPU: their
# default, --device auto, takes the GPU of a GPU machine, and the tests compare with CPU numbers
CPU = ("--device", "cpu")


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run `engram argv`; assert exit 2 and one error line holding every needle; return that line.

    argparse prints its usage lines first; a list of problems (`  - ...` lines) may follow the line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage, then the error line
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    (at,) = [i for i, ln in enumerate(lines) if ln.startswith(f"engram {argv[0]}: error: ")]
    assert all(ln.startswith(("usage:", " ")) for ln in lines[:at]), err
    assert all(ln.startswith("  - ") for ln in lines[at + 1 :]), f"more than one message line:\n{err}"
    message = "\n".join(lines[at:])
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def train_tiny_run(corpus: str, out: Path) -> Path:
    """A finished 3-step run in `out` (with Engram, rows 32 wide so --offload can quantise them)."""
    from engram.apps.lm.train import Trainer, build_model, prepare_data
    from training_setup import tiny_cfg

    cfg = tiny_cfg(corpus, steps=3, eval_every=0, engram_kw={"head_dim": 32})
    data = prepare_data(cfg)
    Trainer(cfg, data, build_model(cfg, data), out_dir=out).run()
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    return out


def load_commands(out: Path) -> list[list[str]]:
    """The three commands that read a run's checkpoint: eval, generate and train --resume, on the CPU."""
    conf = str(out / "train_config.json")
    return [
        ["eval", "--checkpoint", str(out), *CPU],
        ["generate", "--checkpoint", str(out), "--prompt", "And", "--tokens", "2", *CPU],
        ["train", "--config", conf, "--out", str(out), "--resume", "--no-progress", *CPU],
    ]
