"""ENGRAM_TEST_FAKE_GPU=1 (tests/conftest.py, on a machine without CUDA): torch claims one CUDA device
that it does not have, so code that would choose the GPU on a GPU machine fails loudly on the CPU
build (`.to('cuda')`, `set_device`, NCCL): a test that passes under it stays on the CPU there too.

tests/conftest.py puts this folder first on PYTHONPATH, so every python the tests start (torchrun,
its ranks, `python -m engram`, spawned gloo ranks) imports this at start-up; the test process itself
applies `FAKE` from its conftest. CUDA_VISIBLE_DEVICES="" hides the fake device as it hides real ones.
"""

import os

import torch

_cpu_rng = torch.get_rng_state()  # a state of the right type for the fake device's RNG


def _get_rng_state(device="cuda"):
    return _cpu_rng.clone()


def _set_rng_state(new_state, device="cuda"):
    pass


# (module, attribute, replacement): one visible device, and the device's RNG state, which code that
# sees a GPU saves and restores without computing on it (torch.random.fork_rng, the HF Trainer's
# checkpoints: torch.cuda.random.get_rng_state_all), harmless on a real GPU
FAKE = [
    (torch.cuda, "is_available", lambda: True),
    (torch.cuda, "device_count", lambda: 1),
    *((m, "get_rng_state", _get_rng_state) for m in (torch.cuda, torch.cuda.random)),
    *((m, "set_rng_state", _set_rng_state) for m in (torch.cuda, torch.cuda.random)),
]

started = __name__ == "sitecustomize"  # imported at a python's start-up (conftest loads it by path)
if started and os.environ.get("ENGRAM_TEST_FAKE_GPU") == "1" and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    for _module, _name, _fn in FAKE:
        setattr(_module, _name, _fn)
