"""Engram on HF models across processes: the tables kept out of DDP and synchronised by Engram itself.

`prepare_data_parallel(model, mode)` readies a model with Engram (`engram.hf.add_engram`) for data
parallelism before DDP, accelerate or the HF `Trainer` wraps it. The tables are named to DDP as
parameters to ignore (no bucket copy, no dense zero gradient of a table), and one of two modes keeps
them one table across the ranks:
- `TableSync.SHARDED` (the default on more than one rank): each rank owns 1/N of every table's rows
  and their optimizer state (`ShardedTable`); a forward fetches the batch's rows from their owners in
  one all-to-all (`prefetch_tables`) and the row gradients go back to the owners after backward
  (`sync_table_grads`), averaged over the ranks as DDP averages the dense ones.
- `TableSync.REPLICATED`: every rank holds the whole table; the ranks' sparse row gradients are
  all-gathered and averaged before the table step, so every rank applies the same update.
The model's `EngramOptimizer` (`engram.hf.build_optimizer`, built after this call) asks the mode for
the table gradients before its table step, and a sharded mode builds the table optimizer (Sinkhorn's
row and column sums then run over every rank's rows). Without a mode an `EngramOptimizer` refuses to
step on more than one process, since each rank would silently train its own table. FSDP1
(`FullyShardedDataParallel`) built after this call with `ignored_states=model.engram.tables()` works
as DDP does (FSDP2: `fsdp.fully_shard_backbone`); a wrapper built before it, or FSDP1 without the
tables ignored, is refused by name. Knows the attachment and the process group, nothing of the
wrappers beyond DDP's ignore list and how to tell that one holds the model or took a table over
(`wrappers`).

Every exchange of the tables runs on a process group of the same ranks whose collectives give up after
`prepare_data_parallel(..., timeout=...)` seconds (default 300): a rank left waiting (a sharded
forward run on some ranks only, a step taken on some) raises `RankError` naming the cause and the fix
instead of waiting out the process group's timeout (30 minutes by default).

One concept past 500 lines: the two table modes share the entry point, the wrapper checks and the
optimizer hand-off, which read as one contract.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engram.checkpoint.shard_format import SHARDED_STATE_KEY  # the tables' rows are in shard files
from engram.distributed.guard import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    RankError,
    all_values,
    bounded_group,
    check_timeout,
    chunks_digest,
    describe,
    differing,
    disagreements,
    tensor_digest,
)
from engram.distributed.memory_budget import check_state_fits, check_tables_fit
from engram.distributed.parallelize import table_owners
from engram.distributed.sharded_table import ShardedTable, prefetch_tables, release_tables, sync_table_grads
from engram.distributed.sinkhorn import ShardedSinkhorn
from engram.distributed.wrappers import taken_over, wrapper_of
from engram.hf.attach import EngramAttachment, get_attachment
from engram.model.sinkhorn import SparseSinkhorn
from engram.model.table import TrainableTable
from engram.model.table_init import INIT_CHUNK_ROWS

__all__ = [
    "SHARDED_STATE_KEY",
    "ReplicatedTableSync",
    "ShardedTableSync",
    "TableSync",
    "prepare_data_parallel",
]


class TableSync(enum.StrEnum):
    """How an HF model's Engram tables stay one table across data-parallel ranks.

    Attributes:
        REPLICATED: Every rank holds the table; sparse row gradients averaged across ranks.
        SHARDED: Each rank owns 1/N of the rows and their optimizer state; rows exchanged.
    """

    REPLICATED = "replicated"  # every rank holds the table; sparse row gradients averaged across ranks
    SHARDED = "sharded"  # each rank owns 1/N of the rows and their optimizer state; rows exchanged


_FORWARD = (
    "A forward of a model whose Engram tables are row-sharded (TableSync.SHARDED) is a collective: every "
    "rank of the group must run it, at the same point, each with its own batch; a rank that runs it alone "
    "(generation or evaluation on rank 0 only) waits for the others and fails after {bound}. To run the "
    "model on some ranks only, prepare it with mode=TableSync.REPLICATED, or save its Engram part "
    "(engram.distributed.save_engram, on every rank) and run it in one process (engram.hf.load_engram)"
)
_STEP = (
    "The table step (EngramOptimizer.step) exchanges the tables' gradients, a collective: every rank of the "
    "group must take it at the same point, or the ranks that do wait for the others and fail after {bound}"
)
_SLOW = "; if every rank does run it and one is only slow, raise prepare_data_parallel(..., timeout=...)"


@contextmanager
def _collective(
    group: dist.ProcessGroup | None, timeout: float | None, what: str, why: str
) -> Iterator[None]:
    """A RuntimeError of the block's collectives (a timeout, a lost peer) as RankError naming this rank,
    `what` failed, and `why` (the cause and the fix, with the time bound)."""
    try:
        yield
    except RankError:
        raise
    except RuntimeError as e:
        bound = (
            f"prepare_data_parallel's timeout ({timeout:g} s)"
            if timeout is not None
            else "the process group's timeout (prepare_data_parallel(timeout=None))"
        )
        raise RankError(
            f"rank {dist.get_rank(group)}: {what} failed ({e}). {why.format(bound=bound)}{_SLOW}"
        ) from e


class _TablesKept:
    """Refuse a forward (and a table step) once a wrapper has taken the tables over: FSDP1 built without
    them in `ignored_states` flattens them into its own parameter (the first step would then crash deep
    in the table exchange, or train nothing). A few attribute reads per table: no sync."""

    def __init__(self, att: EngramAttachment) -> None:
        self.tables = [(lid, m.table, m.table.weight) for lid, m in att.layers.items() if _trains(m.table)]

    def __call__(self, *_: Any) -> None:
        for lid, table, weight in self.tables:
            by = taken_over(table, "weight", weight)
            if by is not None:
                raise ValueError(
                    f"layer {lid}'s Engram table was taken over by {by}, which was built without the tables "
                    "among its ignored parameters, so Engram cannot keep them one table: build it with "
                    "FullyShardedDataParallel(model, ignored_states=model.engram.tables(), ...) after "
                    "prepare_data_parallel (or use engram.distributed.fully_shard_backbone for FSDP2)"
                )


def _trains(table: nn.Module) -> bool:
    return isinstance(getattr(table, "weight", None), nn.Parameter)  # (an FP8 table has no weight)


class ReplicatedTableSync:
    """Replicated tables: the ranks' sparse row gradients of each table, averaged over the group.

    As DDP averages the dense ones: an all-gather of the row counts, then of the padded rows and
    values (n_rows x dim per rank, nothing dense of the table). Every rank gets the same gradient,
    rows in the same order. `prepare_data_parallel(model, "replicated")` makes one and sets it as
    the attachment's `table_sync`, which the model's `EngramOptimizer` calls before its table step.

    Args:
        group: The data-parallel process group (default: the default group).
        exchange: The group the all-gathers run on (`group`'s ranks, collectives bounded in time;
            default `group`).
        timeout: The bound of those collectives in seconds, named in a `RankError`.
        kept: The check that no wrapper took the tables over (`prepare_data_parallel`'s).
    """

    mode = TableSync.REPLICATED

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        exchange: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        kept: Any = None,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.exchange = group if exchange is None else exchange
        self.timeout, self.kept = timeout, kept

    def table_optimizer(self, cls: type, **kwargs: Any) -> torch.optim.Optimizer:
        """The table optimizer over the whole tables (refused once a wrapper took them over).

        Args:
            cls: The sparse row optimizer class.
            **kwargs: Its hyperparameters.

        Returns:
            The optimizer.

        Raises:
            ValueError: A wrapper has taken the tables over.
        """
        assert self.kept is not None, "a ReplicatedTableSync made by prepare_data_parallel"
        self.kept()
        return cls([w for _, _, w in self.kept.tables], **kwargs)

    def __call__(self, params: list[torch.Tensor], pending: dict[torch.Tensor, torch.Tensor]) -> dict:
        """Average the tables' sparse gradients over the ranks (a collective, before the table step).

        Args:
            params: The table weights, in the optimizer's order (the same on every rank).
            pending: This rank's sparse gradient of each weight (a weight without one counts as zero).

        Returns:
            The averaged sparse gradient of every weight in `params`.

        Raises:
            RankError: An exchange failed or timed out; the message names the rank and the fix.
        """
        if self.kept is not None:
            self.kept()
        out = {}
        with _collective(self.exchange, self.timeout, "the Engram tables' gradient exchange", _STEP):
            for p in params:  # the optimizer's order: the same on every rank
                out[p] = self._average(p, pending.get(p))
        return out

    def _average(self, p: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        if grad is None:
            rows = torch.zeros(0, dtype=torch.int64, device=p.device)
            vals = torch.zeros(0, p.shape[1], dtype=p.dtype, device=p.device)
        else:
            grad = grad.coalesce()
            rows, vals = grad.indices()[0], grad.values()
        count = torch.tensor([rows.numel()], dtype=torch.int64, device=p.device)
        counts = [torch.empty_like(count) for _ in range(self.world)]
        dist.all_gather(counts, count, group=self.exchange)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        pad = most - rows.numel()
        rows_p = torch.cat([rows, rows.new_zeros(pad)])
        vals_p = torch.cat([vals, vals.new_zeros(pad, vals.shape[1])])
        all_rows = [torch.empty_like(rows_p) for _ in range(self.world)]
        all_vals = [torch.empty_like(vals_p) for _ in range(self.world)]
        dist.all_gather(all_rows, rows_p, group=self.exchange)
        dist.all_gather(all_vals, vals_p, group=self.exchange)
        idx = torch.cat([r[:n] for r, n in zip(all_rows, sizes, strict=True)])
        val = torch.cat([v[:n] for v, n in zip(all_vals, sizes, strict=True)])
        # rows from the ranks' own gradients, inside the table: no invariant check (torch's default)
        summed = torch.sparse_coo_tensor(idx[None], val, tuple(p.shape), check_invariants=False).coalesce()
        return summed / self.world


class ShardedTableSync:
    """Row-sharded tables of one attachment: rows fetched from their owners, gradients returned to them.

    The forward's rows are fetched from their owners in one exchange for every Engram layer
    (`prefetch`, called by the attachment's hook once the call's rows are known), the row gradients
    returned to the owners (`flush`: at the next forward or before the table step, so gradient
    accumulation sums micro-batches) and divided by the world size (DDP's average). Every rank of the
    group runs the same forwards and steps (as DDP requires). `prepare_data_parallel(model,
    "sharded")` makes one and sets it as the attachment's `table_sync`.

    Args:
        tables: The attachment's sharded tables, in layer order.
        index: Each table's layer position in the rows (`config.layer_index`).
        group: The data-parallel process group (default: the default group); the run's name is
            broadcast on it (a collective).
        timeout: The bound in seconds of the exchanges, which run on the tables' group.
        kept: The check that no wrapper took the tables over (`prepare_data_parallel`'s).
    """

    mode = TableSync.SHARDED

    def __init__(
        self,
        tables: list[ShardedTable],
        index: list[int],
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        kept: Any = None,
    ) -> None:
        self.tables, self.index, self.group = tables, index, group  # index: each table's layer in the rows
        self.timeout, self.kept = timeout, kept
        self.world = dist.get_world_size(group)
        self.grads: dict[torch.Tensor, torch.Tensor] = {}  # owned rows' gradients, summed over flushes
        self.optimizer: torch.optim.Optimizer | None = None  # the table optimizer (table_optimizer builds it)
        # Set when an optimizer state of sharded tables was loaded (a resume): the rows and their state
        # are in the checkpoint's shard files, which load_table_shards reads before the first step.
        self.restore: dict[str, Any] | None = None
        self.steps = 0  # table steps taken (the same on every rank)
        # This run's name, the same on every rank (rank 0's, broadcast): a state it wrote itself and
        # reloads at the same step is a round trip, any other a resume.
        name = [uuid.uuid4().hex]
        dist.broadcast_object_list(
            name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        self.run: str = name[0]

    def prefetch(self, rows: torch.Tensor) -> None:
        """Fetch each table's rows of this forward from their owners (a collective; flushes first).

        Args:
            rows: The call's rows (B, T, layers, heads).

        Raises:
            RankError: The exchange failed or timed out (e.g. a forward run on some ranks only).
        """
        if self.kept is not None:
            self.kept()
        with _collective(
            self.tables[0].group, self.timeout, "Engram's row exchange in this forward", _FORWARD
        ):
            self.flush()
            prefetch_tables([(t, rows[:, :, i]) for t, i in zip(self.tables, self.index, strict=True)])

    def flush(self) -> None:
        """Return the pending blocks' row gradients to their owners.

        A collective when a prefetch was made with gradients on: one flag all-reduce, then the
        exchange if any rank has a gradient; a prefetch without a backward since gives no gradient,
        as one process's forward gives none. The owners' gradients are summed until the table step.
        """
        pending = [t for t in self.tables if t._block is not None]
        if not any(t._block.requires_grad for t in pending):  # no_grad forwards: the same on every rank
            release_tables(pending)
            return
        has_grad = float(any(t._block.grad is not None for t in pending))
        flag = torch.tensor([has_grad], dtype=torch.float64, device=pending[0].weight.device)  # the backend's
        dist.all_reduce(flag, group=pending[0].group)  # the tables' group: bounded in time
        if float(flag) == 0:
            release_tables(pending)
            return
        sync_table_grads(pending)
        for t in pending:
            g, t.weight.grad = t.weight.grad, None
            if g is not None:
                old = self.grads.get(t.weight)
                self.grads[t.weight] = g if old is None else old + g

    def __call__(self, params: list[torch.Tensor], pending: dict[torch.Tensor, torch.Tensor]) -> dict:
        """The owned rows' gradients for the table step, averaged over the ranks (a collective).

        It flushes first: the pending blocks' gradients go to their owners.

        Args:
            params: The shards' weights (unused: the gradients come from the flushes).
            pending: The optimizer's pending gradients (unused, as `params`).

        Returns:
            Each shard weight's summed sparse gradient divided by the world size.

        Raises:
            RuntimeError: The run resumed from shard files that were not read back.
            RankError: The exchange failed or timed out.
        """
        if self.restore is not None:
            raise RuntimeError(
                "this run resumed from a checkpoint of row-sharded Engram tables, but their rows and optimizer "
                "state were not read back: pass callbacks=[engram.distributed.EngramShardsCallback()] to the "
                "Trainer (or call engram.distributed.load_table_shards with the checkpoint folder)"
            )
        if self.kept is not None:
            self.kept()
        with _collective(self.tables[0].group, self.timeout, "the Engram tables' gradient exchange", _STEP):
            self.flush()
        out, self.grads = {p: g / self.world for p, g in self.grads.items()}, {}
        self.steps += 1  # on every rank at every table step (a rank without rows too)
        return out

    def zero_grad(self) -> None:
        """Drop the gradients not yet stepped (the pending blocks' too).

        Their prefetch stays, for a backward still to come.
        """
        self.grads = {}
        for t in self.tables:
            if t._block is not None:
                t._block.grad = None

    def table_optimizer(self, cls: type, **kwargs: Any) -> torch.optim.Optimizer:
        """The table optimizer over the shards (V4.1's Sinkhorn update: `ShardedSinkhorn`).

        Every rank checks that the optimizer's state will fit its memory limits first.

        Args:
            cls: The sparse row optimizer class.
            **kwargs: Its hyperparameters.

        Returns:
            The optimizer, kept as `optimizer`.

        Raises:
            ValueError: A wrapper has taken the tables over.
            ShardMemoryError: A rank's optimizer state will not fit.
        """
        if self.kept is not None:
            self.kept()
        if issubclass(cls, SparseSinkhorn):
            self.optimizer = ShardedSinkhorn(self.tables, **kwargs)
        else:
            self.optimizer = cls([t.weight for t in self.tables], **kwargs)
        check_state_fits(self.optimizer, self.tables)  # every rank, before its first step allocates state
        return self.optimizer

    def table_state_dict(self) -> dict[str, Any]:
        """What the model's optimizer state holds of the tables.

        Each rank's own rows and their state go to the checkpoint's shard files
        (`save_table_shards`).

        Returns:
            The hyperparameters (`param_groups`) and, under `SHARDED_STATE_KEY`, where the rows are:
                world size, table sizes, run and steps.
        """
        assert self.optimizer is not None
        first = self.tables[0]
        return {
            SHARDED_STATE_KEY: {
                "world": first.world,
                "num_rows": [t.num_rows for t in self.tables],
                "run": self.run,
                "steps": self.steps,
            },
            "param_groups": self.optimizer.state_dict()["param_groups"],
        }

    def check_table_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse what `load_table_state_dict` would refuse, changing nothing.

        The hyperparameters are checked as the table optimizer's constructor checks them.

        Args:
            state: The table part of an `EngramOptimizer` state.

        Raises:
            ValueError: The state holds whole tables, or its hyperparameters are refused.
        """
        if not isinstance(state, dict) or SHARDED_STATE_KEY not in state:
            raise ValueError(
                "this optimizer state holds whole tables (saved on one process or with mode='replicated'), "
                "but this run's tables are row-sharded: resume with the mode it was saved with, or load the "
                "single-process Engram part (engram.hf.load_engram) into a fresh run"
            )
        check = getattr(self.optimizer, "check_state_dict", None)
        if check is not None:
            check({"state": {}, "param_groups": state.get("param_groups")})

    def load_table_state_dict(self, state: dict[str, Any]) -> None:
        """Load the table part of an optimizer state: on a resume, keep it until the shard files are read.

        The rows and their state are read by `load_table_shards` (`restore` holds the state until
        then); this run's own state at the same step (a wrapper's round trip) only sets the
        hyperparameters.

        Args:
            state: The table part of an `EngramOptimizer` state.

        Raises:
            ValueError: See `check_table_state_dict`.
        """
        self.check_table_state_dict(state)
        mark = state[SHARDED_STATE_KEY]
        if mark.get("run") == self.run and mark.get("steps") == self.steps:
            # this run's own state as it is now: a wrapper's round trip (accelerate's AcceleratedOptimizer,
            # which the Trainer uses too, saves and reloads the state to place it), not a resume
            assert self.optimizer is not None
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        self.restore = state


def _drop_sharded_tables(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for lid, m in module.layers.items():
        if isinstance(m.table, ShardedTable):
            state_dict.pop(f"{prefix}layers.{lid}.table.weight", None)


# What a rank whose table holds its rows in memory (drawn, or loaded) says in the first round of the
# agreement check: then every rank digests that table (a second round), a lazy one as it draws it.
_HELD = "rows held in memory (compared by digest)"


def _table_key(lid: str) -> str:
    return f"layer {lid}'s initial table"


def _table_recipes(att: EngramAttachment) -> dict[str, str]:
    """Each trainable table as the first round compares it: a lazy table's recipe (`RowInit.describe`:
    shape, dtype, std, seed, recipe; a few bytes, nothing drawn), else `_HELD`."""
    out = {}
    for lid, m in att.layers.items():
        t = m.table
        if isinstance(t, TrainableTable) and t.is_lazy:
            assert t.recipe is not None
            out[_table_key(lid)] = t.recipe.describe()
        elif isinstance(getattr(t, "weight", None), torch.Tensor):  # (an FP8 table has none: no training)
            out[_table_key(lid)] = _HELD
    return out


def _table_digest(table: nn.Module) -> str:
    """dtype, shape and CRC-32 of a table's values, read (or, for a lazy table, drawn) one chunk at a
    time (`tensor_digest`, `chunks_digest`): never a copy of the table, and the same on ranks with
    different thread counts, as float sums are not."""
    if isinstance(table, TrainableTable) and table.is_lazy:
        r = table.recipe
        assert r is not None
        chunks = (
            r.rows(a, min(a + INIT_CHUNK_ROWS, r.num_rows)) for a in range(0, r.num_rows, INIT_CHUNK_ROWS)
        )
        return chunks_digest(r.dtype, (r.num_rows, r.dim), chunks)
    return tensor_digest(table.weight)


def _agreement(att: EngramAttachment, values: dict[str, object], group) -> dict[str, list[object]]:
    """The names on which the ranks' `values` and tables differ. Ranks whose tables are all lazy agree
    on their recipes (one all-gather of a few bytes); a table some rank holds in memory is digested on
    every rank (a second all-gather, decided from the first, so every rank takes it or none does)."""
    gathered = all_values({**values, **_table_recipes(att)}, group)
    if differing([{k: v for k, v in g.items() if not k.endswith("initial table")} for g in gathered]):
        return differing(gathered)  # (another config or mode already: the tables are not compared)
    held = sorted({k for g in gathered for k, v in g.items() if v == _HELD})
    if held:
        mine = {_table_key(lid): m.table for lid, m in att.layers.items()}
        digests = all_values({k: _table_digest(mine[k]) for k in held if k in mine}, group)
        gathered = [{**g, **d} for g, d in zip(gathered, digests, strict=True)]
    return differing(gathered)


def _check_ranks_agree(
    model: nn.Module, att: EngramAttachment, mode: TableSync, owners: tuple[int, ...] | None, group
) -> None:
    """No rank's model is wrapped yet, and every rank attached the same Engram (config, layers, table
    values) and asked for the same mode: else a ValueError on every rank naming the ranks' values."""
    wrapper = wrapper_of(model)
    values: dict[str, object] = {
        "Engram config": att.config.to_dict(),
        "mode": mode.value,
        "table owners": owners,
        "a table optimizer built before prepare_data_parallel": getattr(att, "optimizer_hooks", None)
        is not None,
        "the wrapper holding the model already": wrapper,
    }
    if wrapper is None:  # (a wrapper may have flattened the tables: nothing to compare)
        diff = _agreement(att, values, group)
    else:
        diff = disagreements(values, group)
    if wrapper is not None and not diff:
        raise ValueError(
            f"the model is held by {wrapper} already, which has taken the Engram tables into its own gradient "
            "reduction: call engram.distributed.prepare_data_parallel(model) on the bare model first, then wrap "
            "it (DistributedDataParallel(model), the Trainer or accelerate; FullyShardedDataParallel(model, "
            "ignored_states=model.engram.tables()); or engram.distributed.fully_shard_backbone(model) for "
            "FSDP2), then build the optimizer (engram.hf.build_optimizer). Rebuild the wrapper: the one made "
            "first keeps the tables"
        )
    if diff:
        raise ValueError(
            f"the ranks disagree before data-parallel training: {describe(diff)}. Every rank must attach the "
            "same Engram (same config and tokenizer, tables from the same seed: torch.manual_seed before "
            "add_engram, or add_engram(..., seed=N)) and call prepare_data_parallel with the same arguments"
        )


def prepare_data_parallel(
    model: nn.Module,
    mode: TableSync | str | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    table_ranks: int | None = None,
    timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
) -> TableSync:
    """Ready a model with Engram for DDP / accelerate / the HF Trainer, its tables synchronised by Engram.

    Call it on every rank before the model is wrapped and before `engram.hf.build_optimizer`. It
    first checks that every rank attached the same Engram (config and initial tables) and that no
    wrapper holds the model yet: else a ValueError on every rank. The tables are named to DDP as
    parameters to ignore.

    Args:
        model: A model with Engram attached (`engram.hf.add_engram`), not yet wrapped.
        mode: SHARDED (each rank owns 1/N of every table's rows: table memory / N, one row exchange
            per forward) or REPLICATED (every rank holds the whole table; the sparse row gradients
            are averaged); None: SHARDED on more than one rank, REPLICATED on one.
        group: The data-parallel process group (default: the default group).
        table_ranks: N (sharded only): ranks 0..N-1 own the rows, the others hold none.
        timeout: Seconds an exchange of the tables (a sharded forward, a table step) waits for the
            other ranks before it raises RankError naming the cause (None: the process group's own
            timeout).

    Returns:
        The mode chosen.

    Raises:
        ValueError: No process group, a model wrapped already or prepared already, ranks that
            disagree, an optimizer built before, or a bad mode, table_ranks or timeout.
        TypeError: A sharded mode for a table that is not trainable.
        ShardMemoryError: A rank's shard will not fit its memory limits (said on every rank before
            any row is allocated).

    Examples:
        One step of a tiny Llama with Engram under DDP (`torchrun --nproc_per_node 2 step.py`):

        ```python
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from engram import EngramConfig, TokenizerCompression
        from engram.distributed import init_distributed, prepare_data_parallel
        from engram.hf import add_engram, build_optimizer

        init_distributed()  # gloo on the CPU
        torch.manual_seed(0)  # the same backbone and Engram on every rank
        llama = LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        )
        config = EngramConfig.preset("tiny").replace(hc_mult=1, vocab_size=1000, compressed_vocab_size=1000)
        model = add_engram(LlamaForCausalLM(llama), config, compression=TokenizerCompression.identity(1000))
        prepare_data_parallel(model)  # "sharded": each rank holds half of every table's rows
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # the tables stay out of its buckets
        optimizer = build_optimizer(model)  # after prepare_data_parallel
        ids = torch.randint(0, 1000, (2, 16))
        ddp(ids, labels=ids).loss.backward()
        optimizer.step()
        torch.distributed.destroy_process_group()
        ```
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "prepare_data_parallel needs torch.distributed: launch with torchrun (or accelerate launch) and "
            "call torch.distributed.init_process_group first"
        )
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "the model is already wrapped in DistributedDataParallel, which has bucketed its Engram tables: "
            "call prepare_data_parallel(model) on the bare model, then wrap it"
        )
    timeout = check_timeout(timeout, "prepare_data_parallel")
    world = dist.get_world_size(group)
    try:
        chosen = TableSync(
            mode if mode is not None else TableSync.SHARDED if world > 1 else TableSync.REPLICATED
        )
    except ValueError:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(repr(m.value) for m in TableSync)}") from None
    if table_ranks is not None and chosen is not TableSync.SHARDED:
        raise ValueError(f"table_ranks={table_ranks!r} places a sharded table's rows: use mode='sharded'")
    owners = None if table_ranks is None else table_owners(table_ranks, world)
    att = get_attachment(model)
    if att.table_sync is not None:
        raise ValueError(
            f"prepare_data_parallel was called on this model already (mode {att.table_sync.mode.value!r})"
        )
    _check_ranks_agree(model, att, chosen, owners, group)
    if getattr(att, "optimizer_hooks", None) is not None:
        raise ValueError(
            "build_optimizer was called before prepare_data_parallel: the optimizer holds the whole tables. "
            "Call prepare_data_parallel(model) first, then engram.hf.build_optimizer(model, ...)"
        )
    exchange = bounded_group(group, timeout)  # the tables' collectives: bounded in time
    if chosen is TableSync.SHARDED:
        check_tables_fit([m.table for m in att.layers.values()], exchange, owners)  # before any row is made
        tables = []
        for m in att.layers.values():
            if not isinstance(m.table, TrainableTable):
                raise TypeError(
                    f"layer {m.layer_id}'s table is a {type(m.table).__name__}; only trainable tables are "
                    "sharded: use mode='replicated' for a model that does not train its tables"
                )
            if (
                m.table.is_lazy
            ):  # born sharded: this rank draws its own rows only, the same rows one process draws
                r = m.table.recipe
                assert r is not None
                t = ShardedTable(
                    r.num_rows, r.dim, group=exchange, dtype=r.dtype, device=r.device, init_std=r.std,
                    seed=r.seed, owners=owners,
                )  # fmt: skip
            else:
                w = m.table.weight
                t = ShardedTable.from_full(w, group=exchange, owners=owners)
                t.weight.requires_grad_(w.requires_grad)
            m.table = t  # a full table is freed once nothing else holds it
            tables.append(t)
        index = [att.config.layer_index(int(lid)) for lid in att.layers]
        kept = _TablesKept(att)
        att.table_sync = ShardedTableSync(tables, index, group, timeout=timeout, kept=kept)
        # A rank's state_dict() (what HF's save_pretrained and the Trainer write, on rank 0 only) holds
        # no table: one rank's rows under the table's name would be read back as the whole table.
        att.register_state_dict_post_hook(_drop_sharded_tables)
    else:
        for m in att.layers.values():  # every rank holds every row: a lazy table is drawn whole
            if isinstance(m.table, TrainableTable):
                m.table.materialize()
        kept = _TablesKept(att)
        att.table_sync = ReplicatedTableSync(group, exchange=exchange, timeout=timeout, kept=kept)
    for m in att.layers.values():  # a forward refused once a wrapper has taken a table over
        m.register_forward_pre_hook(kept)
    table_ids = {id(p) for p in att.tables()}
    names = [n for n, p in model.named_parameters() if id(p) in table_ids]
    sharded = {id(m.table) for m in att.layers.values() if isinstance(m.table, ShardedTable)}
    names += [f"{n}._starts" for n, m in model.named_modules() if id(m) in sharded]  # the shard starts buffer
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return chosen
