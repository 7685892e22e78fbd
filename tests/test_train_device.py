"""Training on a device (engram.apps.lm.train.Trainer's `device` and `precision`): the checkpoint holds
host tensors and records, never pins, where and how it was trained, so a run resumes, evaluates and
generates on another device, in either precision. On a CPU machine: the refusals before any work, a
checkpoint recorded as a GPU bf16 run resuming on the CPU exactly, loads onto another device ('meta'),
bf16 autocast on a CPU with bfloat16 arithmetic. Marked `gpu` (skipped without CUDA): runs moved
between cuda:0 and the CPU, equal within float rounding, and bf16 on the GPU close to float32."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engram import device as D
from engram.apps.lm.evaluation import window_rows
from engram.apps.lm.generate import generate, load_generator
from engram.apps.lm.train import (
    Trainer,
    build_model,
    evaluate,
    latest_checkpoint,
    load_trained_model,
    prepare_data,
)
from engram.checkpoint.files import load_tensors
from training_setup import tiny_cfg

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
LOSS_TOL = 2e-3  # nats/token: the same run on the CPU and the GPU (float32, a few steps: rounding only)
BF16_TOL = 0.1  # nats/token: a bf16 run against its float32 twin after 24 steps


@pytest.fixture(scope="module")
def data(corpus):
    return prepare_data(tiny_cfg(corpus))


def cfg_of(corpus, steps=8):
    return tiny_cfg(corpus, steps=steps, eval_every=0)


def trained(cfg, data, device, out=None, until=None, precision="float32") -> Trainer:
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=out, device=device, precision=precision)
    t.run(until=until)
    return t


def losses(t: Trainer) -> list[float]:
    return [h["train_loss"] for h in t.history]


# ------------------------------------------------------------------------------------------- CPU
def test_a_missing_gpu_is_refused_before_the_model_moves(corpus, data, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = cfg_of(corpus)
    model = build_model(cfg, data)
    with pytest.raises(ValueError, match=r"^device cuda: no CUDA device is visible .*use device cpu"):
        Trainer(cfg, data, model, device="cuda")
    monkeypatch.setattr(D, "cpu_has_bf16", lambda: False)
    with pytest.raises(ValueError, match=r"^precision bf16: this CPU has no bfloat16 arithmetic"):
        Trainer(cfg, data, model, device="cpu", precision="bf16")
    assert all(p.device == CPU for p in model.parameters())


def test_the_trainer_puts_the_model_and_batches_on_its_device(corpus, data):
    cfg = cfg_of(corpus)
    t = Trainer(cfg, data, build_model(cfg, data), device="auto")
    want = GPU if torch.cuda.is_available() else CPU
    assert t.device == want and all(p.device == want for p in t.model.parameters())
    x, y, rows = t._batch(0)
    assert x.device == y.device == rows.device == want


def test_a_checkpoint_records_but_does_not_pin_its_device_and_precision(corpus, data, tmp_path):
    """A checkpoint whose state.json says it was trained on cuda:0 in bf16 (what a GPU run writes; its
    files hold host tensors either way) resumes on the CPU in float32, equal to the uninterrupted run."""
    cfg = cfg_of(corpus)
    straight = trained(cfg, data, CPU)
    first = trained(cfg, data, CPU, out=tmp_path, until=4)
    ckpt = latest_checkpoint(tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["device"], state["precision"]) == ("cpu", "float32")
    state.update(device="cuda:0", precision="bf16")
    (ckpt / "state.json").write_text(json.dumps(state))
    resumed = Trainer(cfg, data, build_model(cfg.replace(seed=5), data), out_dir=tmp_path, device="cpu")
    resumed.resume_from(ckpt)
    resumed.run()
    assert losses(resumed) == losses(straight) and first.step == 4
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    _, model, _ = load_trained_model(tmp_path, device=torch.device("meta"))  # the loader's device, any
    assert all(p.device.type == "meta" for p in model.parameters())
    _, model, _ = load_trained_model(tmp_path)
    assert all(p.device == CPU for p in model.parameters())


@pytest.mark.skipif(not D.cpu_has_bf16(), reason="this CPU has no bfloat16 arithmetic")
def test_bf16_on_a_cpu_trains_close_to_float32_and_resumes_in_float32(corpus, data, tmp_path):
    cfg = cfg_of(corpus, steps=24)
    fp32 = trained(cfg, data, CPU)
    bf16 = trained(cfg, data, CPU, out=tmp_path, until=12, precision="bf16")
    assert all(math.isfinite(v) for v in losses(bf16))
    assert losses(bf16) != losses(fp32)[:12]  # autocast did run the matmuls in bf16
    assert max(abs(a - b) for a, b in zip(losses(bf16), losses(fp32), strict=False)) < BF16_TOL
    resumed = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path, device="cpu")  # float32
    resumed.resume_from(latest_checkpoint(tmp_path))
    resumed.run()
    assert resumed.precision is D.Precision.FLOAT32 and resumed.step == 24
    assert abs(resumed.evaluate()["loss"] - fp32.evaluate()["loss"]) < BF16_TOL
    held = bf16.evaluate()["loss"]  # evaluation in bf16 too, close to the same model's float32 one
    bf16.precision = D.Precision.FLOAT32
    assert abs(bf16.evaluate()["loss"] - held) < 0.02


# ------------------------------------------------------------------------------------------- GPU
def cpu_twin(path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model of a run folder loaded twice: on the CPU and on cuda:0."""
    return load_trained_model(path, device=CPU)[1], load_trained_model(path, device=GPU)[1]


