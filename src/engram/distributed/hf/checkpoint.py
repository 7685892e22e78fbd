"""Checkpoints of an HF model whose Engram tables are row-sharded across processes
(`prepare_data_parallel(model, TableSync.SHARDED)`).

No rank holds a whole table, so no single rank can write one. Two forms:
- training state (`save_table_shards` / `load_table_shards`, used by the HF Trainer's
  `EngramShardsCallback`): each owner rank writes its rows of every table and of their optimizer state
  to `<checkpoint>/engram-shards/rank-RRRRR.safetensors` (the row-range shard format,
  `engram.checkpoint.shard_format`, also `engram train --distributed`'s), and the model's optimizer
  state records the run and step they belong to. A resumed run reads back the rows it holds now, from
  whichever files hold them: at the same world size bit-exact; at another one with the rows
  redistributed; in one process, or with replicated tables, every row (the table optimizer then a
  plain one);
- the Engram part (`save_engram` / `export_fp8` / `export_quantised`, tables in float or any row
  format): every rank writes its own rows into the one part `engram.hf.load_engram` reads in one
  process (`hf_part`: nothing gathered).
Knows ShardedTable, the table optimizers' per-row state and the shard files; nothing of the Trainer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.shard_format import SHARDED_STATE_KEY, SHARDS_FOLDER, ShardIdentity, TableRange
from engram.checkpoint.shards import RowShards, write_shard
from engram.distributed.hf.data_parallel import ShardedTableSync
from engram.distributed.hf.part import write_part
from engram.distributed.shard_checkpoint import agreed, table_optimizer_name
from engram.distributed.sharded_table import ShardedTable
from engram.hf.attach import get_attachment
from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.table import TrainableTable
from engram.rowformat.formats import RowFormat, as_row_format

__all__ = [
    "SHARDS_FOLDER",
    "export_fp8",
    "export_quantised",
    "load_table_shards",
    "pending_restore",
    "save_engram",
    "save_table_shards",
]


def _row_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """The table optimizer's state with every tensor running over its table's rows (dim 0)."""
    sd = opt.row_state_dict() if hasattr(opt, "row_state_dict") else opt.state_dict()
    return sd["state"]


def _load_row_state(
    opt: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]], groups: list
) -> None:
    held = opt.param_groups  # the group dicts the model's EngramOptimizer (and its LR scheduler) hold
    sd = {"state": state, "param_groups": groups}
    if hasattr(opt, "load_row_state_dict"):
        opt.load_row_state_dict(sd)
    elif isinstance(opt, SparseRowAdam | SparseRowAdagrad):
        opt.load_state_dict(sd, copy=False)  # `state` was read fresh: held once, not copied
    else:  # torch's own: keeps tensors of the parameter's dtype and device as they are
        opt.load_state_dict(sd)
    # torch's load made new group dicts: keep the held ones, with the loaded values, or an LR scheduler
    # stepping the model's optimizer would set learning rates this one no longer reads after a resume
    for old, new in zip(held, opt.param_groups, strict=True):
        old.update(new)
    opt.param_groups = held


def _table_names(model: nn.Module) -> list[str]:
    """The tables' names in shard files (the attachment's layer ids: the same under any wrapper)."""
    return [f"layers.{lid}.table" for lid in get_attachment(model).layers]


def save_table_shards(model: nn.Module, folder: str | os.PathLike[str]) -> Path | None:
    """Write this rank's rows of the row-sharded tables (and their optimizer state) to a checkpoint.

    The file, `folder/engram-shards/rank-RRRRR.safetensors`, records the run and the table steps
    taken (what the optimizer's `state_dict()` records of the tables), the world size, its rank, each
    table's row range and the layout fingerprint. Every rank calls it with the same model; no
    collective. The HF Trainer's `EngramShardsCallback` calls it at each save.

    Args:
        model: A model whose tables `prepare_data_parallel(model, "sharded")` sharded.
        folder: The checkpoint folder.

    Returns:
        The file written, or None on a rank that owns no rows.

    Raises:
        ValueError: The tables are not row-sharded, or the table optimizer's state does not run over
            the rows (it cannot be checkpointed sharded).
    """
    att = get_attachment(model)
    sync = att.table_sync
    if not isinstance(sync, ShardedTableSync):
        raise ValueError(
            "the model's Engram tables are not row-sharded (prepare_data_parallel(model, 'sharded')): the "
            "Trainer's own files hold them whole"
        )
    opt = sync.optimizer
    state = _row_state(opt) if opt is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    ranges = []
    for i, (name, t) in enumerate(zip(_table_names(model), sync.tables, strict=True)):
        if t.hi == t.lo:
            continue
        fields = state.get(i, {})
        r = TableRange(name, t.num_rows, t.dim, t.lo, t.hi, None if opt is None else i, tuple(sorted(fields)))
        ranges.append(r)
        tensors[r.weight_key] = t.weight.detach()
        for field, value in fields.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != t.hi - t.lo:
                raise ValueError(
                    f"{type(opt).__name__}'s state {field!r} of table {i} does not run over its rows: this "
                    "table optimizer cannot be checkpointed sharded"
                )
            tensors[r.field_key(field)] = value.detach()
    if not ranges:
        return None
    first = sync.tables[0]
    identity = ShardIdentity(
        sync.run, sync.steps, first.world, layout_fingerprint(Layout(att.config)), table_optimizer_name(opt)
    )
    return write_shard(folder, identity, first.rank, ranges, tensors)


def pending_restore(model: nn.Module) -> tuple[dict[str, Any] | None, Any]:
    """(the loaded optimizer state's table part whose rows are still to be read back from shard files,
    or None; the model's table sync)."""
    att = get_attachment(model)
    sync = att.table_sync
    if isinstance(sync, ShardedTableSync):
        return sync.restore, sync
    return getattr(getattr(att, "optimizer_hooks", None), "table_restore", None), sync


def load_table_shards(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Read back the model's table rows (and their optimizer state) from a checkpoint's shard files.

    The files, in `folder/engram-shards/`, may have been written at any world size. Row-sharded
    tables take the rows this rank owns, whole tables (one process, or replicated across processes)
    every row. Every file read is checked (it belongs to the run and step the optimizer state names,
    its world size, layout, optimizer and tables are this checkpoint's, its ranges tile the tables,
    its data matches its CRC32s, no NaN / Inf) before anything changes; across processes the ranks
    then agree (one all-gather), so a file refused on one rank is the same ValueError on every rank.
    The HF Trainer's `EngramShardsCallback` calls it on resume.

    Args:
        model: The model, its optimizer state already loaded (it says which run and step the files
            must be of).
        folder: The checkpoint folder.

    Raises:
        ValueError: No optimizer state loaded, no shard files, or a file refused (on every rank).
        TypeError: A table cannot take a training checkpoint's rows.
    """
    pending, sync = pending_restore(model)
    if pending is None:
        raise ValueError(
            "nothing to read back: load the checkpoint's optimizer state (optimizer.load_state_dict, which the "
            "Trainer does on resume) first; it says which run and step the shard files must be of"
        )
    att = get_attachment(model)
    group = getattr(sync, "group", None)
    folder = Path(folder)
    with agreed(group, lambda: f"resuming the Engram tables from {folder / SHARDS_FOLDER}"):
        _load(model, att, sync, pending, folder)
    if isinstance(sync, ShardedTableSync):
        mark = pending[SHARDED_STATE_KEY]
        sync.restore = None
        sync.run, sync.steps = mark["run"], mark["steps"]  # the resumed run goes on as the same run
    else:
        att.optimizer_hooks.table_restore = None


def _load(model: nn.Module, att: Any, sync: Any, pending: dict[str, Any], folder: Path) -> None:
    """Check every file this process reads, then set the table optimizer's state and the rows.

    Memory: the checks hold one block (`RowShards.chunk_bytes`); the state is read into fresh tensors
    the optimizer keeps (its `load_state_dict(copy=False)`), the rows straight into the tables' weights
    (`RowShards.read_into`): the resume adds the rank's state once and nothing for its rows."""
    root = folder / SHARDS_FOLDER
    if not os.path.lexists(root):
        raise ValueError(
            f"{root} holds no table shards: the checkpoint was written without engram.distributed's "
            "EngramShardsCallback (add it to the Trainer's callbacks), so its sharded Engram tables are lost"
        )
    mark = pending.get(SHARDED_STATE_KEY)
    if not isinstance(mark, dict) or not {"run", "steps", "world"} <= set(mark):
        raise ValueError(
            f"the optimizer state's {SHARDED_STATE_KEY!r} is {str(mark)[:200]}, expected the run, steps and "
            "world size of the shard files: the checkpoint's optimizer state is damaged or of an older version"
        )
    sharded = isinstance(sync, ShardedTableSync)
    opt = sync.optimizer if sharded else att.optimizer_hooks.tables
    tables = sync.tables if sharded else [m.table for m in att.layers.values()]
    for t in tables:
        if not isinstance(t, ShardedTable | TrainableTable):
            raise TypeError(
                f"a {type(t).__name__} cannot take a training checkpoint's rows (not a trainable table)"
            )
    shape = {n: (t.num_rows, t.dim) for n, t in zip(_table_names(model), tables, strict=True)}
    span = {
        n: (t.lo, t.hi) if sharded else (0, t.num_rows)
        for n, t in zip(_table_names(model), tables, strict=True)
    }
    expect = ShardIdentity(
        str(mark["run"]),
        mark["steps"],
        mark["world"],
        layout_fingerprint(Layout(att.config)),
        table_optimizer_name(opt),
    )
    shards = RowShards(folder, expect, shape)
    names = _table_names(model)
    dtypes = {n: t.weight.dtype for n, t in zip(names, tables, strict=True)}
    # every file this rank reads, checked (CRC32s, NaN / Inf, dtypes) a block at a time: nothing changes
    # before all have passed
    shards.check(span, dtypes=dtypes)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, t) in enumerate(zip(names, tables, strict=True)):
        r, (lo, hi) = shards.tables[name], span[name]
        fields = {f: shards.read_rows(name, r.field_key(f), lo, hi).to(t.weight.device) for f in r.fields}
        if fields:  # table i is the table optimizer's parameter i (as the files' writer had it)
            state[i] = fields
    with torch.no_grad():
        if opt is not None:  # checks the state before it changes anything; takes these tensors uncopied
            _load_row_state(opt, state, pending["param_groups"])
        del state
        for name, t in zip(names, tables, strict=True):  # straight into the table's rows, by position
            shards.read_into(name, shards.tables[name].weight_key, *span[name], t.weight)


def save_engram(model: nn.Module, directory: str | os.PathLike[str]) -> Path | None:
    """`engram.hf.save_engram` for a model with row-sharded tables (a collective).

    Every rank calls it and writes its own rows into the one part (`write_part`: no table is
    gathered); `engram.hf.load_engram` reads the part in one process.

    Args:
        model: A model whose tables `prepare_data_parallel(model, "sharded")` sharded.
        directory: The folder (its `engram/` inside an HF model folder).

    Returns:
        The part's folder on rank 0; None on the others, once it is published.

    Raises:
        ValueError: The tables are not row-sharded (use `engram.hf.save_engram`).
        RuntimeError: Another rank failed (nothing was published).
    """
    return write_part(model, directory, None)


def export_fp8(
    model: nn.Module, directory: str | os.PathLike[str], *, row_files: bool = False
) -> Path | None:
    """`engram.hf.export_fp8` for a model with row-sharded tables (a collective, as `save_engram` here).

    Each rank quantises and writes its own rows; other row formats: `export_quantised`.

    Args:
        model: A model whose tables `prepare_data_parallel(model, "sharded")` sharded.
        directory: The folder (its `engram/` inside an HF model folder).
        row_files: Also each layer's SSD row file (`engram_layer{L}.rows` in the part, what the
            row-file tier and the vLLM plugin's 'rowfile' mode read), every owner writing its rows at
            their slots, published with the part.

    Returns:
        The part's folder on rank 0; None on the others, once it is published.

    Raises:
        ValueError: The tables are not row-sharded (use `engram.hf.export_fp8`).
        RuntimeError: Another rank failed (nothing was published).
    """
    return write_part(model, directory, RowFormat.FP8, row_files=row_files)


def export_quantised(
    model: nn.Module, directory: str | os.PathLike[str], fmt: RowFormat | str, *, row_files: bool = False
) -> Path | None:
    """`engram.hf.export_quantised` for row-sharded tables: `export_fp8` here in another row format.

    Each owner rank quantises its own rows by the one-process rule, so the part's data (and each row
    file, with `row_files`, in that format) are byte for byte those the one-process export writes.

    Args:
        model: A model whose tables `prepare_data_parallel(model, "sharded")` sharded.
        directory: The folder (its `engram/` inside an HF model folder).
        fmt: "fp8", "int8", "int8-row" or "int4" (or a `RowFormat`).
        row_files: Also each layer's SSD row file in that format (see `export_fp8`).

    Returns:
        The part's folder on rank 0; None on the others, once it is published.

    Raises:
        ValueError: An unknown format (the message lists them), or tables that are not row-sharded.
        RuntimeError: Another rank failed (nothing was published).
    """
    return write_part(model, directory, as_row_format(fmt), row_files=row_files)
