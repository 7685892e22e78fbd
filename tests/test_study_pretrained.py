"""`engram study pretrained` (engram.apps.study.pretrained) --quick on a tiny random Llama HF folder built
here (hidden 32, 3 layers, the ~300-id BPE of tests/hf_setup.py) and the demo's split of the King James
Bible: every arm runs at equal tokens, the report holds the table, the pilot and the plot, a second run
reuses every record, a run trained but killed before its evaluation is evaluated without training again.
SmolLM2-135M itself: a test marked pretrained and slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_setup as S
from cli_setup import CPU
from engram.apps.study import pretrained as SP
from engram.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

# the runs compared are the CPU's: run_pretrained's default is the GPU when there is one
HOST = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return S.save_folder(d, layers=3, seed=1)


@pytest.fixture(scope="module")
def study(folder, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("study")
    r = SP.run_pretrained(
        out, model=str(folder), seeds=(0, 1), quick=True, progress=False, threads=1, device=HOST
    )
    return out, r


def test_quick_study_runs_every_arm_at_equal_tokens(study):
    out, r = study
    names = [s["variant"] for s in r["summary"]]
    assert names == ["no training", "LoRA", "Engram", "LoRA + Engram"]  # no full fine-tuning with --quick
    by = {s["variant"]: s for s in r["summary"]}
    plan = SP.pretrained_plan(quick=True)
    for name in ("LoRA", "Engram", "LoRA + Engram"):
        assert by[name]["tokens"] == plan.tokens() == 4 * 4 * 32
        assert len(by[name]["losses"]) == 2 and by[name]["seconds_per_token"] > 0
    assert by["LoRA"]["cost_vs_lora"] == 1.0
    assert by["no training"]["tokens"] == 0 and by["no training"]["spread"] == 0.0
    assert by["no training"]["seeds"] == [0, 1]  # one record, paired with every seed
    assert all("one seed" not in f for f in r["findings"])
    assert by["LoRA"]["added_params"] == 0 and by["LoRA"]["trained_params"] > 0
    assert by["Engram"]["added_params"] > 0 and by["Engram"]["added_bytes"] > by["Engram"]["added_params"]
    assert (
        by["LoRA + Engram"]["trained_params"] == by["LoRA"]["trained_params"] + by["Engram"]["added_params"]
    )
    for s in r["summary"]:
        for k in ("accuracy", "memory", "generalisation", "cloze"):
            assert 0.0 <= s[k]["mean"] <= 1.0
    assert r["cloze_items"] > 0 and r["eval_tokens"] == plan.eval_blocks * (plan.seq_len - 1)
    assert r["held_out_documents"][0] == "Deuteronomy"  # the demo's held-out books
    assert len(r["pilot"]) >= 2 and r["chosen"]["layers"] in [p["layers"] for p in r["pilot"]]
    report = (out / "pretrained" / "report.md").read_text()
    assert "| LoRA + Engram |" in report and "## Pilot" in report and "(chosen)" in report
    assert "Adding Engram to LoRA" in report
    assert (out / "pretrained" / "pretrained.png").stat().st_size > 1000
    assert json.loads((out / "pretrained" / "results.json").read_text())["study"] == "pretrained"


def test_rerun_reuses_records_and_evaluates_a_run_killed_before_its_record(
    study, folder, monkeypatch, capsys
):
    """Every record reused; a run whose folder was written but not its record (killed between the two)
    is evaluated again, not trained (the CLI, on the same folder)."""
    out, r = study
    assert r["new_runs"] > 0
    lora = next(x for x in r["runs"] if x["arm"] == "LoRA" and x["seed"] == 1)
    (out / "runs" / f"{lora['key']}.json").unlink()
    monkeypatch.setattr(SP, "train_folder", lambda *a, **kw: pytest.fail("trained again"))
    monkeypatch.chdir(out.parent)  # the same folder spelt another way: its records still match
    argv = ["study", "pretrained", "--quick", "--model", str(folder), "--out", out.name]
    assert main([*argv, "--no-progress", "--threads", "1", "--json", *CPU]) == 0
    cap = capsys.readouterr()
    got = json.loads(cap.out)[0]
    assert "Loading weights" not in cap.err  # --no-progress: transformers' bars off too
    assert got["study"] == "pretrained" and got["findings"]
    again = json.loads((out / "pretrained" / "results.json").read_text())
    assert again["new_runs"] == 1 and again["seeds"] == [0, 1]  # the CLI's default: 2 seeds
    assert [s["mean"] for s in again["summary"]] == pytest.approx([s["mean"] for s in r["summary"]])


def test_a_run_killed_during_training_resumes_its_partial_folder(folder, tmp_path, monkeypatch):
    """kill -9 in training leaves train_folder's partial folder: the next study resumes it."""
    from engram.apps.hf.train import partial_folder

    real = SP.train_folder
    calls: list[bool] = []

    def killed(s, *, resume, **kw):
        calls.append(resume)
        if len(calls) == 1:  # the first run dies after its partial folder was made
            partial_folder(s.out).mkdir(parents=True)
            raise KeyboardInterrupt
        return real(s, resume=resume, **kw)

    monkeypatch.setattr(SP, "train_folder", killed)
    plan = SP.pretrained_plan(quick=True)
    with pytest.raises(KeyboardInterrupt):
        SP.run_pretrained(tmp_path, model=str(folder), seeds=(0,), progress=False, plan=plan, device=HOST)
    assert list((tmp_path / "runs").glob("*.json")) == [] and calls == [False]
    r = SP.run_pretrained(tmp_path, model=str(folder), seeds=(0,), progress=False, plan=plan, device=HOST)
    assert calls[1] is True  # the same run, resumed
    assert not any(p.name.endswith(".engram-partial") for p in (tmp_path / "runs").iterdir())
    assert len(r["summary"]) == 4


def test_cli_refusals(folder, tmp_path, capsys):
    def refused(*argv: str) -> str:
        assert main(["study", *argv, "--out", str(tmp_path), "--no-progress", *CPU]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        return err

    assert "no such folder" in refused("pretrained", "--quick", "--model", str(tmp_path / "none"))
    assert "drop --model" in refused("memory", "--quick", "--model", str(folder))
    small = tmp_path / "small.txt"
    small.write_text("In the beginning God created the heaven and the earth.\n" * 3)
    assert "give a larger corpus" in refused(
        "pretrained", "--quick", "--model", str(folder), "--corpus", str(small)
    )
    assert "drop --size" in refused("pretrained", "--quick", "--size", "tiny", "--model", str(folder))


@pytest.mark.pretrained
@pytest.mark.slow
def test_smollm2_quick(tmp_path):
    pytest.importorskip("gguf")
    from engram.hf.gguf import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    plan = SP.pretrained_plan(quick=True)
    r = SP.run_pretrained(tmp_path, seeds=(0,), quick=True, progress=False, plan=plan)
    assert (tmp_path / SP.BASE_NAME / "config.json").is_file()
    by = {s["variant"]: s for s in r["summary"]}
    assert by["no training"]["mean"] < 5.0  # a pretrained model on English text
    assert r["model_layers"] == 30
