"""A training checkpoint's state.json and tokenizer.json, damaged, refused by every command that reads
them (`engram eval`, `generate`, `train --resume`): one line naming the file, exit status 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_setup import CPU, load_commands, refused, train_tiny_run


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    return train_tiny_run(corpus, tmp_path_factory.mktemp("checkpoints") / "run")


@pytest.fixture
def run(trained, tmp_path) -> tuple[Path, Path]:
    """(a copy of the trained run folder, its one checkpoint folder) to damage."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    (ckpt,) = sorted((out / "checkpoints").glob("step-*"))
    return out, ckpt


NAN = float("nan")
# where a number of state.json is made NaN or infinite -> how the refusal names it
NON_FINITE = {
    "optimizer lr": (
        ("optimizer_groups", "dense", "param_groups", 0, "lr"),
        NAN,
        "param_groups[0].lr is nan",
    ),
    "history loss": (("history", 1, "train_loss"), NAN, "history[1].train_loss is nan"),
    "config lr": (("train_config", "lr"), float("inf"), "train_config.lr is inf"),
    "model eps": (("lm_config", "norm_eps"), -float("inf"), "lm_config.norm_eps is -inf"),
}


@pytest.mark.parametrize("case", list(NON_FINITE), ids=list(NON_FINITE))
@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_json_number_not_finite(run, capsys, cmd, case):
    """state.json with a NaN lr or loss (JSON has neither; Python writes and reads them) was taken by
    eval and generate: refused where every command reads a checkpoint, naming the file and the entry."""
    out, ckpt = run
    path, value, needle = NON_FINITE[case]
    state = json.loads((ckpt / "state.json").read_text())
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (ckpt / "state.json").write_text(json.dumps(state))
    refused(capsys, load_commands(out)[cmd], str(ckpt / "state.json"), needle, "damaged")


def _damage_tokenizer(tok: Path, kind: str) -> None:
    from tokenizers import Tokenizer, models

    if kind == "truncated":
        tok.write_bytes(tok.read_bytes()[:3000])
    elif kind == "not json":
        tok.write_text("hello, not a tokenizer\n")
    elif kind == "other size":
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tok))
    elif kind == "empty":
        tok.write_bytes(b"")
    elif kind == "folder":
        tok.unlink()
        tok.mkdir()
    elif kind == "fifo":
        tok.unlink()
        os.mkfifo(tok)  # opening it would block for good
    else:  # "other": the same ids, another normaliser (other tokens for the same text)
        d = json.loads(tok.read_text())
        d["normalizer"] = {"type": "Lowercase"}
        tok.write_text(json.dumps(d))


@pytest.mark.parametrize("kind", ["truncated", "not json", "other size", "empty", "folder", "fifo"])
@pytest.mark.parametrize("cmd", [0, 1], ids=["eval", "generate"])
def test_damaged_tokenizer_json(run, capsys, cmd, kind):
    """`engram eval` never read the checkpoint's tokenizer.json (it scores with the one the run's config
    rebuilds): each damage is refused before the data is prepared, as generate and resume refuse it."""
    out, ckpt = run
    _damage_tokenizer(ckpt / "tokenizer.json", kind)
    refused(capsys, load_commands(out)[cmd], str(ckpt), "tokenizer.json")


def test_eval_refuses_another_runs_tokenizer(run, capsys):
    """A readable tokenizer.json of the model's size that is not the run's (the data would be scored with
    other ids than the model was trained on) is refused, as resume refuses it."""
    out, ckpt = run
    _damage_tokenizer(ckpt / "tokenizer.json", "other")
    refused(capsys, load_commands(out)[0], str(ckpt / "tokenizer.json"), "not the tokenizer of this run")


def test_intact_checkpoint_still_evaluates(trained, capsys):
    from engram.cli import main

    assert main(["eval", "--checkpoint", str(trained), "--json", *CPU]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 3 and 0 < result["results"]["model"]["loss"] < 10
