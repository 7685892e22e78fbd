"""The Hugging Face guide's "The tools you already use" blocks (docs/guides/huggingface.md; the README's
section until the README became a front page), run as written on a tiny Engram model saved as
`my-engram-model` in a scratch folder: each Python block after the first (which loads the model) in a
namespace of its own, the lm-eval command lines with a local task in place of the guide's (nothing is
downloaded here) and HF's offline flags."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("lm_eval")

GUIDE = Path(__file__).parent.parent / "docs" / "guides" / "huggingface.md"
TASKS_DIR = Path(__file__).parent / "data" / "lm_eval_tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the section."""
    text = GUIDE.read_text()
    section = text.split("## The tools you already use", 1)[1].split("\n#", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    model = add_engram(S.llama(), S.engram_config(), tokenizer=S.tokenizer())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.3)
    model.save_pretrained(tmp_path / "my-engram-model")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    ).save_pretrained(tmp_path / "my-engram-model")
    monkeypatch.chdir(tmp_path)
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def test_the_section_has_a_block_per_tool():
    code = "\n".join(c for _, c in blocks())
    for tool in ("from_pretrained", "pipeline", "lm_eval", "peft", "trl", "torch.compile"):
        assert tool in code, tool


@pytest.mark.parametrize(
    "index",
    [  # TRL's trainer and torch.compile (3 s, 11 s): in .ci/run's slow step
        pytest.param(i, marks=[pytest.mark.slow] if i >= 3 else [])
        for i in range(1, len([b for b in blocks() if b[0] == "python"]))
    ],
)
def test_python_block_runs(workdir, index):
    python = [c for lang, c in blocks() if lang == "python"]
    ns: dict = {}
    exec(compile(python[0], "guide block 0", "exec"), ns)
    assert type(ns["model"]).__name__ == "EngramLlamaForCausalLM"
    exec(compile(python[index], f"guide block {index}", "exec"), ns)


@pytest.mark.slow  # two lm-eval command lines, ~30 s: run by .ci/run's slow step
def test_lm_eval_command_lines_run(workdir):
    (cmds,) = [c for lang, c in blocks() if lang == "bash"]
    for line in cmds.strip().splitlines():
        argv = shlex.split(line.replace("lambada_openai", "engram_genesis_ll"))
        argv += ["--include_path", str(TASKS_DIR), "--device", "cpu"]
        exe = Path(sys.executable).parent / argv[0]
        run = subprocess.run(
            [str(exe), *argv[1:]], env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "engram_genesis_ll" in run.stdout, run.stdout[-2000:]
