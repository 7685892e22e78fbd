"""What training row-sharded Engram tables costs per rank: memory and the row exchange per step.

`plan_training(config, table_rows, stats, setup)` sizes one step of `engram.distributed`'s sharded
training: W ranks, each with tokens_per_step / W tokens, ask the table owners (every rank, or
`table_ranks` of them) for their batch's distinct rows (`RowStats.distinct`, measured on a real text),
and send the rows' gradients back. Per owner rank: the shard's rows, the table optimizer's state
(and working memory), the staged rows (the prefetched block) and the gradients (the block's, the
rows received at the owner, the shard's sparse gradient); per step: the bytes of the four
all-to-alls (counts, ids, rows, gradients) a rank sends and receives, and their time at a link
bandwidth, set by the busiest owner (`RowStats.owner_rows`: an owner of 4-gram heads' rows is asked
for more distinct rows than one of 2-gram heads', and the rows nearly every batch holds load theirs). The counts are those `engram.distributed.exchange_stats` records.
Numbers only: nothing of torch, tensors or modules.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engram.config import EngramConfig
from engram.systems.row_stats import RowStats

__all__ = [
    "PARAM_BYTES",
    "RankMemory",
    "StepExchange",
    "TableOptimizer",
    "TrainPlan",
    "TrainSetup",
    "plan_training",
]

ID_BYTES = 8  # row ids and counts travel as int64
STATE_BYTES = 4  # optimizer state is fp32 for fp32 / bf16 tables (engram.model.optim.state_dtype)
PARAM_BYTES = {"fp32": 4, "bf16": 2}  # a table value, its exchanged copy and its gradient
LINK_GBPS = 50.0  # GB/s a rank sends (and receives) over the network: 400 Gb/s InfiniBand NDR per GPU


class TableOptimizer(enum.StrEnum):
    """The table optimizers, by `engram train --table-optimizer`'s names."""

    ADAM = "adam"  # SparseRowAdam: fp32 momentum per parameter, fp32 second moment + int32 count per row
    ADAGRAD = "adagrad"  # SparseRowAdagrad: one fp32 accumulator per row
    SINKHORN = "sinkhorn"  # V4.1's Sinkhorn-balanced update (SparseSinkhorn): momentum of the active rows
    DENSE_ADAM = (
        "dense-adam"  # the paper's Adam over the whole table (DenseTableAdam): m and v, dense gradient
    )


def _finite(name: str, v: Any, lo: float, fix: str, lo_open: bool = True, hi: float | None = None) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise ValueError(f"{name}={v!r}: {fix}")


@dataclass(frozen=True)
class TrainSetup:
    """One training step's shape: global tokens, ranks, owners, optimizer, dtype and link."""

    tokens_per_step: int  # tokens of the global batch (every rank's together)
    ranks: int  # data-parallel ranks, each with tokens_per_step / ranks tokens
    optimizer: TableOptimizer | str = TableOptimizer.ADAM
    table_ranks: int | None = None  # ranks holding table rows (the first N); None: every rank
    param_dtype: str = "fp32"  # the table's values, the rows exchanged and their gradients
    link_gbps: float = LINK_GBPS  # GB/s each rank sends and receives at once (full duplex)
    # Sinkhorn: share of a shard's rows with momentum. A row stays active for as long as its momentum
    # takes to underflow after its last lookup (hundreds of steps at beta 0.95): at V4.1's scale that
    # is every row (1.0); a short run has fewer (distinct rows of the steps' tokens).
    active_share: float = 1.0
    # Sinkhorn: the run's steps so far, instead of active_share: the active rows are then the distinct
    # rows of that many global batches on the fullest owner (from the row statistics, each table's
    # capped at its shard; `_active_rows`).
    steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_step", "ranks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: give a whole number >= 1")
        try:
            object.__setattr__(self, "optimizer", TableOptimizer(self.optimizer))
        except ValueError:
            raise ValueError(
                f"optimizer={self.optimizer!r} is not a table optimizer; give one of "
                f"{', '.join(o.value for o in TableOptimizer)}"
            ) from None
        tr = self.table_ranks
        if tr is not None and (isinstance(tr, bool) or not isinstance(tr, int) or not 1 <= tr <= self.ranks):
            raise ValueError(
                f"table_ranks={tr!r}: give a number of ranks in [1, {self.ranks}] (or none: every rank)"
            )
        if self.param_dtype not in PARAM_BYTES:
            raise ValueError(f"param_dtype={self.param_dtype!r}: give one of {', '.join(PARAM_BYTES)}")
        _finite(
            "link_gbps", self.link_gbps, 0.0, "give the bandwidth each rank sends at, in GB/s (> 0), e.g. 50"
        )
        _finite(
            "active_share", self.active_share, 0.0, "give the share of rows with momentum, in (0, 1]", hi=1.0
        )
        st = self.steps
        if st is not None and (isinstance(st, bool) or not isinstance(st, int) or st < 1):
            raise ValueError(f"steps={st!r}: give a whole number of steps >= 1 (or none: active_share)")
        if st is not None and self.active_share != 1.0:
            raise ValueError(
                f"steps={st} and active_share={self.active_share} both set the active rows: give one of them"
            )

    @property
    def owners(self) -> int:
        return self.ranks if self.table_ranks is None else self.table_ranks

    @property
    def rank_tokens(self) -> float:
        return self.tokens_per_step / self.ranks


