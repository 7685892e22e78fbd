"""engram.device: --device strings to torch devices, CUDA visibility refused where it is missing (made
visible or not here by patching torch.cuda in-process, so every refusal is tested on a CPU machine),
the precision check, autocast and the batch copy."""

from __future__ import annotations

import pytest
import torch

from engram import device as D
from engram.device import Precision, autocast, check_precision, resolve_device, to_device


def gpus(monkeypatch: pytest.MonkeyPatch, count: int, capability: tuple[int, int] = (9, 0)) -> None:
    """Make torch see `count` CUDA devices of `capability` (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_cpu_and_auto_without_a_gpu(monkeypatch):
    gpus(monkeypatch, 0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_is_the_first_gpu_when_there_is_one(monkeypatch):
    gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)  # an index: equal to the parameters' devices
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 0)


def test_this_machine_resolves_auto_to_what_it_has():
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want


def test_cuda_without_a_gpu_is_refused_naming_the_fix(monkeypatch):
    gpus(monkeypatch, 0)
    for text in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(ValueError) as e:
            resolve_device(text)
        assert str(e.value) == (
            f"--device {text}: no CUDA device is visible (torch.cuda.is_available() is False); use --device "
            "cpu (or auto)"
        )
    with pytest.raises(ValueError, match=r"^device cuda:0: no CUDA device"):
        resolve_device(torch.device("cuda", 0), "device")


def test_an_index_past_the_visible_gpus_is_refused(monkeypatch):
    gpus(monkeypatch, 1)
    with pytest.raises(ValueError) as e:
        resolve_device("cuda:3")
    assert (
        str(e.value)
        == "--device cuda:3: this machine has 1 visible CUDA device (cuda:0); give one of those, or cuda"
    )
    gpus(monkeypatch, 4)
    with pytest.raises(ValueError, match=r"4 visible CUDA devices \(cuda:0..cuda:3\)"):
        resolve_device("cuda:4")


@pytest.mark.parametrize("text", ["tpu", "cuda:-1", "cuda:x", "cpu:1", "auto:0", "", "cuda:", "mps"])
def test_malformed_devices_are_refused(text):
    with pytest.raises(ValueError) as e:
        resolve_device(text)
    assert str(e.value) == f"--device {text!r}: not a device; give {D.DEVICE_HELP}"


def test_other_device_types_are_refused():
    with pytest.raises(ValueError, match=r"^--device meta: engram trains on cpu or cuda"):
        resolve_device(torch.device("meta"))


def test_float32_runs_everywhere(monkeypatch):
    gpus(monkeypatch, 1, capability=(6, 0))
    monkeypatch.setattr(D, "cpu_has_bf16", lambda: False)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        assert check_precision("float32", device) is Precision.FLOAT32


def test_bf16_needs_bfloat16_arithmetic(monkeypatch):
    gpus(monkeypatch, 1, capability=(7, 0))
    with pytest.raises(ValueError) as e:
        check_precision("bf16", torch.device("cuda", 0))
    assert str(e.value) == (
        "--dtype bf16: cuda:0 (Fake GPU, compute capability 7.0) has no bfloat16 arithmetic (it needs 8.0 or "
        "more); use --dtype float32"
    )
    gpus(monkeypatch, 1, capability=(8, 0))
    assert check_precision("bf16", torch.device("cuda", 0)) is Precision.BF16
    monkeypatch.setattr(D, "cpu_has_bf16", lambda: False)
    with pytest.raises(
        ValueError, match=r"^--dtype bf16: this CPU has no bfloat16 arithmetic .*use --dtype float32"
    ):
        check_precision("bf16", torch.device("cpu"))
    monkeypatch.setattr(D, "cpu_has_bf16", lambda: True)
    assert check_precision(Precision.BF16, torch.device("cpu")) is Precision.BF16


@pytest.mark.parametrize("text", ["fp16", "float16", "bfloat16", ""])
def test_other_precisions_are_refused(text):
    with pytest.raises(ValueError) as e:
        check_precision(text, torch.device("cpu"))
    assert str(e.value) == f"--dtype {text!r}: give one of float32, bf16"


def test_autocast_runs_matmuls_in_bf16_only_when_asked():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    cpu = torch.device("cpu")
    with autocast(cpu, Precision.FLOAT32):
        assert (a @ b).dtype == torch.float32
    with autocast(cpu, Precision.BF16):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(a, torch.zeros(4, dtype=torch.int64)).dtype == torch.float32
    assert (a @ b).dtype == torch.float32  # the context ends with the block


def test_to_device_keeps_host_tensors_as_they_are():
    t = torch.arange(6)
    assert to_device(t, torch.device("cpu")) is t


@pytest.mark.gpu
def test_to_device_copies_a_batch_to_the_gpu():
    t = torch.arange(1000).view(10, 100)
    g = to_device(t, torch.device("cuda", 0))
    assert g.device == torch.device("cuda", 0) and torch.equal(g.cpu(), t)
    assert to_device(g, torch.device("cuda", 0)) is g
