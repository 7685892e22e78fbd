"""Data-parallel training with row-sharded Engram tables (launched with torchrun): `DistributedTrainer`
is `engram.apps.lm.train.Trainer` with its batch, backward, evaluation and checkpoint pieces replaced, so
W ranks train the model one process trains with the same global batch. Checkpoints in the
single-process format or with row-sharded tables (each owner rank's rows in
`<checkpoint>/engram-shards/`, the row-range format `engram.checkpoint.shard_format`, readable at any
world size and in one process). Design: docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from engram.addressing.layout import Layout, layout_fingerprint
from engram.apps.lm.evaluation import eval_summary, score_windows, window_rows
from engram.apps.lm.train import DataBundle, TableOptimizer, TrainConfig, Trainer, build_model
from engram.checkpoint.shard_format import ShardIdentity, TableRange
from engram.checkpoint.shards import SHARDS_KEY, read_checkpoint, shards_of_state, write_shard
from engram.device import Precision, autocast, to_device
from engram.distributed.guard import describe, disagreements, named_failures
from engram.distributed.memory_budget import check_engram_shards_fit
from engram.distributed.parallelize import (
    TableInit,
    all_reduce_grads,
    build_sharded_model,
    prefetch_model_rows,
    shard_engram_tables,
    sharded_tables,
    split_sharded_params,
)
from engram.distributed.shard_checkpoint import agreed, agreed_error, run_name, table_optimizer_name
from engram.distributed.sharded_table import ShardedTable, gather_shards, release_tables, sync_table_grads
from engram.distributed.sinkhorn import ShardedSinkhorn
from engram.model.lm import EngramLM
from engram.model.table import TrainableTable

__all__ = ["DistributedTrainer", "build_distributed_model"]

_EVAL_BATCH = 32  # windows per evaluation batch on each rank (engram.apps.lm.train.evaluate's default)


def build_distributed_model(
    cfg: TrainConfig,
    data: DataBundle,
    *,
    init: TableInit = TableInit.CHUNKED,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    owners: Iterable[int] | None = None,
) -> EngramLM:
    """cfg's model on `device` with sharded Engram tables whose rows live on `owners` (group ranks;
    default: every rank). CHUNKED (default): build_sharded_model (born sharded: no rank ever holds a
    full table). COPY: build_model's model, each rank building the full table once, then keeping its
    rows (a non-owner none). Both are build_model's model bit for bit (a row depends on (seed, layer,
    row) only): one process trains what N ranks train, whichever init started them."""
    if not isinstance(init, TableInit):
        raise TypeError(f"init must be a TableInit (COPY or CHUNKED), got {init!r}")
    e, opt = data.engram_config if cfg.engram is not None else None, cfg.table_optimizer.value
    copy = init is TableInit.COPY  # every rank holds a rank's rows (and state) or refuses, before any is made
    check_engram_shards_fit(e, whole_first=copy, optimizer=opt, group=group, owners=owners, device=device)
    if init is TableInit.COPY or cfg.engram is None:
        model = build_model(cfg, data).to(device)
        shard_engram_tables(model, group, owners=owners)
        return model
    base = build_model(cfg, data, with_engram=False).config  # the LMConfig build_model would use
    lm_cfg = dataclasses.replace(base, engram=data.engram_config)
    return build_sharded_model(lm_cfg, seed=cfg.seed, group=group, device=device, owners=owners)


def _data_checksum(data: DataBundle) -> int:
    crc = zlib.crc32(data.tokenizer.to_str().encode())
    for a in (data.train.ids, data.held_out.ids):
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


class DistributedTrainer(Trainer):
    """Trainer for one rank of a data-parallel run; every rank constructs it and calls the same
    methods (run, evaluate, save_checkpoint, resume_from are collectives).

    `model` is cfg's model on `device`; Engram tables still unsharded are sharded here (COPY, their
    rows on `owners`, default every rank; tables already sharded keep their owners). Only rank 0
    writes checkpoints (out_dir must be the same shared folder on every rank), unless
    `sharded_checkpoints`: then every owner rank writes its table rows too (module docstring).

    `settings`: how the ranks were launched beyond cfg, by name (the CLI passes --until,
    --table-init, --table-ranks, --resume); checked with cfg, the data, the table layout and the
    initial model to be the same on every rank (else ValueError on every rank, naming what differs).
    A failed or timed-out collective raises RankError naming the rank and the step. `precision`: as
    Trainer's (bf16: each rank's forwards under autocast; the exchanges and reductions in float32).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        data: DataBundle,
        model: EngramLM,
        out_dir: str | Path | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        owners: Iterable[int] | None = None,
        sharded_checkpoints: bool = False,
        settings: dict[str, Any] | None = None,
        precision: Precision | str = Precision.FLOAT32,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "DistributedTrainer needs torch.distributed: call engram.distributed.init_distributed() "
                "(under torchrun) or torch.distributed.init_process_group first"
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if cfg.batch_size % self.world:
            lo = cfg.batch_size // self.world * self.world
            near = f"{lo} or {lo + self.world}" if lo else f"{self.world}"
            raise ValueError(
                f"batch_size={cfg.batch_size} does not split evenly over {self.world} ranks: use a "
                f"multiple of {self.world} (e.g. {near})"
            )
        self.local_batch = cfg.batch_size // self.world
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if any(isinstance(m.table, TrainableTable) for m in model.engrams.values()):
            shard_engram_tables(model, group, owners=owners)
        self.tables = sharded_tables(model)
        self.sharded_checkpoints = bool(sharded_checkpoints)
        super().__init__(cfg, data, model, out_dir, device=self.device, precision=precision)
        self._check_ranks_agree(data, dict(settings or {}))
        # the run's name (rank 0's), which its sharded checkpoints' files record; a resumed run keeps it
        self.run_id = run_name(group)
        # table optimizer's param index -> its table (for gathering / slicing its state in checkpoints)
        owner = {id(t.weight): t for t in self.tables}
        self._opt_tables = (
            [owner[id(p)] for g in self.table_opt.param_groups for p in g["params"]] if self.table_opt else []
        )

    def _check_ranks_agree(self, data: DataBundle, settings: dict[str, Any]) -> None:
        """One all-gather: every rank has the same training config and launch settings, data, table
        layout (owners, rows) and initial dense model, or every rank raises naming what differs.
        Ranks disagreeing on the owners would ask non-owners for rows they do not hold; on the config
        or the settings (seed, steps, --until, --table-init) they would train different models or
        call different collectives and hang."""
        model = self.model
        sharded = {id(t.weight) for t in self.tables}
        dense = sorted((k, v) for k, v in model.state_dict(keep_vars=True).items() if id(v) not in sharded)
        crc = 0
        for key, value in dense:  # the replicated part of the model, as built (before any resume)
            crc = zlib.crc32(key.encode(), crc)
            crc = zlib.crc32(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
        config = {f"config {k}": v for k, v in self.cfg.to_dict().items()}
        launch = {
            "sharded_checkpoints": self.sharded_checkpoints,
            "precision": self.precision.value,
            **settings,
        }
        checks = {"data": _data_checksum(data), "layout": [t.bounds for t in self.tables], "model": crc}
        with named_failures(self.rank, lambda: "checking that the ranks agree (before step 1)"):
            diff = disagreements({**config, **launch, **checks}, self.group)
        setup = {k: v for k, v in diff.items() if k not in checks}
        if setup:
            raise ValueError(
                f"rank {self.rank}'s training config differs from another rank's: {describe(setup)}; launch "
                "every rank with the same command line (or config file)"
            )
        if "data" in diff:
            raise ValueError(
                f"rank {self.rank}'s data (tokenizer and token streams) differs from another rank's: every "
                "rank must prepare the same data (same corpus, tokenizer and config)"
            )
        if "layout" in diff:
            owners = [t.owners for t in self.tables]
            raise ValueError(
                f"rank {self.rank}'s Engram tables (owners {owners}) are sharded unlike another rank's: "
                "every rank must shard them with the same owners (the same --table-ranks)"
            )
        if "model" in diff:
            raise ValueError(
                f"rank {self.rank}'s initial model (its replicated weights) differs from another rank's: "
                "every rank must build it the same way (the same seed and --table-init)"
            )

    def _failures(self, where: Callable[[], str]) -> Any:
        """named_failures for this rank: a failed or timed-out collective names the rank and `where()`."""
        return named_failures(self.rank, where)

    def barrier(self) -> None:
        """dist.barrier over the trainer's group; a timeout names this rank and the step."""
        with self._failures(lambda: f"in a barrier after step {self.step}"):
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ the step's pieces
    def _param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return split_sharded_params(self.model)

    def _table_optimizer(self, tables: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The row optimizers update each shard unchanged; the Sinkhorn-balanced update needs the
        sums over every row, so it runs as ShardedSinkhorn (its all-reduces over the table's group)."""
        if self.cfg.table_optimizer is not TableOptimizer.SINKHORN:
            return super()._table_optimizer(tables)
        owner = {id(t.weight): t for t in self.tables}
        return ShardedSinkhorn([owner[id(p)] for p in tables], lr=self.cfg.table_lr)

    def _batch_starts(self, step: int) -> np.ndarray:
        starts = super()._batch_starts(step)  # (B,) the global batch, the same on every rank
        return starts[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, y, rows = super()._batch(step)  # (B/W, T), (B/W, T), (B/W, T, layers, heads) on the device
        if self.tables:
            prefetch_model_rows(self.model, rows)  # the step's one row exchange, before the forward
        return x, y, rows

    def _backward(self, loss: torch.Tensor) -> float:
        (loss / self.world).backward()  # summed over ranks below: the global mean's gradient
        sync_table_grads(self.tables)  # table rows' gradients to their owners
        total = all_reduce_grads(self.dense_params, self.group, extra=loss.detach().reshape(1) / self.world)
        assert total is not None
        return float(total[0])  # the global batch's mean loss; sync point

    def train_step(self) -> float:
        with self._failures(lambda: f"in step {self.step + 1} of {self.cfg.steps}"):
            return super().train_step()

    def run(self, on_step: Callable[[Trainer, float], None] | None = None, until: int | None = None) -> None:
        """Trainer.run, after checking that every rank starts from the same step and stops at the same
        one (a rank that found no checkpoint, or another one, in a folder not shared with the others,
        or that was given another `until`, would train other batches and hang in a collective)."""
        with self._failures(lambda: f"before step {self.step + 1} of {self.cfg.steps}"):
            diff = disagreements({"start": self.step, "until": until}, self.group)
        if "start" in diff:
            raise ValueError(
                f"rank {self.rank} starts at step {self.step} but not every rank does ({describe(diff)}): "
                "every rank must resume from the same checkpoint (--out must be one folder that all ranks "
                "share)"
            )
        if diff:
            raise ValueError(
                f"rank {self.rank} was asked to stop at another step than the others ({describe(diff)}): "
                "give every rank the same --until"
            )
        super().run(on_step, until)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, max_tokens: int | None = None, engram_scale: float = 1.0) -> dict[str, Any]:
        """engram.apps.lm.train.evaluate over the held-out split, the windows shared out among the ranks."""
        with self._failures(lambda: f"in the evaluation after step {self.step}"):
            return self._evaluate(max_tokens, engram_scale)

    @torch.no_grad()
    def _evaluate(self, max_tokens: int | None, engram_scale: float) -> dict[str, Any]:
        model, stream, seq = self.model, self.data.held_out, self.cfg.seq_len
        was_training = model.training
        model.eval()
        starts = stream.eval_starts(seq, max_tokens)
        parts = np.array_split(starts, self.world)  # contiguous, sizes differ by at most one
        mine = parts[self.rank]
        rounds = max(math.ceil(len(p) / _EVAL_BATCH) for p in parts)  # the same on every rank
        n_cat = len(stream.categories)
        loss_sum = torch.zeros(n_cat, dtype=torch.float64)
        count = torch.zeros(n_cat, dtype=torch.float64)
        rows = self.rows[1]
        for i in range(rounds):
            s = mine[i * _EVAL_BATCH : (i + 1) * _EVAL_BATCH]
            if self.tables:  # a rank out of windows still takes part in the exchange, with no rows
                r = window_rows(rows, s, seq) if len(s) else None
                prefetch_model_rows(model, None if r is None else to_device(r, self.device))
            if len(s):
                with autocast(self.device, self.precision):
                    score_windows(model, stream, rows, s, seq, loss_sum, count, engram_scale, self.device)
            release_tables(self.tables)
        both = torch.cat([loss_sum, count]).to(self.device)
        dist.all_reduce(both, group=self.group)
        both = both.cpu()
        model.train(was_training)
        return eval_summary(stream, both[:n_cat], both[n_cat:])

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Gather shards to rank 0, which writes the single-process format (or, with
        sharded_checkpoints, every owner rank writes its rows); a collective."""
        if self.out_dir is None:
            raise ValueError("this Trainer has no out_dir to write checkpoints into")
        with self._failures(lambda: f"writing the checkpoint of step {self.step}"):
            if self.sharded_checkpoints:
                return self._save_sharded_checkpoint()
            tensors = self._checkpoint_tensors()
            path = self.out_dir / "checkpoints" / f"step-{self.step:07d}"
            if self.rank == 0:
                path = self._write_checkpoint(*tensors)
            dist.barrier(group=self.group)  # no rank reads the folder before rank 0 has renamed it
            self._saved_step = self.step
            return path

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        model_tensors, opt_tensors, groups = super()._checkpoint_tensors()
        names = {f"{n}.weight": m for n, m in self.model.named_modules() if isinstance(m, ShardedTable)}
        for key in sorted(names):  # the same order on every rank
            full = names[key].full_weight(0)
            if full is not None:
                model_tensors[key] = full
        for key in sorted(k for k in opt_tensors if k.startswith("table.")):
            full = gather_shards(self._opt_tables[int(key.split(".")[1])], opt_tensors[key], 0)
            if full is not None:
                opt_tensors[key] = full
        if self.rank != 0:
            return {}, {}, groups
        cpu = {k: v.cpu().contiguous() for k, v in model_tensors.items()}
        return cpu, {k: v.cpu().contiguous() for k, v in opt_tensors.items()}, groups

    def _named_tables(self) -> dict[str, ShardedTable]:
        """Module path -> sharded table, sorted (the same order on every rank)."""
        found = {n: m for n, m in self.model.named_modules() if isinstance(m, ShardedTable)}
        return dict(sorted(found.items()))

    def _table_ranges(self, opt_tensors: dict[str, torch.Tensor]) -> list[TableRange]:
        """This rank's rows of every table it owns rows of, as its shard file's header lists them."""
        index = {id(t): i for i, t in enumerate(self._opt_tables)}
        ranges = []
        for name, t in self._named_tables().items():
            i = index.get(id(t))
            prefix = f"table.{i}."
            fields = sorted(k[len(prefix) :] for k in opt_tensors if i is not None and k.startswith(prefix))
            if t.hi > t.lo:
                ranges.append(TableRange(name, t.num_rows, t.dim, t.lo, t.hi, i, tuple(fields)))
        return ranges

    def _shard_identity(self) -> ShardIdentity:
        """What this step's shard files record of the run (and a resume expects of them)."""
        assert self.model.config.engram is not None
        layout = layout_fingerprint(Layout(self.model.config.engram))
        return ShardIdentity(self.run_id, self.step, self.world, layout, table_optimizer_name(self.table_opt))

    def _any_failed(self, error: BaseException | None) -> bool:
        """One all-reduce (every rank calls it): whether `error` is set on any rank."""
        failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        return bool(failed[0])

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if `what` failed on any (no rank left in a barrier)."""
        failed = self._any_failed(error)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"another rank failed to {what}; see its error")

    def _save_sharded_checkpoint(self) -> Path:
        """Each owner rank writes its rows of every table (and of their optimizer state) to
        engram-shards/rank-RRRRR.safetensors in the shared temporary folder; rank 0 then writes the
        rest and renames the folder into place. No rank holds more than its own rows."""
        assert self.out_dir is not None
        model_tensors, opt_tensors, groups = Trainer._checkpoint_tensors(self)  # tables: this rank's rows
        ranges = self._table_ranges(opt_tensors)
        mine: dict[str, torch.Tensor] = {}
        for name in self._named_tables():
            weight = model_tensors.pop(f"{name}.weight")  # (hi - lo, dim) this rank's rows
            r = next((r for r in ranges if r.name == name), None)
            if r is not None:
                mine[r.weight_key] = weight
                for f in r.fields:
                    mine[r.field_key(f)] = opt_tensors[f"table.{r.index}.{f}"]  # (hi - lo, ...) per-row state
        opt_tensors = {k: v for k, v in opt_tensors.items() if not k.startswith("table.")}
        tmp = self.out_dir / "checkpoints" / f".tmp-step-{self.step:07d}-sharded"
        error: BaseException | None = None
        try:
            if self.rank == 0:
                tmp = self._checkpoint_tmp("sharded")
        except OSError as e:
            error = e
        self._agree(error, "create the checkpoint's temporary folder")  # the folder exists for all
        try:
            if mine:
                write_shard(tmp, self._shard_identity(), self.rank, ranges, mine)
        except (OSError, ValueError) as e:
            error = e
        self._agree(error, "write its table shard")  # every shard file is in the folder
        path = self.out_dir / "checkpoints" / f"step-{self.step:07d}"
        try:
            if self.rank == 0:
                model_tensors = {k: v.cpu().contiguous() for k, v in model_tensors.items()}
                opt_tensors = {k: v.cpu().contiguous() for k, v in opt_tensors.items()}
                entry = {
                    "run": self.run_id,
                    "world": self.world,
                    "optimizer": table_optimizer_name(self.table_opt),
                }
                extra = {SHARDS_KEY: entry} if self.tables else None
                path = self._write_checkpoint(model_tensors, opt_tensors, groups, tmp=tmp, extra_state=extra)
        except OSError as e:
            error = e
        self._agree(error, "write the checkpoint")  # no rank reads the folder before it is in place
        self._saved_step = self.step
        return path

    def _read_checkpoint(
        self, path: Path, state: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A sharded checkpoint: only this rank's rows of each table (and of its optimizer state) are
        read; a run resumed from one keeps writing sharded checkpoints."""
        entry = shards_of_state(state)
        if entry is None:
            return super()._read_checkpoint(path, state)
        tables = self._named_tables()
        mine = {n: (t.num_rows, t.dim) for n, t in tables.items()}
        ranges = {n: (t.lo, t.hi) for n, t in tables.items()}
        out = read_checkpoint(path, state, ranges, dtypes=self._model_dtypes(), tables=mine)
        self.sharded_checkpoints = True
        self.run_id = str(entry["run"])  # the resumed run goes on as the run that wrote the checkpoint
        return out

    def resume_from(self, path: str | Path) -> None:
        """Trainer.resume_from on every rank: each checks the files it reads, then the ranks agree (one
        all-gather) before any goes on, so a checkpoint refused on one rank is the same ValueError on
        every rank (not a lost peer in the next collective on the others)."""
        with (
            self._failures(lambda: f"resuming from {path}"),
            agreed(self.group, lambda: f"resuming from {path}"),
        ):
            super().resume_from(path)

    def _agree_intact(self, error: BaseException | None) -> BaseException | None:
        """A checkpoint is intact only if every rank read its part of it: one all-gather, so every rank
        skips the same checkpoints, for the same reason (a damaged shard file is seen only by the ranks
        that read it)."""
        with self._failures(lambda: "agreeing whether a checkpoint is intact"):
            return agreed_error(error, self.group)

    def _restore_tensors(
        self, model_tensors: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor], groups: dict
    ) -> None:
        # The model keeps its owned rows itself (ShardedTable._load_from_state_dict); the table
        # optimizer's state is cut here: each of its tensors runs over the table's rows (a
        # non-owner keeps none: an empty slice, matching its empty shard). A sharded checkpoint's
        # state arrives already cut (hi - lo rows).
        sliced = dict(opt_tensors)
        for key, value in opt_tensors.items():
            if key.startswith("table."):
                t = self._opt_tables[int(key.split(".")[1])]
                if value.shape[0] == t.num_rows:
                    sliced[key] = value[t.lo : t.hi]
                elif value.shape[0] != t.hi - t.lo:
                    raise ValueError(
                        f"checkpoint optimizer state {key!r} has {value.shape[0]} rows, the table has "
                        f"{t.num_rows}: was it written for another config?"
                    )
        super()._restore_tensors(model_tensors, sliced, groups)