@dataclass
class RankMemory:
    """Bytes of an owner rank, summed over the layers' tables: the rows of the largest shard and the
    exchange of the busiest owner (an upper bound for every rank)."""

    rows: int  # the shard: its rows' values
    optimizer_state: int  # what the table optimizer keeps between steps
    optimizer_work: int  # what its step allocates and keeps for reuse (Sinkhorn's workspace)
    staged_rows: int  # the prefetched block: the batch's distinct rows, forward to backward
    gradients: int  # the block's gradient, the rows' gradients received as owner, the shard's gradient

    @property
    def total(self) -> int:
        return self.rows + self.optimizer_state + self.optimizer_work + self.staged_rows + self.gradients


@dataclass
class StepExchange:
    """One step's row exchange for one rank (rows summed over the layers)."""

    lookups: float  # rows a rank looks up (every position and head)
    rows_requested: float  # distinct of them (per table): what the exchange sends
    rows_requested_remote: float  # of those, owned by another rank (the mean owner rank's view)
    rows_served: float  # rows an owner serves, mean over the owners
    rows_served_max: float  # the busiest owner's (the rows most batches ask for weigh on it)
    rows_served_distinct: float  # distinct of an owner's served rows (its shard gradient's rows), mean
    rows_served_distinct_max: float  # the busiest owner's
    sent: dict[str, float] = field(default_factory=dict)  # bytes to other ranks per phase, mean owner rank
    received: dict[str, float] = field(default_factory=dict)
    sent_max: dict[str, float] = field(default_factory=dict)  # the busiest owner's
    received_max: dict[str, float] = field(default_factory=dict)
    undeduped: dict[str, float] = field(default_factory=dict)  # a rank's lookups sent one by one, remote
    seconds: float = 0.0  # the four all-to-alls at the link bandwidth, set by the busiest rank

    @property
    def sent_total(self) -> float:
        return sum(self.sent.values())

    @property
    def received_total(self) -> float:
        return sum(self.received.values())


@dataclass
class TrainPlan:
    config: str
    setup: TrainSetup
    stats_source: str
    table_rows: tuple[int, ...]
    shard_rows: tuple[int, ...]  # per layer, the largest shard
    memory: RankMemory
    exchange: StepExchange
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["setup"]["optimizer"] = self.setup.optimizer.value  # type: ignore[union-attr]
        d["memory"]["total"] = self.memory.total
        d["exchange"]["sent_total"] = self.exchange.sent_total
        d["exchange"]["received_total"] = self.exchange.received_total
        return d


def _phases(counts: float, ids: float, rows: float, grads: float) -> dict[str, float]:
    return {"counts": counts, "ids": ids, "rows": rows, "grads": grads}