@pytest.mark.gpu
def test_a_gpu_run_evaluates_generates_and_resumes_on_the_cpu(corpus, data, tmp_path):
    cfg = cfg_of(corpus)
    straight = trained(cfg, data, GPU, out=tmp_path / "straight")
    assert all(p.device == GPU for p in straight.model.parameters())
    # evaluate: the GPU run's checkpoint on the CPU scores what the GPU scores
    on_cpu, on_gpu = cpu_twin(tmp_path / "straight")
    a = evaluate(on_cpu, data.held_out, data.held_rows, cfg.seq_len)["loss"]
    b = evaluate(on_gpu, data.held_out, data.held_rows, cfg.seq_len)["loss"]
    assert a == pytest.approx(b, abs=1e-4) and a == pytest.approx(straight.evaluate()["loss"], abs=1e-4)
    # generate: the same next-token logits on both devices, and a continuation on each
    for device in (CPU, GPU):
        model, tok, hasher, _ = load_generator(tmp_path / "straight", device=device)
        out = generate(model, tok.encode("And the LORD").ids, hasher, max_new_tokens=6, greedy=True)
        assert out.new_ids.shape == (1, 6) and out.token_ids.device == device
    starts = data.held_out.eval_starts(cfg.seq_len, 256)
    x = torch.from_numpy(data.held_out.windows(starts, cfg.seq_len)[0])  # (B, T)
    rows = window_rows(data.held_rows, starts, cfg.seq_len)  # (B, T, layers, heads)
    with torch.no_grad():
        la, lb = on_cpu(x, rows), on_gpu(x.to(GPU), rows.to(GPU)).cpu()
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    # resume: half on the GPU, the rest on the CPU, as the uninterrupted GPU run
    trained(cfg, data, GPU, out=tmp_path / "moved", until=4)
    resumed = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path / "moved", device="cpu")
    resumed.resume_from(latest_checkpoint(tmp_path / "moved"))
    assert resumed.step == 4 and all(
        v.device == CPU for st in resumed.table_opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
    resumed.run()
    assert losses(resumed) == pytest.approx(losses(straight), abs=LOSS_TOL)
    assert resumed.evaluate()["loss"] == pytest.approx(straight.evaluate()["loss"], abs=LOSS_TOL)


@pytest.mark.gpu
def test_a_cpu_run_resumes_on_the_gpu(corpus, data, tmp_path):
    cfg = cfg_of(corpus)
    straight = trained(cfg, data, CPU)
    trained(cfg, data, CPU, out=tmp_path, until=4)
    resumed = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path, device="cuda")
    resumed.resume_from(latest_checkpoint(tmp_path))
    states = [
        v for st in (*resumed.table_opt.state.values(), *resumed.opt.state.values()) for v in st.values()
    ]
    assert all(
        v.device == GPU for v in states if torch.is_tensor(v) and v.dim() > 0
    )  # torch's step: a host scalar
    resumed.run()
    assert losses(resumed) == pytest.approx(losses(straight), abs=LOSS_TOL)
    assert resumed.evaluate()["loss"] == pytest.approx(straight.evaluate()["loss"], abs=LOSS_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("table_optimizer", ["adam", "sinkhorn"])
def test_bf16_on_the_gpu_trains_close_to_float32(corpus, data, tmp_path, table_optimizer):
    cfg = cfg_of(corpus, steps=24).replace(table_optimizer=table_optimizer)
    fp32 = trained(cfg, data, GPU)
    bf16 = trained(cfg, data, GPU, out=tmp_path, precision="bf16")
    assert all(math.isfinite(v) for v in losses(bf16)) and losses(bf16) != losses(fp32)
    assert max(abs(a - b) for a, b in zip(losses(bf16), losses(fp32), strict=True)) < BF16_TOL
    assert abs(bf16.evaluate()["loss"] - fp32.evaluate()["loss"]) < BF16_TOL
    saved = load_tensors(latest_checkpoint(tmp_path) / "model.safetensors")  # float32 master weights
    assert {t.dtype for t in saved.values()} == {torch.float32}
    on_cpu = load_trained_model(tmp_path, device=CPU)[1]
    held = evaluate(on_cpu, data.held_out, data.held_rows, cfg.seq_len)["loss"]
    bf16.precision = D.Precision.FLOAT32  # the same weights scored in float32 on the GPU
    assert held == pytest.approx(bf16.evaluate()["loss"], abs=1e-4)
