"""`--device` and `--dtype` on every command that trains or runs a model (train, demo, study, eval,
generate, hf-train, hf-eval): each bad value is one line, exit 2, before any work (no output folder
made, no checkpoint or model folder read: the paths given do not exist); CUDA visibility and bfloat16
support are patched in-process, so every refusal is tested on a CPU machine. Then the commands run on
the CPU end to end, `auto` resolving to what the machine has, bf16 where the CPU has bfloat16; marked
`gpu`: a run on the GPU evaluated and generated on the CPU, and hf-train on the GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_setup import refused
from engram import device as D
from engram.cli import main
from training_setup import tiny_cfg

AUTO = "cuda:0" if torch.cuda.is_available() else "cpu"


def gpus(monkeypatch: pytest.MonkeyPatch, count: int, capability: tuple[int, int] = (9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def commands(tmp: Path) -> dict[str, list[str]]:
    """Each command with paths that are not there: a refusal naming the device proves it came first."""
    corpus = tmp / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth.\n")
    gone = str(tmp / "missing")
    return {
        "train": ["train", "--preset", "tiny", "--out", str(tmp / "out")],
        "train --distributed": ["train", "--preset", "tiny", "--out", str(tmp / "out"), "--distributed"],
        "demo": ["demo", "--out", str(tmp / "out")],
        "study": ["study", "memory", "--out", str(tmp / "out")],
        "eval": ["eval", "--checkpoint", gone],
        "generate": ["generate", "--checkpoint", gone, "--prompt", "And"],
        "hf-train": ["hf-train", gone, "--corpus", str(corpus), "--out", str(tmp / "out")],
        "hf-eval": ["hf-eval", gone, "--corpus", str(corpus)],
    }


# (visible GPUs, their compute capability, CPU bfloat16, the options, what the one line says: the value
# and the fix)
BAD = {
    "cuda without a GPU": (
        0,
        (9, 0),
        True,
        ["--device", "cuda"],
        ("--device cuda: no CUDA device is visible", "use --device cpu"),
    ),
    "an index past the GPUs": (
        1,
        (9, 0),
        True,
        ["--device", "cuda:3"],
        ("--device cuda:3: this machine has 1 visible CUDA device (cuda:0)", "give one of those, or cuda"),
    ),
    "bf16 on a CPU without it": (
        0,
        (9, 0),
        False,
        ["--device", "cpu", "--dtype", "bf16"],
        ("--dtype bf16: this CPU has no bfloat16 arithmetic", "use --dtype float32"),
    ),
    "bf16 on an old GPU": (
        1,
        (7, 0),
        True,
        ["--device", "cuda", "--dtype", "bf16"],
        (
            "--dtype bf16: cuda:0 (Fake GPU, compute capability 7.0) has no bfloat16 arithmetic",
            "use --dtype float32",
        ),
    ),
    "not a device": (
        0,
        (9, 0),
        True,
        ["--device", "tpu"],
        ("--device 'tpu': not a device", f"give {D.DEVICE_HELP}"),
    ),
    "not a precision": (
        0,
        (9, 0),
        True,
        ["--dtype", "fp16"],
        ("--dtype 'fp16'", "give one of float32, bf16"),
    ),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize(
    "command", ["train", "train --distributed", "demo", "study", "eval", "generate", "hf-train", "hf-eval"]
)
def test_bad_devices_are_one_line_before_any_work(command, case, tmp_path, monkeypatch, capsys):
    count, capability, cpu_bf16, options, says = BAD[case]
    gpus(monkeypatch, count, capability)
    monkeypatch.setattr(D, "cpu_has_bf16", lambda: cpu_bf16)
    refused(capsys, commands(tmp_path)[command] + options, *says)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "hf-train"])
def test_a_gpu_index_under_distributed_is_refused(command, tmp_path, monkeypatch, capsys):
    gpus(monkeypatch, 2)
    argv = commands(tmp_path)[command] + ["--distributed", "--device", "cuda:1"]
    refused(
        capsys, argv, "--device cuda:1 with --distributed: each rank takes a GPU of its own", "--device cuda"
    )


def test_the_options_are_documented(capsys):
    for command in ("train", "demo", "study", "eval", "generate", "hf-train", "hf-eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--device DEVICE" in text and "--dtype DTYPE" in text and "cuda:N" in text, command


# ------------------------------------------------------------------------------------------- runs
def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def conf(corpus, tmp_path) -> Path:
    p = tmp_path / "train.json"
    p.write_text(json.dumps(tiny_cfg(corpus, steps=4, eval_every=0).to_dict()))
    return p


def test_train_eval_generate_on_the_cpu_and_auto(conf, tmp_path, capsys):
    out = tmp_path / "run"
    r = run_json(
        capsys,
        ["train", "--config", str(conf), "--out", str(out), "--device", "cpu", "--no-progress", "--json"],
    )
    state = json.loads((Path(r["checkpoint"]) / "state.json").read_text())
    assert r["step"] == 4 and (state["device"], state["precision"]) == ("cpu", "float32")
    cpu = run_json(capsys, ["eval", "--checkpoint", str(out), "--device", "cpu", "--json"])["results"][
        "model"
    ]
    auto = run_json(capsys, ["eval", "--checkpoint", str(out), "--json"])["results"]["model"]
    assert math.isfinite(cpu["loss"]) and auto["loss"] == pytest.approx(cpu["loss"], abs=1e-4)
    g = run_json(
        capsys,
        ["generate", "--checkpoint", str(out), "--prompt", "And", "--tokens", "3", "--greedy", "--json"],
    )
    assert (g["device"], g["precision"], len(g["token_ids"][0])) == (AUTO, "float32", 3)


@pytest.mark.skipif(not D.cpu_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
def test_bf16_on_a_cpu_with_bfloat16(conf, tmp_path, capsys):
    out = tmp_path / "run"
    bf16 = ["--device", "cpu", "--dtype", "bf16"]
    r = run_json(
        capsys, ["train", "--config", str(conf), "--out", str(out), *bf16, "--no-progress", "--json"]
    )
    assert math.isfinite(r["held_out"]["loss"])
    assert json.loads((Path(r["checkpoint"]) / "state.json").read_text())["precision"] == "bf16"
    low = run_json(capsys, ["eval", "--checkpoint", str(out), *bf16, "--json"])["results"]["model"]["loss"]
    full = run_json(capsys, ["eval", "--checkpoint", str(out), "--device", "cpu", "--json"])["results"][
        "model"
    ]["loss"]
    assert low == pytest.approx(r["held_out"]["loss"], abs=1e-9) and abs(low - full) < 0.02
    g = run_json(
        capsys, ["generate", "--checkpoint", str(out), "--prompt", "And", "--tokens", "2", *bf16, "--json"]
    )
    assert g["precision"] == "bf16" and len(g["token_ids"][0]) == 2


@pytest.mark.gpu
def test_a_gpu_run_evaluates_and_generates_on_the_cpu(conf, tmp_path, capsys):
    out = tmp_path / "run"
    gpu = ["--device", "cuda", "--dtype", "bf16"]
    r = run_json(capsys, ["train", "--config", str(conf), "--out", str(out), *gpu, "--no-progress", "--json"])
    state = json.loads((Path(r["checkpoint"]) / "state.json").read_text())
    assert (state["device"], state["precision"]) == ("cuda:0", "bf16")
    on_gpu = run_json(capsys, ["eval", "--checkpoint", str(out), *gpu, "--json"])["results"]["model"]["loss"]
    on_cpu = run_json(capsys, ["eval", "--checkpoint", str(out), "--device", "cpu", "--json"])["results"][
        "model"
    ]["loss"]
    assert on_gpu == pytest.approx(r["held_out"]["loss"], abs=1e-6) and abs(on_cpu - on_gpu) < 0.02
    for device in ("cpu", "cuda"):
        argv = ["generate", "--checkpoint", str(out), "--prompt", "And", "--tokens", "3", "--device", device]
        assert len(run_json(capsys, [*argv, "--json"])["token_ids"][0]) == 3
    # and back: the GPU run resumed on the CPU (float32) to more steps
    r = run_json(
        capsys,
        [
            "train",
            "--config",
            str(conf),
            "--out",
            str(out),
            "--resume",
            "--steps",
            "6",
            "--device",
            "cpu",
            "--no-progress",
            "--json",
        ],
    )
    assert r["step"] == 6 and math.isfinite(r["held_out"]["loss"])


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.skipif(not D.cpu_has_bf16(), reason="no bfloat16 on this CPU")),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_hf_train_in_bf16_evaluates_on_the_cpu(device, tmp_path, capsys):
    """hf-train with the HF Trainer's bf16 (use_cpu on the CPU), then hf-eval of OUT on the CPU in
    float32 and on the training device in bf16."""
    import hf_setup as S

    folder = S.save_folder(tmp_path / "tiny-llama", layers=3, seed=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(S.TEXT * 20), encoding="utf-8")
    out = tmp_path / "out"
    fast = ["--batch-size", "4", "--seq-len", "32", "--steps", "4", "--no-progress", "--json"]
    bf16 = ["--device", device, "--dtype", "bf16"]
    r = run_json(capsys, ["hf-train", str(folder), "--corpus", str(corpus), "--out", str(out), *fast, *bf16])
    where = "cuda:0" if device == "cuda" else "cpu"
    assert (r["device"], r["precision"]) == (where, "bf16") and math.isfinite(r["held_out"]["loss"])
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"]
    full = run_json(capsys, ["hf-eval", str(out), "--corpus", str(corpus), "--device", "cpu", "--json"])
    low = run_json(
        capsys, ["hf-eval", str(out), "--corpus", str(corpus), *bf16, "--batch-size", "4", "--json"]
    )
    assert (full["device"], full["precision"], low["device"], low["precision"]) == (
        "cpu",
        "float32",
        where,
        "bf16",
    )
    assert low["loss"] == pytest.approx(r["held_out"]["loss"], abs=1e-3)  # the run's own, its batches
    assert full["loss"] == pytest.approx(low["loss"], abs=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_train_distributed_with_nccl_one_gpu_a_rank(ranks, conf, tmp_path, capsys):
    """torchrun --distributed --device cuda: NCCL, each rank on cuda:LOCAL_RANK, the tables row-sharded
    and their rows exchanged on the GPUs; the run equals one process on the GPU within rounding, and its
    sharded checkpoint evaluates on the CPU."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    train = ["-m", "engram", "train", "--config", str(conf), "--out", str(out), "--distributed"]
    p = subprocess.run(
        [*launch, *train, "--device", "cuda", "--sharded-checkpoints", "--no-progress", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert json.loads((Path(r["checkpoint"]) / "state.json").read_text())["device"] == "cuda:0"
    one = [
        "train",
        "--config",
        str(conf),
        "--out",
        str(tmp_path / "one"),
        "--device",
        "cuda",
        "--no-progress",
    ]
    single = run_json(capsys, [*one, "--json"])
    assert r["held_out"]["loss"] == pytest.approx(single["held_out"]["loss"], abs=2e-3)
    cpu = run_json(capsys, ["eval", "--checkpoint", str(out), "--device", "cpu", "--json"])["results"][
        "model"
    ]
    assert cpu["loss"] == pytest.approx(r["held_out"]["loss"], abs=2e-3)
