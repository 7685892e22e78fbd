"""Whether a rank's shard of the Engram tables fits what its process may still allocate, said before
it allocates (issue 29: a cap too small for even one rank's shard).

`process_limits()` reads the limits set on this process: RLIMIT_DATA against the data segment in use
(VmData), RLIMIT_AS against the address space (VmSize), and cgroup v2's memory.max of its cgroup and
each ancestor against memory.current less the page cache the kernel can drop (a cgroup is shared by
every process in it). `ShardNeed` is what a rank will allocate: its rows, their optimizer state where
the optimizer is known, the chunk rows are drawn in (or a whole table first copied from). The
`check_*` functions compare every rank's need with its limits in one all-gather, so every rank raises
the same `ShardMemoryError` naming the first rank that will not fit, its rows and bytes, the limit,
and the number of ranks that would. CPU tables only: a GPU's memory is none of these limits.
Knows tables' shapes, /proc and process groups; nothing of the models or trainers that call it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import resource
import socket
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engram.addressing.layout import Layout
from engram.config import EngramConfig
from engram.distributed.guard import all_values
from engram.distributed.sharded_table import ShardedTable, shard_bounds
from engram.model.table import TrainableTable
from engram.model.table_init import INIT_CHUNK_ROWS

__all__ = [
    "MemoryLimit",
    "ShardMemoryError",
    "ShardNeed",
    "Source",
    "TableSpec",
    "check_engram_shards_fit",
    "check_shards_fit",
    "check_state_fits",
    "check_tables_fit",
    "process_limits",
    "row_state_bytes",
    "shard_need",
    "table_specs",
    "verdict",
]

MIB = 1 << 20
_UNLIMITED = {resource.RLIM_INFINITY}


class ShardMemoryError(ValueError):
    """A rank's shard of the Engram tables (or its optimizer state) will not fit its process's memory limit.

    Raised on every rank, before any of them allocates it; the message names the first rank that
    will not fit, its rows and bytes, the limit, and the number of ranks that would.
    """


class Source(enum.StrEnum):
    """Where a rank's rows of a table come from, which decides what it allocates beside them."""

    DRAWN = "drawn"  # born sharded: drawn in chunks of INIT_CHUNK_ROWS rows (one fp32 chunk beside the rows)
    HELD = "held"  # copied from a whole table the process holds already (counted as in use)
    WHOLE = "whole"  # copied from a whole table built first, then freed (engram train --table-init copy)


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One table as a rank will hold its shard: rows [lo, hi) of num_rows, `dim` values of `itemsize` bytes."""

    num_rows: int
    dim: int
    itemsize: int
    lo: int
    hi: int
    source: Source


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """A limit on what this process may allocate: `limit` bytes, of which `used` are taken now."""

    name: str  # "RLIMIT_DATA", "RLIMIT_AS", "cgroup memory.max"
    limit: int
    used: int
    what: str  # what `used` counts, for the message
    fix: str  # how to raise it
    shared: str | None = None  # processes sharing it (a cgroup: the kernel's boot id and the cgroup's
    # inode, the same for every process in it, on this machine only, whatever its cgroup namespace); None: alone

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


@dataclasses.dataclass(frozen=True)
class ShardNeed:
    """What one rank will allocate for its shard of the tables (bytes)."""

    rank: int
    world: int
    owners: int  # ranks holding rows
    rows: int  # this rank's rows, every table
    rows_bytes: int  # still to allocate (0 when they are held already: the optimizer-state check)
    state_bytes: int | None  # the table optimizer's state for them (None: not known here)
    optimizer: str | None
    work_bytes: int  # allocated beside them while they are made: a drawing chunk, a whole table copied
    work_what: str  # what that is, for the message
    held_bytes: int  # this rank's rows held already (in `used`): room they leave if the tables split further
    total_bytes: int  # the whole tables (and their state, where known): every owner's share together

    @property
    def bytes(self) -> int:
        return self.rows_bytes + (self.state_bytes or 0) + self.work_bytes


# ------------------------------------------------------------------------------------------ limits
def _status_bytes(status: str, field: str) -> int | None:
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return None if found is None else int(found.group(1)) * 1024


def _cgroup2_root(mounts: str) -> Path:
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_limits(cgroup: str, root: Path, machine: str) -> list[MemoryLimit]:
    """memory.max - (memory.current - the file pages it can reclaim) of the process's cgroup v2 and
    each ancestor that sets one (the namespace's root has none)."""
    line = next((x for x in cgroup.splitlines() if x.startswith("0::")), None)
    if line is None:
        return []
    out = []
    rel = Path(line[3:].strip().lstrip("/"))
    for d in [rel, *rel.parents]:
        folder = root / d
        top, current = _read(folder / "memory.max"), _read(folder / "memory.current")
        if top is None or current is None or top.strip() == "max":
            continue
        stat = _read(folder / "memory.stat") or ""
        cache = sum(int(m) for m in re.findall(r"^(?:active|inactive)_file (\d+)$", stat, re.MULTILINE))
        used = max(0, int(current) - cache)
        what = f"the cgroup {folder}, its page cache aside"
        fix = f"raise {folder / 'memory.max'}"
        shared = f"{machine}:{folder.stat().st_ino}"  # (a cgroup's inode: its id, kernel-wide)
        out.append(MemoryLimit("cgroup memory.max", int(top), used, what, fix, shared=shared))
    return out


def process_limits(
    *,
    status: str | None = None,
    cgroup: str | None = None,
    mounts: str | None = None,
    cgroup_root: Path | None = None,
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
) -> list[MemoryLimit]:
    """The memory limits set on this process (none unlimited), each with what it has taken now. The
    arguments replace /proc/self/status, /proc/self/cgroup, /proc/self/mounts, the cgroup v2 mount
    and resource.getrlimit (for tests); what cannot be read is left out."""
    if status is None:
        status = _read(Path("/proc/self/status")) or ""
    out = []
    for name, key, field, what, fix in (
        ("RLIMIT_DATA", resource.RLIMIT_DATA, "VmData", "the data segment (VmData)", "ulimit -d"),
        ("RLIMIT_AS", resource.RLIMIT_AS, "VmSize", "the address space (VmSize)", "ulimit -v"),
    ):
        soft = getrlimit(key)[0]
        used = _status_bytes(status, field)
        if soft not in _UNLIMITED and soft >= 0 and used is not None:
            out.append(MemoryLimit(name, soft, used, what, f"{fix} / resource.setrlimit({name})"))
    if cgroup is None:
        cgroup = _read(Path("/proc/self/cgroup")) or ""
    if cgroup_root is None:
        if mounts is None:
            mounts = _read(Path("/proc/self/mounts")) or ""
        cgroup_root = _cgroup2_root(mounts)
    machine = (_read(Path("/proc/sys/kernel/random/boot_id")) or socket.gethostname()).strip()
    return out + _cgroup_limits(cgroup, cgroup_root, machine)


# ------------------------------------------------------------------------------------------- needs
# engram train --table-optimizer's names -> the classes (engram.apps.lm.train.Trainer._table_optimizer)
_CLASS_NAMES = {"adam": "SparseRowAdam", "adagrad": "SparseRowAdagrad", "dense-adam": "DenseTableAdam"}


def row_state_bytes(optimizer: str | None, dim: int, itemsize: int) -> int | None:
    """Bytes a table optimizer keeps per row of `dim` values of `itemsize` bytes (its state is fp32,
    fp64 for an fp64 table: engram.model.optim.state_dtype); None where it is not known beforehand
    (V4.1's Sinkhorn update keeps momentum for the rows trained so far only). `optimizer`: its class
    name or `engram train --table-optimizer`'s name."""
    sd = 8 if itemsize == 8 else 4
    optimizer = _CLASS_NAMES.get(optimizer or "", optimizer)
    if optimizer == "SparseRowAdam":
        return sd * dim + sd + 4  # exp_avg (dim,), exp_avg_sq_row, an int32 step
    if optimizer == "SparseRowAdagrad":
        return sd  # sum_row
    if optimizer == "DenseTableAdam":
        return 3 * itemsize * dim  # exp_avg, exp_avg_sq, and the gradient made dense at every step
    return None


def shard_need(
    specs: Sequence[TableSpec],
    *,
    rank: int,
    world: int,
    owners: int,
    optimizer: str | None = None,
    held: bool = False,
) -> ShardNeed:
    """What `rank` will allocate for its rows of `specs` (and their state under `optimizer`). `held`:
    the rows are allocated already (only the state is still to come)."""
    rows = sum(s.hi - s.lo for s in specs)
    rows_bytes = sum((s.hi - s.lo) * s.dim * s.itemsize for s in specs)
    per_row = [row_state_bytes(optimizer, s.dim, s.itemsize) for s in specs]
    known = optimizer is not None and all(b is not None for b in per_row)
    state = sum((s.hi - s.lo) * b for s, b in zip(specs, per_row, strict=True)) if known else None
    total = sum(
        s.num_rows * (s.dim * s.itemsize + (b if known else 0)) for s, b in zip(specs, per_row, strict=True)
    )
    work, what = 0, ""
    if not held:
        whole = sum(s.num_rows * s.dim * s.itemsize for s in specs if s.source is Source.WHOLE)
        drawn = [INIT_CHUNK_ROWS * s.dim * 4 for s in specs if s.source is Source.DRAWN and s.hi > s.lo]
        # the whole tables are freed before the state is allocated: the peak is rows + max(whole, state)
        work = max(0, whole - (state or 0)) + max(drawn, default=0)  # a chunk at a time: fp32, any dtype
        what = (
            "the whole tables, built before each rank keeps its rows (--table-init chunked draws the rows only)"
            if whole
            else f"one chunk of {INIT_CHUNK_ROWS:,} rows drawn at a time"
        )
    name = _CLASS_NAMES.get(optimizer or "", optimizer) if known else None
    to_make, kept = (0, rows_bytes) if held else (rows_bytes, 0)
    return ShardNeed(rank, world, owners, rows, to_make, state, name, work, what, kept, total)


# ----------------------------------------------------------------------------------------- verdict
def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


def _need_text(n: ShardNeed) -> str:
    parts = []
    if n.rows_bytes:
        parts.append(f"its rows {_mib(n.rows_bytes)}")
    if n.state_bytes is not None:
        parts.append(f"their {n.optimizer} state {_mib(n.state_bytes)}")
    if n.work_bytes:
        parts.append(f"{_mib(n.work_bytes)} beside them while they are made: {n.work_what}")
    return f"{n.bytes:,} bytes ({_mib(n.bytes)}: {', '.join(parts)})"


def verdict(reports: Sequence[tuple[ShardNeed, list[MemoryLimit]]]) -> str | None:
    """None when every rank's need fits each of its limits (a cgroup's shared by the ranks in it),
    else the message every rank raises: the first rank that does not fit, what it needs, the limit,
    and the fix with the number of ranks that would fit."""
    failures: list[tuple[int, str]] = []
    sharing: dict[str, list[tuple[ShardNeed, MemoryLimit]]] = {}
    for need, limits in reports:
        for lim in limits:
            if lim.shared is not None:
                sharing.setdefault(lim.shared, []).append((need, lim))
            elif need.bytes > lim.free:
                failures.append((need.rank, _alone(need, lim)))
                break
    for group in sharing.values():
        needs = [n for n, _ in group]
        free = min(lim.free for _, lim in group)
        if sum(n.bytes for n in needs) > free:
            failures.append((needs[0].rank, _together(needs, group[0][1], free)))
    if not failures:
        return None
    failures.sort(key=lambda f: f[0])
    ranks = sorted({r for r, _ in failures})
    more = f" (and {len(ranks) - 1} more rank(s))" if len(ranks) > 1 else ""
    return f"{failures[0][1]}{more}"


def _ranks_fitting(need: ShardNeed, free: int) -> str:
    """How many owner ranks would fit `free` bytes of rows and state each."""
    room = free + need.held_bytes - need.work_bytes  # rows and state a rank could hold under the limit
    if room <= 0:
        return f"not even what is allocated beside the rows while they are made fits ({need.work_what}): raise the limit"
    ranks = math.ceil(need.total_bytes / room)
    what = "tables and their state" if need.state_bytes is not None else "tables"
    return (
        f"the whole {what} take {need.total_bytes:,} bytes ({_mib(need.total_bytes)}) and a rank under "
        f"this limit has room for {_mib(room)} of them: shard them over at least {ranks} ranks (that many "
        f"processes, each owning rows: table_ranks / --table-ranks), or raise the limit"
    )


def _head(n: ShardNeed) -> str:
    what = "the optimizer state of its shard" if n.held_bytes else "its shard"
    return (
        f"rank {n.rank} of {n.world} cannot hold {what} of the Engram tables ({n.rows:,} rows of "
        f"{n.owners} owner rank(s)): it needs {_need_text(n)}"
    )


def _alone(n: ShardNeed, lim: MemoryLimit) -> str:
    return (
        f"{_head(n)}, but {lim.name} leaves it {lim.free:,} bytes ({_mib(lim.free)}: limit {_mib(lim.limit)}, "
        f"{_mib(lim.used)} taken by {lim.what}). Nothing was allocated; {_ranks_fitting(n, lim.free)} "
        f"({lim.fix})"
    )


def _together(needs: list[ShardNeed], lim: MemoryLimit, free: int) -> str:
    ranks = ", ".join(str(x.rank) for x in needs)
    together = sum(x.bytes for x in needs)
    return (
        f"{_head(needs[0])}, and ranks {ranks} share {lim.name} ({lim.what}), which leaves them {free:,} "
        f"bytes ({_mib(free)}: limit {_mib(lim.limit)}) for {together:,} bytes together. Nothing was "
        f"allocated; {lim.fix} by at least {together - free:,} bytes, or run fewer of these ranks in it "
        "(the others on more machines or cgroups)"
    )


# ------------------------------------------------------------------------------------------ checks
def check_shards_fit(
    need: ShardNeed,
    group: dist.ProcessGroup | None = None,
    limits: list[MemoryLimit] | None = None,
) -> None:
    """Raise ShardMemoryError on every rank of `group` if any rank's `need` will not fit its limits
    (default `process_limits()`): one all-gather (a collective) when a process group is up."""
    mine = (need, process_limits() if limits is None else limits)
    reports = (
        all_values({"report": mine}, group)
        if dist.is_available() and dist.is_initialized()
        else [{"report": mine}]
    )
    message = verdict([r["report"] for r in reports])
    if message is not None:
        raise ShardMemoryError(message)


def _on_host(device: torch.device | str | None) -> bool:
    return device is None or torch.device(device).type == "cpu"


def table_specs(
    tables: Iterable[nn.Module], *, rank: int, world: int, owners: Sequence[int] | None
) -> list[TableSpec]:
    """The rows `rank` will hold of each host table about to be sharded: a lazy TrainableTable's
    drawn, a held one's copied; any other table (an FP8 one, a GPU one) left out."""
    out = []
    for t in tables:
        if not isinstance(t, TrainableTable):
            continue
        if t.is_lazy:
            r = t.recipe
            assert r is not None
            n, dim, dtype, device, source = r.num_rows, r.dim, r.dtype, r.device, Source.DRAWN
        else:
            (n, dim), dtype, device, source = t.weight.shape, t.weight.dtype, t.weight.device, Source.HELD
        if _on_host(device):
            b = shard_bounds(n, world, owners)
            out.append(TableSpec(n, dim, dtype.itemsize, b[rank], b[rank + 1], source))
    return out


def check_tables_fit(
    tables: Iterable[nn.Module],
    group: dist.ProcessGroup | None,
    owners: Sequence[int] | None,
) -> None:
    """Before `prepare_data_parallel` shards `tables` over `group` (rows on `owners`; None: every
    rank): every rank's rows fit its limits, or ShardMemoryError on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    specs = table_specs(tables, rank=rank, world=world, owners=owners)
    n_owners = world if owners is None else len(owners)
    check_shards_fit(shard_need(specs, rank=rank, world=world, owners=n_owners), group)


def check_engram_shards_fit(
    config: EngramConfig | None,
    *,
    whole_first: bool,
    optimizer: str | None,
    group: dist.ProcessGroup | None = None,
    owners: Iterable[int] | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Before `engram train --distributed` builds its model: this rank's rows of `config`'s fp32
    tables (drawn, or copied from the whole tables built first: `whole_first`) and their `optimizer`
    state fit its limits on every rank of `group`, or ShardMemoryError on every rank."""
    if config is None or not _on_host(device):
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held = None if owners is None else tuple(sorted(owners))
    source = Source.WHOLE if whole_first else Source.DRAWN
    specs = []
    for lid in config.layer_ids:
        n = Layout(config).layer(lid).table_rows
        b = shard_bounds(n, world, held)
        specs.append(TableSpec(n, config.head_dim, 4, b[rank], b[rank + 1], source))
    n_owners = world if held is None else len(held)
    need = shard_need(specs, rank=rank, world=world, owners=n_owners, optimizer=optimizer)
    check_shards_fit(need, group)


def check_state_fits(optimizer: torch.optim.Optimizer, tables: Sequence[ShardedTable]) -> None:
    """Once the table optimizer is built, before its first step allocates its state: every rank's
    state for its rows fits its limits, or ShardMemoryError on every rank of the tables' group."""
    t0 = tables[0]
    specs = [
        TableSpec(t.num_rows, t.dim, t.weight.element_size(), t.lo, t.hi, Source.HELD)
        for t in tables
        if _on_host(t.weight.device)
    ]
    name = type(optimizer).__name__
    need = shard_need(specs, rank=t0.rank, world=t0.world, owners=len(t0.owners), optimizer=name, held=True)
    check_shards_fit(need, t0.group)
