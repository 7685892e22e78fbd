"""Gloo ranks of their own, for multi-process tests that must not run in the suite's shared launches
(tests/dist_launch.py): a rank under a real memory cap, or one whose failure would leave a shared
launch's later jobs out of step. `spawn(job, world, folder, *args)` starts `world` processes (one torch
thread each, a gloo group over a file store in `folder`, no GPU visible), runs `job(rank, *args)` on
each and returns the ranks' results; a rank that raised fails the test with its traceback. Also a free
port on 127.0.0.1 and torchrun's environment for a 1-rank group in the test's own process."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAILED = "gloo_ranks_failed"  # a rank's result when its job raised: the traceback


def spawn(
    job: Callable[..., Any], world: int, folder: str | Path, *args: Any, timeout_s: float = 120
) -> list[Any]:
    """Every rank's `job(rank, *args)` (a module-level function: the ranks import it by name), on the
    CPU whatever GPUs the machine has (`_no_gpu`)."""
    with _no_gpu():
        mp.spawn(_rank, args=(job, world, str(folder), args, timeout_s), nprocs=world)
    out = [torch.load(Path(folder) / f"rank-{r}.pt", weights_only=False) for r in range(world)]
    for rank, res in enumerate(out):
        if isinstance(res, dict) and FAILED in res:
            pytest.fail(f"rank {rank} of {world} raised:\n{res[FAILED]}")
    return out


@contextlib.contextmanager
def _no_gpu() -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES="" for the ranks started in it (they inherit this process's environment):
    their jobs' tensors are on the CPU under gloo, and library code that picks a GPU when one is visible
    (an `auto` device, FSDP's default device mesh) must not on a GPU machine. This process's own CUDA,
    if started, is not affected (CUDA reads the variable once); the variable is restored after."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _rank(rank: int, job: Callable[..., Any], world: int, folder: str, args: tuple, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    try:
        res = job(rank, *args)
    except Exception:
        res = {FAILED: traceback.format_exc()}
    torch.save(res, f"{folder}/rank-{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment for a 1-rank group in this process (a free port)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for k, v in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
