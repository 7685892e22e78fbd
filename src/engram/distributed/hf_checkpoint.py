"""Checkpoints of an HF model whose Engram tables are row-sharded across processes
(`prepare_data_parallel(model, TableSync.SHARDED)`).

No rank holds a whole table, so no single rank can write one. Two forms:
- training state (`save_table_shards` / `load_table_shards`, used by the HF Trainer's
  `EngramShardsCallback`): each owner rank writes its rows of every table and of their optimizer state
  to `<checkpoint>/engram-shards/rank-R.safetensors`; a resumed run reads back the rows it owns now,
  from whichever files hold them, so it resumes at the same world size bit-exact and at another one
  with the rows redistributed;
- the Engram part (`save_engram` / `export_fp8`): the tables gathered to rank 0, which writes the part
  `engram.hf.load_engram` reads in one process.
Knows ShardedTable, the table optimizers' per-row state and safetensors; nothing of the Trainer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engram.distributed.sharded_table import ShardedTable
from engram.hf import export_fp8 as hf_export_fp8
from engram.hf import save_engram as hf_save_engram
from engram.hf.attach import get_attachment
from engram.model.table import TrainableTable

__all__ = ["SHARDS_FOLDER", "export_fp8", "load_table_shards", "save_engram", "save_table_shards"]

SHARDS_FOLDER = "engram-shards"
_FORMAT = 1


def _shard_file(folder: Path, rank: int) -> Path:
    return folder / SHARDS_FOLDER / f"rank-{rank:05d}.safetensors"


def _row_state(opt: torch.optim.Optimizer) -> tuple[dict[int, dict[str, torch.Tensor]], list[dict]]:
    """The table optimizer's state with every tensor running over its table's rows (dim 0)."""
    sd = opt.row_state_dict() if hasattr(opt, "row_state_dict") else opt.state_dict()
    return sd["state"], sd["param_groups"]


def _load_row_state(
    opt: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]], groups: list
) -> None:
    sd = {"state": state, "param_groups": groups}
    opt.load_row_state_dict(sd) if hasattr(opt, "load_row_state_dict") else opt.load_state_dict(sd)


def save_table_shards(
    tables: list[ShardedTable],
    table_opt: torch.optim.Optimizer | None,
    folder: str | os.PathLike[str],
    step: int,
    fingerprint: str | None = None,
) -> Path | None:
    """Write this rank's rows of `tables` (and of `table_opt`'s state; its param i is table i's shard)
    into `folder/engram-shards/`, with the tables' layout `fingerprint`; returns the file (None on a rank
    that owns no rows). Every rank calls it with the same tables; no collective."""
    state = _row_state(table_opt)[0] if table_opt is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    ranges = []
    for i, t in enumerate(tables):
        n = t.hi - t.lo
        ranges.append([t.lo, t.hi])
        if n == 0:
            continue
        tensors[f"table.{i}.weight"] = t.weight.detach()
        for key, value in state.get(i, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n:
                raise ValueError(
                    f"{type(table_opt).__name__}'s state {key!r} of table {i} does not run over its rows: "
                    "this table optimizer cannot be checkpointed sharded"
                )
            tensors[f"table.{i}.state.{key}"] = value.detach()
    if not tensors:
        return None
    first = tables[0]
    meta = {
        "format": _FORMAT,
        "step": step,
        "world": first.world,
        "rank": first.rank,
        "ranges": ranges,
        "num_rows": [t.num_rows for t in tables],
        "optimizer": type(table_opt).__name__ if table_opt is not None else None,
        "layout": fingerprint,
    }
    path = _shard_file(Path(folder), first.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.cpu().contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata={"engram_shards": json.dumps(meta)})
    return path


def _read_meta(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("engram_shards")
    if raw is None:
        raise ValueError(f"{path} is not an Engram table shard (no 'engram_shards' metadata)")
    return json.loads(raw)


def load_table_shards(
    tables: list[ShardedTable],
    table_opt: torch.optim.Optimizer | None,
    folder: str | os.PathLike[str],
    param_groups: list[dict] | None = None,
    step: int | None = None,
    fingerprint: str | None = None,
) -> None:
    """Set this rank's rows of `tables` (and `table_opt`'s state, with `param_groups`) from the shard
    files in `folder/engram-shards/`, written at any world size. Refuses files of another table shape,
    optimizer or `step`. No collective."""
    root = Path(folder) / SHARDS_FOLDER
    files = sorted(root.glob("rank-*.safetensors")) if root.is_dir() else []
    if not files:
        raise ValueError(
            f"{root} holds no table shards: the checkpoint was written without engram.distributed's "
            "EngramShardsCallback (add it to the Trainer's callbacks), so its sharded Engram tables are lost"
        )
    metas = [(p, _read_meta(p)) for p in files]
    want = [t.num_rows for t in tables]
    opt_name = type(table_opt).__name__ if table_opt is not None else None
    for p, m in metas:
        if m.get("format") != _FORMAT or m.get("num_rows") != want:
            raise ValueError(
                f"{p} holds tables of {m.get('num_rows')} rows, this model's have {want}: it was written for "
                "another Engram config"
            )
        if fingerprint is not None and m.get("layout") not in (None, fingerprint):
            raise ValueError(
                f"{p} was written for the hash layout {m.get('layout')}, this model's is {fingerprint}: another "
                "Engram config (seed, primes or table sizes); resume with the config it was trained with"
            )
        if step is not None and m.get("step") != step:
            raise ValueError(f"{p} was written at step {m.get('step')}, the checkpoint is of step {step}")
        if m.get("optimizer") != opt_name:
            raise ValueError(
                f"{p} holds the state of a {m.get('optimizer')} table optimizer, this run uses {opt_name}: "
                "resume with the table optimizer the checkpoint was trained with"
            )
    # Each file opened once: of every table, the slice of its rows this rank owns now (in file order,
    # which is row order: the files are named by rank and a rank's rows follow the lower ranks').
    parts: list[dict[str, list[torch.Tensor]]] = [{} for _ in tables]
    covered = [0] * len(tables)
    for p, m in metas:
        with safe_open(str(p), framework="pt") as f:
            keys = list(f.keys())
            for i, t in enumerate(tables):
                lo, hi = m["ranges"][i]
                a, b = max(lo, t.lo), min(hi, t.hi)
                if a >= b:
                    continue
                covered[i] += b - a
                prefix = f"table.{i}."
                for key in keys:
                    if key.startswith(prefix):
                        parts[i].setdefault(key[len(prefix) :], []).append(f.get_slice(key)[a - lo : b - lo])
    state: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for i, t in enumerate(tables):
            if covered[i] != t.hi - t.lo:
                raise ValueError(
                    f"the shard files in {root} cover {covered[i]} of rows [{t.lo}, {t.hi}) of table {i}: a "
                    "rank's file is missing"
                )
            if not parts[i]:  # a rank that owns no rows
                continue
            t.weight.copy_(torch.cat(parts[i].pop("weight")))
            fields = {k[len("state.") :]: torch.cat(v) for k, v in parts[i].items() if k.startswith("state.")}
            if fields:
                state[i] = {k: v.to(t.weight.device) for k, v in fields.items()}
    if table_opt is not None:
        empty = [i for i, t in enumerate(tables) if t.hi == t.lo]
        if empty and state:  # a non-owner: empty state of the same fields
            ref = next(iter(state.values()))
            for i in empty:
                state[i] = {k: v[:0] for k, v in ref.items()}
        groups = param_groups if param_groups is not None else table_opt.state_dict()["param_groups"]
        _load_row_state(table_opt, state, groups)


@contextmanager
def _gathered(model: nn.Module) -> Iterator[bool]:
    """Every sharded table of `model`'s Engram gathered to rank 0 (a collective) and set there as a
    plain TrainableTable for the block; yields whether this rank holds them."""
    att = get_attachment(model)
    sharded = {lid: m.table for lid, m in att.layers.items() if isinstance(m.table, ShardedTable)}
    if not sharded:
        raise ValueError("the model's Engram tables are not sharded: use engram.hf.save_engram / export_fp8")
    full = {lid: t.full_weight(0) for lid, t in sharded.items()}  # in layer order on every rank
    root = next(iter(sharded.values())).rank == 0
    try:
        if root:
            for lid, w in full.items():
                t = sharded[lid]
                att.layers[lid].table = TrainableTable.from_weight(w, init_std=t.init_std)
        yield root
    finally:
        if root:
            for lid, t in sharded.items():
                att.layers[lid].table = t


def _save(model: nn.Module, directory: str | os.PathLike[str], fp8: bool) -> Path | None:
    group = get_attachment(model).table_sync.group
    error: BaseException | None = None
    out = None
    with _gathered(model) as root:
        if root:
            try:
                out = (hf_export_fp8 if fp8 else hf_save_engram)(model, directory)
            except (OSError, ValueError) as e:
                error = e
    failed = torch.tensor([int(error is not None)])
    dist.all_reduce(failed, group=group)  # every rank learns whether rank 0 wrote it
    if error is not None:
        raise error
    if int(failed):
        raise RuntimeError(f"rank 0 failed to write the Engram part to {directory}; see its error")
    return out


def save_engram(model: nn.Module, directory: str | os.PathLike[str]) -> Path | None:
    """`engram.hf.save_engram` for a model with row-sharded tables: every rank calls it; rank 0 writes
    the whole part (readable by `engram.hf.load_engram` in one process) and returns its folder, the
    others return None once it is written."""
    return _save(model, directory, fp8=False)


def export_fp8(model: nn.Module, directory: str | os.PathLike[str]) -> Path | None:
    """`engram.hf.export_fp8` for a model with row-sharded tables (as `save_engram` here)."""
    return _save(model, directory, fp8=True)
