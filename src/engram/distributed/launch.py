"""Starting one rank of a distributed run from torchrun's environment: the backend (NCCL on CUDA, gloo
on the CPU), the default process group with the collective timeout, the node's cores split over its
ranks. Knows nothing of models. Design: docs/distributed.md.
"""

from __future__ import annotations

import datetime
import enum
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engram.distributed.guard import DEFAULT_COLLECTIVE_TIMEOUT

__all__ = ["TORCHRUN_VARS", "Backend", "DistEnv", "init_distributed"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Backend(enum.StrEnum):
    """The process group's backend."""

    NCCL = "nccl"  # CUDA, one device per rank
    GLOO = "gloo"  # CPU


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    backend: Backend
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    backend: Backend | str | None = None,
    *,
    threads: int | None = None,
    timeout: float | None = None,
) -> DistEnv:
    """Start the default process group from torchrun's environment variables.

    backend: default NCCL when CUDA is available (device cuda:LOCAL_RANK, or cuda:0 when each rank
    sees one device), else GLOO (CPU).
    threads: torch threads of this rank (default: the cores split evenly over the node's ranks).
    timeout: seconds a collective waits for the other ranks before it fails (gloo raises; NCCL's
    watchdog ends the process), so a rank that died or diverged ends the job instead of hanging it
    (default DEFAULT_COLLECTIVE_TIMEOUT, 300 s).
    """
    if timeout is None:
        timeout = DEFAULT_COLLECTIVE_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(
            f"collective timeout {timeout!r}: give the seconds a collective may wait, a number > 0 "
            f"(default {DEFAULT_COLLECTIVE_TIMEOUT:g})"
        )
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"--distributed needs torchrun's environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: launch with "
            "`torchrun --nproc_per_node N -m engram train --distributed ...`"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend is None:
        backend = Backend.NCCL if torch.cuda.is_available() else Backend.GLOO
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"backend={backend!r}: use 'nccl' (CUDA) or 'gloo' (CPU)") from None
    if backend is Backend.NCCL:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (count > 1 and local_rank >= count):
            raise ValueError(
                f"backend nccl needs a CUDA device for LOCAL_RANK={local_rank}, found {count}: start at "
                "most that many ranks per node, or use gloo"
            )
        # one visible device: the launcher gave each rank its own GPU (CUDA_VISIBLE_DEVICES per rank)
        device = torch.device("cuda", local_rank if count > 1 else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kw: dict[str, Any] = {"device_id": device} if backend is Backend.NCCL else {}
        dist.init_process_group(backend.value, timeout=datetime.timedelta(seconds=timeout), **kw)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    # Ranks of a node share its cores: oversubscribing them (each rank using all) is far slower.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads or max(1, cores // local_world))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
