"""Starting one rank of a distributed run from torchrun's environment: where the rank's tensors live
and the backend that carries them (`rank_backend`, the one rule: gloo on the CPU, NCCL on a GPU of
the rank's own), the default process group with the collective timeout, the node's cores split over
its ranks. Knows nothing of models. Design: docs/distributed.md.
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

__all__ = ["TORCHRUN_VARS", "Backend", "DistEnv", "init_distributed", "rank_backend"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The environment variables torchrun sets that `init_distributed` needs."""


class Backend(enum.StrEnum):
    """The process group's backend.

    Attributes:
        NCCL: CUDA, one device per rank.
        GLOO: CPU.
    """

    NCCL = "nccl"  # CUDA, one device per rank
    GLOO = "gloo"  # CPU


@dataclass(frozen=True)
class DistEnv:
    """Where this rank stands in the run: what `init_distributed` returns.

    Args:
        rank: This process's global rank.
        world: The number of ranks.
        local_rank: Its rank on this node.
        backend: The process group's backend.
        device: Where this rank's tensors live (cpu, or cuda:LOCAL_RANK).
    """

    rank: int
    world: int
    local_rank: int
    backend: Backend
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that writes what is written once)."""
        return self.rank == 0


def rank_backend(
    device: torch.device | str, local_rank: int, local_world: int
) -> tuple[Backend, torch.device]:
    """The backend and device of a local rank: the backend follows where the tensors live, not the machine.

    'cpu': gloo, whatever GPUs there are (a job of CPU tensors on a GPU machine stays on gloo).
    'cuda': NCCL on cuda:LOCAL_RANK, only when every local rank has a GPU of its own (local_world <=
    torch.cuda.device_count()): NCCL cannot put two ranks on one GPU, it fails or hangs there, so
    that is refused here with the numbers and the fix, before any process group exists.

    Args:
        device: Where the job's tensors live: 'cpu' or 'cuda' (no index).
        local_rank: This rank's LOCAL_RANK.
        local_world: The ranks on this node.

    Returns:
        The pair (backend, device).

    Raises:
        TypeError: `device` is not a string or torch.device.
        ValueError: A bad LOCAL_RANK or device, no CUDA device, or fewer GPUs than local ranks.

    Examples:
        >>> from engram.distributed import rank_backend
        >>> rank_backend("cpu", local_rank=1, local_world=2)
        (<Backend.GLOO: 'gloo'>, device(type='cpu'))
    """
    if not isinstance(device, torch.device | str):
        raise TypeError(f"device must be 'cpu', 'cuda' or a torch.device, got {type(device).__name__}")
    if not 0 <= local_rank < local_world:
        raise ValueError(
            f"LOCAL_RANK={local_rank} with {local_world} local ranks: want 0 <= LOCAL_RANK < that"
        )
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device: give 'cpu' (gloo) or 'cuda' (NCCL)") from None
    if dev.type == "cpu":
        return Backend.GLOO, torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: ranks run on 'cpu' (gloo) or 'cuda' (NCCL)")
    if dev.index is not None:
        raise ValueError(
            f"device {device!r}: each rank takes the GPU of its LOCAL_RANK (cuda:LOCAL_RANK); give 'cuda'"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"device {device!r} but torch sees no CUDA device here: run the ranks on the CPU (device 'cpu', gloo)"
        )
    if local_world > count:
        raise ValueError(
            f"device {device!r} with {local_world} ranks on this node but {count} GPU(s): NCCL needs a GPU "
            f"per rank (two ranks on one GPU fail or hang); start at most {count} rank(s) per node "
            f"(torchrun --nproc_per_node {count}), or run the ranks on the CPU (device 'cpu', gloo)"
        )
    return Backend.NCCL, torch.device("cuda", local_rank)


def init_distributed(
    backend: Backend | str | None = None,
    *,
    device: torch.device | str | None = None,
    threads: int | None = None,
    timeout: float | None = None,
) -> DistEnv:
    """Start the default process group from torchrun's environment variables.

    Also sets this rank's torch threads and, for NCCL, its CUDA device. A process group that exists
    already is kept.

    Args:
        backend: The backend the device asks for (default); another is refused with the fix.
        device: Where this job's tensors live, 'cpu' (gloo) or 'cuda' (NCCL, cuda:LOCAL_RANK, one GPU
            per local rank): `rank_backend`'s rule. Default: the backend's device if `backend` is
            given, else the CPU, also on a machine with GPUs.
        threads: Torch threads of this rank (default: the cores split evenly over the node's ranks).
        timeout: Seconds a collective waits for the other ranks before it fails (gloo raises; NCCL's
            watchdog ends the process), so a rank that died or diverged ends the job instead of
            hanging it (default `DEFAULT_COLLECTIVE_TIMEOUT`, 300 s).

    Returns:
        This rank's place in the run.

    Raises:
        ValueError: A bad timeout or backend, torchrun's variables missing, or a device the backend
            does not carry (see `rank_backend`).

    Examples:
        Launched by `torchrun --nproc_per_node 2 train.py`:

        ```python
        import torch
        from engram.distributed import init_distributed

        env = init_distributed()  # gloo on the CPU
        if env.is_main:
            print(f"{env.world} ranks, backend {env.backend.value}")
        torch.distributed.destroy_process_group()
        ```
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
    if backend is not None:
        try:
            backend = Backend(backend)
        except ValueError:
            raise ValueError(f"backend={backend!r}: use 'nccl' (CUDA) or 'gloo' (CPU)") from None
    if device is None:
        device = "cuda" if backend is Backend.NCCL else "cpu"
    local_rank = int(os.environ["LOCAL_RANK"])
    # torchrun sets LOCAL_WORLD_SIZE; a launch by hand without it is taken as one node
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    wanted, device = rank_backend(device, local_rank, local_world)
    if backend is not None and backend is not wanted:
        raise ValueError(
            f"backend {backend.value!r} with ranks on {device.type}: {wanted.value} carries {device.type} "
            f"tensors here; leave backend out (it follows the device) or give device "
            f"{'cuda' if backend is Backend.NCCL else 'cpu'}"
        )
    if wanted is Backend.NCCL:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw: dict[str, Any] = {"device_id": device} if wanted is Backend.NCCL else {}
        dist.init_process_group(wanted.value, timeout=datetime.timedelta(seconds=timeout), **kw)
    # Ranks of a node share its cores: oversubscribing them (each rank using all) is far slower.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads or max(1, cores // local_world))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, wanted, device)
