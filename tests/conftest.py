"""Shared fixtures: the DeepSeek-V4 tokenizer, its compression map and the V4.1 golden vectors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Triton's interpreter must be on before triton is first imported (its language module is decorated
# then), and transformers or torch may import triton while any test module is collected; so on a
# machine without CUDA it is switched on here, before collection, and tests/test_triton_kernels.py
# runs the kernels interpreted in the whole suite, not only when it runs alone.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engram import EngramConfig, NgramHasher, TokenizerCompression
from engram.addressing.compression import known_compression, resolve_tokenizer

DATA = Path(__file__).parent / "data"

# ENGRAM_TEST_FAKE_GPU=1 (opt-in, on a machine without CUDA): would this test pick the GPU on a GPU
# machine? torch claims one CUDA device, in this process from the first test on (`_fake_gpu`, after
# collection: skip marks and `gpu` tests still see the real machine) and in every python the tests
# start (tests/fake_gpu/sitecustomize.py, first on PYTHONPATH); code that would choose the GPU then
# fails loudly on the CPU build. The README's test section names the tests that fail under it by
# design (the device choice itself, and code that only looks at a visible GPU).
FAKE_GPU = os.environ.get("ENGRAM_TEST_FAKE_GPU") == "1" and not torch.cuda.is_available()
if FAKE_GPU:
    _fake = str(DATA.parent / "fake_gpu")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_fake, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def vectors() -> dict:
    return json.loads((DATA / "deepseek-v4.1-hash.json").read_text())


@pytest.fixture(scope="session")
def ds_tokenizer():
    return resolve_tokenizer("deepseek-v4")


@pytest.fixture(scope="session")
def ds_compression() -> TokenizerCompression:
    # the process's one map (built once, ~2 s), which the benchmarks and V4.1 checks run here use too
    return known_compression("deepseek-v4")


@pytest.fixture(scope="session")
def v41_hasher(ds_compression) -> NgramHasher:
    return NgramHasher(EngramConfig.preset("deepseek-v4.1"), ds_compression)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A folder of 12 short books of the Bible (tests/training_setup.py), for seconds-long training."""
    from training_setup import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session", autouse=True)
def _fake_gpu():
    """ENGRAM_TEST_FAKE_GPU=1: torch.cuda claims one device in this process (see FAKE_GPU above)."""
    if not FAKE_GPU:
        yield
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_gpu", DATA.parent / "fake_gpu" / "sitecustomize.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    with pytest.MonkeyPatch.context() as mp:
        for module, name, fn in fake.FAKE:
            mp.setattr(module, name, fn)
        yield


@pytest.fixture(scope="session", autouse=True)
def _dist_launches(_fake_gpu, request, tmp_path_factory):
    """The multi-process jobs registered by the session's test modules (tests/dist_launch.py): their
    torchrun launches start with the session's first test, in the background (one per world size)."""
    from dist_launch import Launcher

    owners = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    launcher = Launcher(owners)
    if launcher:
        launcher.start(tmp_path_factory.mktemp("dist-launch"), request.getfixturevalue("corpus"))
    yield launcher
    launcher.stop()


@pytest.fixture(scope="session")
def dist_launch(_dist_launches):
    """`dist_launch(world)` -> the folder of the session's torchrun launch with `world` ranks, once it
    ended: every rank's result of each job there (tests/dist_launch.py `results`)."""
    return _dist_launches


@pytest.fixture
def mkfifo():
    """`mkfifo(path)` makes a named pipe. Code that opens one blocks until a writer comes (a signal does not
    interrupt it), so a watchdog opens every such pipe for writing after 20 s: the blocked reader gets an
    empty file and the test fails at teardown, instead of hanging forever."""
    import os
    import threading

    fifos, blocked, done = [], [], threading.Event()

    def make(path):
        os.mkfifo(path)
        fifos.append(path)
        return path

    def watchdog():
        while not done.wait(20):
            for path in fifos:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only if a reader waits
                except OSError:
                    continue
                blocked.append(path)
                os.close(fd)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    yield make
    done.set()
    thread.join()
    assert not blocked, f"the code opened FIFO(s) {blocked} and blocked on them"


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests on machines without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
