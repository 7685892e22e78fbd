"""The processes of one `engram hf-train` run: one plain process, or every rank of a torchrun launch
(`--distributed`, the process group started by `engram.distributed.init_distributed`).

`Ranks` is what `train_folder` asks of them: which rank it is and how many there are, the global batch
split over them, the ranks' settings compared before anything is read, a block of checks every rank
runs whose failure on any rank becomes the same error on every rank (`agreed`: no rank goes on to a
collective its peers have left), and rank 0's choice handed to every rank (`from_main`). In one
process each is a no-op. Knows nothing of models or of the Trainer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LAUNCH", "Ranks", "RefusedOnEveryRank"]

LAUNCH = "torchrun --nproc_per_node N -m engram hf-train FOLDER --corpus C --out OUT --distributed"
# What a failed check raises (a refusal of the input, a file that cannot be written, a size that does
# not fit); anything else is a bug, which ends this rank and torchrun ends the others.
_REFUSALS = (ValueError, TypeError, OSError, MemoryError)


class RefusedOnEveryRank(ValueError):
    """A check failed on some rank, and every rank raises this same error (the CLI prints it on rank 0
    only, so a launch shows it once)."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    distributed: bool = False  # a process group (torchrun --distributed), even of one rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device | None:
        """Across processes, this rank's device: the CUDA device `init_distributed` made current under
        NCCL, the CPU under gloo; one process: None (the caller's choice)."""
        if not self.distributed:
            return None
        if dist.get_backend() == "gloo":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def of_run(cls, distributed: bool) -> Ranks:
        """This process's place: the default process group's with `distributed`, else one process
        (refused under a torchrun launch of several, which would train N copies side by side)."""
        if not distributed:
            world = os.environ.get("WORLD_SIZE", "1")
            if world.strip() not in ("", "0", "1"):
                raise ValueError(
                    f"engram hf-train runs in one process unless --distributed, but WORLD_SIZE={world} (a "
                    f"torchrun launch): add --distributed ({LAUNCH})"
                )
            return cls()
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"--distributed needs the process group of a torchrun launch, and none is started: {LAUNCH}"
            )
        return cls(dist.get_rank(), dist.get_world_size(), True)

    def per_rank_batch(self, batch_size: int) -> int:
        """The micro-batch of each rank: --batch-size is the global batch, the same as in one process."""
        if batch_size % self.world:
            fit = max(self.world, batch_size - batch_size % self.world)
            raise ValueError(
                f"--batch-size {batch_size} is the global batch, split evenly over the {self.world} processes "
                f"of this launch: give a multiple of {self.world} (e.g. --batch-size {fit})"
                + (f", or start at most {batch_size} processes" if batch_size < self.world else "")
            )
        return batch_size // self.world

    def check_same(self, values: dict[str, Any]) -> None:
        """Refuse, on every rank, a launch whose ranks were given other values (a collective)."""
        if not self.distributed:
            return
        from engram.distributed import describe, disagreements

        diff = disagreements(values)
        if diff:
            raise RefusedOnEveryRank(
                f"the ranks of this launch were started with other options: {describe(diff)}; give every "
                "rank the same command line"
            )

    @contextmanager
    def agreed(self) -> Iterator[None]:
        """Run the block's checks on every rank, then agree (one all-gather of the outcomes): when a
        check failed on any rank, every rank raises RefusedOnEveryRank with its message ("rank R of W:"
        before it unless every rank failed alike). The block must hold no collective that a rank failing
        earlier in it would skip (its peers would wait there). One process: the block's error passes
        unchanged."""
        error: BaseException | None = None
        try:
            yield
        except _REFUSALS as e:
            if not self.distributed:
                raise
            error = e
        if not self.distributed:
            return
        mine = None if error is None else " ".join(str(error).split()) or type(error).__name__
        messages: list[str | None] = [None] * self.world
        dist.all_gather_object(messages, mine)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        rank, message = failed[0]
        alike = len(failed) == self.world and all(m == message for _, m in failed)
        raise RefusedOnEveryRank(message if alike else f"rank {rank} of {self.world}: {message}") from error

    def from_main(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a collective; one process: `value`)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
