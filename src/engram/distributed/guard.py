"""What keeps a distributed run from hanging: ranks check that they agree before they act, and a
collective that fails or waits too long becomes an error naming the rank and the step. Knows nothing
of what the trainer computes. Design: docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "RankError", "describe", "disagreements", "named_failures"]

# Long enough for rank 0 to write a checkpoint at this project's scale while the others wait in a
# barrier, short enough that a stuck job ends within minutes instead of torch's 30 (gloo) or 10 (NCCL).
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


class RankError(RuntimeError):
    """A rank of a distributed run failed in a collective (timed out, lost a peer) or beside one;
    the message names the rank and the step."""


def disagreements(values: dict[str, Any], group: dist.ProcessGroup | None = None) -> dict[str, list[Any]]:
    """Gather every rank's `values` (picklable, compared with ==) and return the names whose values
    differ between ranks, each with the list of every rank's value (None where a rank lacks the
    name). A collective: every rank of `group` calls it, and every rank gets the same answer."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    names = sorted({k for v in gathered for k in v})
    per_name = {k: [v.get(k) for v in gathered] for k in names}
    return {k: vals for k, vals in per_name.items() if any(x != vals[0] for x in vals[1:])}


def describe(diff: dict[str, list[Any]], limit: int = 60) -> str:
    """'--until (rank 0: 2, rank 1: 4); seed (rank 0: 0, rank 1: 1)': each value cut to `limit` characters."""

    def short(x: Any) -> str:
        s = repr(x)
        return s if len(s) <= limit else s[: limit - 3] + "..."

    return "; ".join(
        f"{name} ({', '.join(f'rank {r}: {short(v)}' for r, v in enumerate(vals))})"
        for name, vals in diff.items()
    )


@contextmanager
def named_failures(rank: int, where: Callable[[], str]) -> Iterator[None]:
    """Re-raise a RuntimeError from the block (a gloo timeout or lost peer, a DistBackendError, or
    any other runtime failure of this rank) as RankError naming `rank` and `where()` (e.g. 'in step
    4 of 6'); a RankError from an inner block passes unchanged. ValueErrors (settings, rows) pass too."""
    try:
        yield
    except RankError:
        raise
    except RuntimeError as e:
        raise RankError(
            f"rank {rank} failed {where()}: {e} (a collective that times out after --collective-timeout "
            "seconds or loses its peer means another rank failed, stopped early or is stuck: see the "
            "other ranks' errors)"
        ) from e
