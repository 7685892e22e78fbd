"""Shared fixtures: the DeepSeek-V4 tokenizer, its compression map and the V4.1 golden vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engram import EngramConfig, NgramHasher, TokenizerCompression
from engram.addressing.compression import resolve_tokenizer

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def vectors() -> dict:
    return json.loads((DATA / "deepseek-v4.1-hash.json").read_text())


@pytest.fixture(scope="session")
def ds_tokenizer():
    return resolve_tokenizer("deepseek-v4")


@pytest.fixture(scope="session")
def ds_compression(ds_tokenizer) -> TokenizerCompression:
    return TokenizerCompression.from_tokenizer(ds_tokenizer)


@pytest.fixture(scope="session")
def v41_hasher(ds_compression) -> NgramHasher:
    return NgramHasher(EngramConfig.preset("deepseek-v4.1"), ds_compression)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A folder of 12 short books of the Bible (tests/training_setup.py), for seconds-long training."""
    from training_setup import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def no_hang():
    """Fail the test (TimeoutError) instead of hanging past 60 s: for code that could block forever,
    such as opening a FIFO."""
    import signal

    def expire(signum, frame):
        raise TimeoutError("blocked for 60 s (opened a FIFO?)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests on machines without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