def plan_training(config: EngramConfig, table_rows: tuple[int, ...] | list[int], stats: RowStats,
                  setup: TrainSetup) -> TrainPlan:  # fmt: skip
    """The memory of the fullest owner rank and the row exchange of one step (see the module)."""
    if not isinstance(setup, TrainSetup):
        raise TypeError(f"setup must be a TrainSetup, got {type(setup).__name__}")
    if len(table_rows) != len(stats.table_rows) or tuple(table_rows) != stats.table_rows:
        raise ValueError(
            f"the row statistics were measured for tables of {list(stats.table_rows)} rows, this config has "
            f"{list(table_rows)}: measure them with this config"
        )
    d, p = config.head_dim, PARAM_BYTES[setup.param_dtype]
    row_b = d * p
    w, n, b = setup.ranks, setup.owners, setup.rank_tokens
    opt = TableOptimizer(setup.optimizer)
    n_tab = len(table_rows)
    shard = tuple(-(-t // n) for t in table_rows)  # ceil: the first owners' shards differ by one row
    u = [stats.distinct(li, b) for li in range(n_tab)]  # distinct rows of a rank's batch, per table
    # (owners,): the distinct rows one rank's batch asks each owner for (owner i of every table is the
    # same rank), and the distinct rows of the global batch in each owner's ranges
    asks = np.sum([stats.owner_rows(li, b, n) for li in range(n_tab)], axis=0)
    everyone = np.sum([stats.owner_rows(li, setup.tokens_per_step, n) for li in range(n_tab)], axis=0)
    served_distinct = np.minimum(everyone, w * asks)  # an owner's shard gradient rows
    U = sum(u)
    top = int(np.argmax(asks))  # the busiest owner: served w * asks[top] rows, asked itself asks[top]
    lookups = b * stats.rows_per_token * n_tab
    counts = (w - 1) * n_tab * ID_BYTES

    def traffic(own: float) -> tuple[dict[str, float], dict[str, float]]:
        """(sent, received) bytes to / from other ranks of an owner that asks itself for `own` rows and
        serves w * own."""
        asked, served = U - own, (w - 1) * own
        sent = _phases(counts, asked * ID_BYTES, served * row_b, asked * row_b)
        return sent, _phases(counts, served * ID_BYTES, asked * row_b, served * row_b)

    sent, received = traffic(U / n)  # the mean owner
    sent_max, received_max = traffic(U if n == 1 else float(asks[top]))  # (one owner: exactly its own)
    rem_lookups = lookups * (1 - 1 / n)
    undeduped = _phases(counts, rem_lookups * ID_BYTES, rem_lookups * row_b, rem_lookups * row_b)
    # per all-to-all the larger of what the busiest owner sends and receives, at the link's rate
    seconds = sum(max(sent_max[k], received_max[k]) for k in sent_max) / (setup.link_gbps * 1e9)
    exchange = StepExchange(lookups, U, U - U / n, w * U / n, w * float(asks[top]),
                            float(served_distinct.mean()), float(served_distinct[top]), sent, received,
                            sent_max, received_max, undeduped, seconds)  # fmt: skip

    S = sum(shard)
    if setup.steps is None:
        active_rows = [math.ceil(setup.active_share * s) for s in shard]
    else:
        active_rows = _active_rows(stats, shard, n, setup)
    active = sum(active_rows)
    state = {
        TableOptimizer.ADAM: S * (STATE_BYTES * d + 8),
        TableOptimizer.ADAGRAD: S * STATE_BYTES,
        TableOptimizer.SINKHORN: active * (STATE_BYTES * d + 8),  # momentum + the row's id
        TableOptimizer.DENSE_ADAM: S * 2 * STATE_BYTES * d,
    }[opt]
    # Sinkhorn's passes use an fp32 (A, dim) workspace, (A,) fp64 row norms and (A,) flags: one set for
    # every table (each table's step reuses it), as large as the largest table's active set. Kept
    # between steps and grown by half when outgrown, the buffer holds 1 to 1.5x that (a note says so):
    # where in that range depends on the order the active sets grew in, not on the statistics.
    work = max(active_rows) * (STATE_BYTES * d + 9) if opt is TableOptimizer.SINKHORN else 0
    grads = (U + exchange.rows_served_max + exchange.rows_served_distinct_max) * row_b
    if opt is TableOptimizer.DENSE_ADAM:  # the sparse gradient made dense, the whole shard
        grads += S * row_b
    memory = RankMemory(S * row_b, int(state), int(work), round(U * row_b), round(grads))
    notes = []
    largest = max(stats.batch_sizes)
    if setup.tokens_per_step > largest:
        notes.append(
            f"the global batch ({setup.tokens_per_step:,} tokens) is longer than the largest batch measured "
            f"({largest:,}): its distinct rows per owner are the measured share's upper bound"
        )
    if b > largest:
        notes.append(f"a rank's batch ({b:,.0f} tokens) is longer than the largest measured: upper bounds")
    if opt is TableOptimizer.SINKHORN:
        notes.append(
            "sinkhorn's work is its workspace in use (the largest table's active rows); the buffer it keeps "
            "grows by half when outgrown, so it holds up to 1.5x that"
        )
    return TrainPlan(config.name, setup, stats.source, tuple(int(t) for t in table_rows), shard, memory,
                     exchange, notes)  # fmt: skip


def _active_rows(stats: RowStats, shard: tuple[int, ...], owners: int, setup: TrainSetup) -> list[int]:
    """Sinkhorn's active rows of each table after `setup.steps` steps on the fullest owner: the
    distinct rows of that many global batches in its range (at most its shard). Rows leave the active
    set only when their momentum underflows, hundreds of steps after their last lookup (not modelled)."""
    assert setup.steps is not None
    k_tokens = setup.steps * setup.tokens_per_step
    per = np.stack([stats.owner_rows(li, k_tokens, owners) for li in range(len(shard))], axis=1)
    per = np.minimum(per, np.array(shard, dtype=np.float64))  # (owners, tables)
    return [math.ceil(a) for a in per[int(np.argmax(per.sum(axis=1)))]]
