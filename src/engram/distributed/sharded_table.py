"""A row-sharded Engram table for training over torch.distributed (SPEC §5, "Training").

`ShardedTable` keeps a rank's contiguous rows (`shard_bounds`; optionally on dedicated owner
ranks only) as its parameter, with sparse row gradients that the sparse optimizers update
unchanged. `prefetch_tables` and `sync_table_grads` are the step's collectives (one all-to-all
for every table of the batch, before forward and after backward); `gather_shards` assembles a
table on one rank for checkpoints. Knows process groups and rows, nothing of the model or the
training loop. Design and the per-step flow: docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engram.distributed.exchange_stats import record_grads, record_prefetch
from engram.model.table import EngramTable
from engram.model.table_init import INIT_CHUNK_ROWS, chunked_normal  # (re-exported)
from engram.rowformat.fp8 import check_rows

__all__ = [
    "INIT_CHUNK_ROWS",
    "ShardedTable",
    "check_owners",
    "chunked_normal",
    "gather_shards",
    "prefetch_tables",
    "release_tables",
    "shard_bounds",
    "sync_table_grads",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def check_owners(owners: Iterable[int] | None, world: int) -> tuple[int, ...]:
    """Check the ranks that hold a table's rows.

    Args:
        owners: Group ranks, or None for all `world` ranks.
        world: The group's size.

    Returns:
        The owner ranks as a sorted tuple.

    Raises:
        TypeError: A rank is not an int.
        ValueError: No owner, a rank twice, or a rank outside [0, world).
    """
    if owners is None:
        return tuple(range(world))
    found = list(owners)
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in found):
        raise TypeError(f"owners must be group ranks (ints), got {found!r}")
    ranks = tuple(sorted(found))
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= world:
        raise ValueError(
            f"owners={found!r}: the table needs at least one owner, each a distinct rank of the group "
            f"in [0, {world}) (the world size is {world}); pass e.g. {list(range(min(world, 2)))}, or "
            "None for every rank"
        )
    return ranks


def shard_bounds(num_rows: int, world: int, owners: Iterable[int] | None = None) -> list[int]:
    """Where a table's rows are split between the ranks.

    The i-th owner (in rank order; default: every rank) owns rows [i * n // N, (i + 1) * n // N)
    of n = num_rows split among N owners; a non-owner's range is empty. The boundaries stay sorted,
    so the owner of a row is the last rank whose range starts at or below it.

    Args:
        num_rows: The table's rows.
        world: The group's size.
        owners: The ranks that hold rows (None: every rank).

    Returns:
        world + 1 boundaries: rank r owns rows [bounds[r], bounds[r + 1]).

    Raises:
        ValueError: A size below 1, or bad owners (see `check_owners`).

    Examples:
        >>> from engram.distributed import shard_bounds
        >>> shard_bounds(10, 3)
        [0, 3, 6, 10]
        >>> shard_bounds(10, 4, owners=[0, 1])  # ranks 2 and 3 hold no rows
        [0, 5, 10, 10, 10]
    """
    if num_rows < 1 or world < 1:
        raise ValueError(f"shard_bounds needs num_rows >= 1 and world >= 1, got {num_rows} and {world}")
    ranks = check_owners(owners, world)
    n_own = len(ranks)
    bounds, i = [0], 0
    for r in range(world):
        if i < n_own and ranks[i] == r:
            i += 1
        bounds.append(i * num_rows // n_own)  # rows of the owners up to and including rank r
    return bounds


class ShardedTable(EngramTable):
    """A table [num_rows, dim] row-sharded over a process group, trained with sparse row gradients.

    Rank r of the group owns rows [lo, hi) = shard_bounds(num_rows, W, owners)[r : r + 2]; `weight`
    is that shard (hi - lo, dim). Build it with `ShardedTable(num_rows, dim, ...)` (chunked seeded
    init: no rank ever holds the whole table) or `ShardedTable.from_full(weight)` (copy the owned
    rows of a full table every rank already has: the sharded model starts identical to the
    unsharded one). A step prefetches its rows (`prefetch_tables`), gathers them in the forward
    pass, and after backward sends their gradients to the owners (`sync_table_grads`).

    `state_dict()` holds the local shard; `load_state_dict` takes the shard or the full table
    (it keeps the owned rows). `full_weight()` gathers the whole table on one rank (a collective).

    Args:
        num_rows: The whole table's rows.
        dim: Width of a row.
        group: The process group (default: the default process group).
        dtype: float32, bfloat16, or float64 (for checks).
        device: The shard's device; it must suit the backend: CPU for gloo, the rank's CUDA device
            for NCCL.
        init_std: The rows' normal standard deviation.
        seed: The rows are `chunked_normal(lo, hi, dim, std=init_std, seed=seed)`: the same values
            for every world size and owner set.
        shard: This rank's rows (hi - lo, dim) instead of drawing them.
        owners: The group ranks that hold rows (default: all W): num_rows / N each for N owners (a
            dedicated table group). A non-owner's `weight` is empty (0, dim), so its table memory
            and its sparse optimizer state are nil, yet it looks rows up and trains them like any
            rank (the exchange routes its requests to the owners). Every rank of the group must
            pass the same owners. The values, gradients and updates do not depend on them.

    Raises:
        ValueError: No process group, this rank not in `group`, a size below 1, bad owners, or a
            `shard` of the wrong shape.
        TypeError: `dtype` is not one a sharded table takes.

    Examples:
        One training step's table traffic, on every rank (launched with
        `torchrun --nproc_per_node 2 step.py`):

        ```python
        import torch
        from engram.distributed import ShardedTable, init_distributed, prefetch_tables, sync_table_grads

        env = init_distributed()  # gloo on the CPU
        table = ShardedTable(10_000, 32, seed=0)  # this rank holds rows [table.lo, table.hi)
        rows = torch.randint(0, 10_000, (4, 16))  # this rank's batch
        prefetch_tables([(table, rows)])  # a collective: the rows come from their owners
        table.gather(rows).square().sum().backward()  # the gradient lands in the prefetched block
        sync_table_grads([table])  # a collective: each owner gets its rows' summed sparse gradient
        assert table.weight.grad.is_sparse
        torch.distributed.destroy_process_group()
        ```
    """

    _starts: torch.Tensor

    def __init__(
        self,
        num_rows: int,
        dim: int,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_std: float = 0.02,
        seed: int = 0,
        shard: torch.Tensor | None = None,
        owners: Iterable[int] | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ShardedTable needs torch.distributed: call torch.distributed.init_process_group first "
                "(or launch with torchrun and use engram.distributed.init_distributed())"
            )
        if num_rows < 1 or dim < 1:
            raise ValueError(f"a table needs num_rows >= 1 and dim >= 1, got {num_rows} x {dim}")
        if dtype not in _DTYPES:
            raise TypeError(f"a sharded table is fp32, bf16 (or fp64 for checks), got {dtype}")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the table's process group: build the "
                "table only on the group's ranks"
            )
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.owners = check_owners(owners, self.world)
        self.bounds = shard_bounds(self.num_rows, self.world, self.owners)
        self.lo, self.hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        self.init_std, self.seed = init_std, seed
        if shard is None:
            shard = chunked_normal(self.lo, self.hi, dim, std=init_std, seed=seed, dtype=dtype, device=device)
        elif tuple(shard.shape) != (self.hi - self.lo, dim):
            raise ValueError(
                f"rank {self.rank}'s shard must be rows [{self.lo}, {self.hi}) of the table: shape "
                f"{(self.hi - self.lo, dim)}, got {tuple(shard.shape)}"
            )
        self.weight = nn.Parameter(shard.detach().to(dtype=dtype, device=device).contiguous())
        # First row of ranks 1..W-1: owner(row) = bucketize(row, _starts, right=True), the last rank
        # starting at or below the row (so never a non-owner: its empty range shares the next start).
        # int64, so a parent's .to(bf16) leaves it alone; not saved (it follows from num_rows, the
        # world size and the owners).
        starts = torch.tensor(self.bounds[1:-1], dtype=torch.int64, device=device)  # (W - 1,)
        self.register_buffer("_starts", starts, persistent=False)
        # The pending prefetch: distinct rows (U,) sorted, their values (U, dim) as an autograd leaf,
        # and the exchange they came from (shared with the other tables of that prefetch).
        self._ids: torch.Tensor | None = None
        self._block: torch.Tensor | None = None
        self._exchange: _Exchange | None = None

    @property
    def staged(self) -> torch.Tensor | None:
        """The rows of the pending prefetch (U, dim), distinct and sorted, as the forward gathers from them.

        An autograd leaf: its `.grad` is what the next flush sends to the owners; None between a
        flush and the next prefetch. For memory accounting (`engram plan train`'s validation).
        """
        return self._block

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        *,
        group: dist.ProcessGroup | None = None,
        owners: Iterable[int] | None = None,
    ) -> ShardedTable:
        """The shard of a full table that every rank holds: the sharded model starts as the unsharded one.

        Args:
            weight: The full table [num_rows, dim] (every rank passes the same values).
            group: The process group (default: the default process group).
            owners: The ranks that hold rows (default: every rank).

        Returns:
            This rank's ShardedTable, its dtype and device the table's.

        Raises:
            ValueError: `weight` is not a 2-D tensor, or bad owners.
        """
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            found = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"from_full needs a table [num_rows, dim], got {found}")
        n, world = weight.shape[0], dist.get_world_size(group) if dist.is_initialized() else 1
        owners = check_owners(owners, world)
        bounds = shard_bounds(n, world, owners)
        r = dist.get_rank(group) if dist.is_initialized() else 0
        shard = weight.detach()[bounds[r] : bounds[r + 1]].clone()
        dtype, device = weight.dtype, weight.device
        return cls(n, weight.shape[1], group=group, dtype=dtype, device=device, shard=shard, owners=owners)

    @property
    def is_owner(self) -> bool:
        """Whether this rank holds rows of the table (one of `owners`)."""
        return self.rank in self.owners

    def extra_repr(self) -> str:
        owners = "" if len(self.owners) == self.world else f", owners={list(self.owners)}"
        return (
            f"num_rows={self.num_rows}, dim={self.dim}, rank={self.rank}/{self.world}, "
            f"rows=[{self.lo}, {self.hi}){owners}"
        )

    # ------------------------------------------------------------------ lookups
    def prefetch(self, rows: torch.Tensor) -> None:
        """Fetch this table's distinct rows from their owners (a collective; see `prefetch_tables`).

        Args:
            rows: This rank's row ids, any shape.
        """
        prefetch_tables([(self, rows)])

    def gather(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows from the prefetched block; autograd-aware (the gradient lands in the block until synced).

        Without a pending prefetch this prefetches `rows` itself, which is a collective: every rank of
        the group must then call gather at the same point. Under torch.no_grad such a block is
        dropped after the call; with grad enabled it stays until sync_table_grads / release.

        Args:
            rows: Row ids (...), all of them prefetched.
            dtype: The embeddings' dtype (None: the table's).

        Returns:
            The embeddings (..., dim).

        Raises:
            ValueError: A row was not prefetched this step.
        """
        transient = False
        if self._block is None:
            prefetch_tables([(self, rows)])
            transient = not torch.is_grad_enabled()
        assert self._ids is not None and self._block is not None
        ids, block = self._ids, self._block
        if transient:
            release_tables([self])
        flat = rows.reshape(-1).to(device=ids.device, dtype=torch.int64)  # (N,)
        if flat.numel() and ids.numel() == 0:
            raise ValueError("rows were not prefetched: the pending prefetch of this table holds no rows")
        pos = torch.searchsorted(ids, flat).clamp_(max=max(ids.numel() - 1, 0))  # (N,)
        if flat.numel() and not torch.equal(ids[pos], flat):  # sync point: boundary check
            bad = int(flat[ids[pos] != flat][0])
            raise ValueError(
                f"row {bad} was not prefetched this step: prefetch (prefetch_tables) the rows the "
                "forward pass will gather, or release_tables() the stale prefetch first"
            )
        # index_select: its backward sums repeated rows in a fixed order (as TrainableTable.gather's)
        emb = block.index_select(0, pos).view(*rows.shape, self.dim)  # (..., dim)
        return emb if dtype is None or emb.dtype == dtype else emb.to(dtype)

    # ------------------------------------------------------------------ whole table
    def full_weight(self, dst: int = 0) -> torch.Tensor | None:
        """The whole table on one rank; a collective (see `gather_shards`).

        Args:
            dst: The group rank that receives it.

        Returns:
            The table [num_rows, dim] on `dst`, None elsewhere.
        """
        return gather_shards(self, self.weight.detach(), dst)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        key = prefix + "weight"
        w = state_dict.get(key)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == self.num_rows != self.hi - self.lo:
            state_dict[key] = w[self.lo : self.hi]  # a full table (a checkpoint): keep the owned rows
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


def gather_shards(table: ShardedTable, shard: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
    """Assemble a per-rank tensor over a table's owned rows (the weight or an optimizer state) on one rank.

    Every rank of the group calls it (in the same order for successive tables); each rank holding
    rows sends them to `dst` (point to point, in rank order, so nothing is padded: a non-owner
    allocates nothing and, unless it is `dst`, does not communicate).

    Args:
        table: The sharded table whose row split applies.
        shard: This rank's part, dim 0 over its owned rows.
        dst: The group rank that receives the whole.

    Returns:
        The whole [num_rows, ...] on `dst`; None on the other ranks.

    Raises:
        ValueError: `shard` has another number of rows than this rank owns, or `dst` is not a rank
            of the group.
    """
    if shard.shape[0] != table.hi - table.lo:
        raise ValueError(f"shard has {shard.shape[0]} rows, rank {table.rank} owns {table.hi - table.lo}")
    if not 0 <= dst < table.world:
        raise ValueError(f"dst={dst} is not a rank of the table's group of {table.world}")
    bounds = table.bounds
    if table.rank != dst:
        if shard.shape[0]:
            dist.send(shard.contiguous(), group_dst=dst, group=table.group)
        return None
    out = shard.new_empty((table.num_rows, *shard.shape[1:]))  # (num_rows, ...) the whole table
    for r in range(table.world):
        part = out[bounds[r] : bounds[r + 1]]  # a contiguous view: received into place
        if r == dst:
            part.copy_(shard)
        elif part.shape[0]:
            dist.recv(part, group_src=r, group=table.group)
    return out


# ---------------------------------------------------------------------------- the row exchange
class _Exchange:
    """The layout of one prefetch (several tables) that sync_table_grads reuses in reverse.

    Requester side: `order` (U,) permutes the tables' concatenated distinct rows into the send
    order (by owner, then table, then row); `send_splits[o]` rows go to owner o.
    Owner side: `recv_splits[s]` rows came from rank s; `served[t]` = (positions (n_t,) in the
    received buffer, local shard rows (n_t,)) of table t.
    """

    def __init__(
        self,
        tables: list[ShardedTable],
        order: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        served: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.tables, self.order = tables, order
        self.send_splits, self.recv_splits, self.served = send_splits, recv_splits, served


def _check_same_group(tables: list[ShardedTable]) -> None:
    first = tables[0]
    for t in tables:
        if not isinstance(t, ShardedTable):
            raise TypeError(f"the row exchange takes ShardedTables, got {type(t).__name__}")
        key = (t.group, t.dim, t.weight.dtype, t.weight.device)
        if key != (first.group, first.dim, first.weight.dtype, first.weight.device):
            raise ValueError(
                "tables exchanged together need one process group, row width, dtype and device; got "
                f"dim {t.dim} / {t.weight.dtype} / {t.weight.device} beside dim {first.dim} / "
                f"{first.weight.dtype} / {first.weight.device}: prefetch them in separate calls"
            )
    if len({id(t) for t in tables}) != len(tables):
        raise ValueError("a table appears twice in one prefetch: concatenate its rows into one tensor")


def prefetch_tables(pairs: list[tuple[ShardedTable, torch.Tensor]]) -> None:
    """Fetch each table's distinct rows from their owners, all tables in one exchange.

    A collective: every rank of the group calls it with the same tables, in the same order, each
    with its own rows. Replaces any pending prefetch of these tables.

    Args:
        pairs: (table, rows) pairs: rows of any shape, possibly empty. The tables share one process
            group, row width, dtype and device, each table once.

    Raises:
        TypeError: An element is not a ShardedTable.
        ValueError: The tables differ in group, width, dtype or device, or a table appears twice;
            rows outside a table raise on every rank (the bad rank names the row), after the counts
            exchange, so no rank is left waiting in a collective.
    """
    if not pairs:
        return
    tables = [t for t, _ in pairs]
    _check_same_group(tables)
    first = tables[0]
    world, group, device = first.world, first.group, first.weight.device
    n_tab = len(tables)

    # Local work: distinct sorted rows of each table and their owners. A bad row is not raised yet:
    # the other ranks are about to enter the counts exchange, so it is signalled through it (-1).
    error: Exception | None = None
    ids, owners = [], []
    for t, rows in pairs:
        try:
            check_rows(rows, t.num_rows)
        except (TypeError, ValueError) as e:
            error = error or ValueError(f"rank {t.rank}: {e}")
            rows = torch.empty(0, dtype=torch.int64, device=device)
        u = torch.unique(rows.reshape(-1).to(device=device, dtype=torch.int64))  # (U_t,) sorted
        ids.append(u)
        owners.append(torch.bucketize(u, t._starts, right=True))  # (U_t,) owner rank of each row
    cat_ids, cat_owner = torch.cat(ids), torch.cat(owners)  # (U,)
    cat_table = torch.repeat_interleave(
        torch.arange(n_tab, device=device), torch.tensor([len(u) for u in ids], device=device)
    )
    order = torch.argsort(cat_owner * n_tab + cat_table, stable=True)  # (U,) send order
    send_counts = torch.bincount(cat_owner * n_tab + cat_table, minlength=world * n_tab)  # (W * tables,)
    if error is not None:
        send_counts.fill_(-1)

    # 1) counts: rank s sends owner o how many rows of each table it needs from o
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(world, n_tab).cpu()  # sync point: split sizes to the host
    bad_ranks = [s for s in range(world) if bool((recv_counts[s] < 0).any())]
    if bad_ranks:
        if error is not None:
            raise error
        raise ValueError(f"rank(s) {bad_ranks} asked for rows outside their tables; see their error")
    send_splits = send_counts.view(world, n_tab).sum(1).tolist()  # sync point on CUDA
    recv_splits = recv_counts.sum(1).tolist()

    # 2) ids: the owners learn which rows to serve
    req = torch.empty(sum(recv_splits), dtype=torch.int64, device=device)  # (R,) global rows
    dist.all_to_all_single(req, cat_ids[order], recv_splits, send_splits, group=group)
    req_table = torch.repeat_interleave(torch.arange(n_tab).repeat(world), recv_counts.flatten()).to(device)
    served = []
    out = torch.empty(req.numel(), first.dim, dtype=first.weight.dtype, device=device)  # (R, dim)
    for i, t in enumerate(tables):
        pos = (req_table == i).nonzero().squeeze(1)  # (n_t,) positions in the received buffer
        local = req.index_select(0, pos) - t.lo  # (n_t,) rows of this rank's shard
        out.index_copy_(0, pos, t.weight.detach().index_select(0, local))
        served.append((pos, local))

    # 3) rows: the owners send the values back, in the order they were asked for
    got = torch.empty(cat_ids.numel(), first.dim, dtype=first.weight.dtype, device=device)  # (U, dim)
    dist.all_to_all_single(got, out, send_splits, recv_splits, group=group)
    values = torch.empty_like(got).index_copy_(0, order, got)  # back to the tables' concatenated order
    exchange = _Exchange(tables, order, send_splits, recv_splits, served)
    record_prefetch(exchange, pairs)  # the counters of exchange_stats()
    track = torch.is_grad_enabled()
    for t, u, block in zip(tables, ids, values.split([len(u) for u in ids]), strict=True):
        t._ids, t._exchange = u, exchange
        t._block = block.detach().requires_grad_(track and t.weight.requires_grad)  # (U_t, dim) leaf


def sync_table_grads(tables: list[ShardedTable]) -> None:
    """After backward: send every pending block's row gradients to the rows' owners.

    The owners sum the contributions of all ranks (in rank order on a CPU; CUDA's index_add_ sums in
    no fixed order) and set their shard's sparse gradient (added to an existing one). Releases the
    prefetches. A collective: all ranks call it with the same tables. Tables without a pending
    prefetch are skipped (the same on every rank: prefetch is collective), and so are frozen tables
    (`weight.requires_grad` False): they get no gradient, as a frozen TrainableTable gets none.

    Args:
        tables: The sharded tables.
    """
    exchanges: list[_Exchange] = []
    for t in tables:
        if t._exchange is not None and all(t._exchange is not e for e in exchanges):
            exchanges.append(t._exchange)
    for ex in exchanges:
        if not any(t.weight.requires_grad for t in ex.tables):  # frozen tables: nothing to send or set
            release_tables(ex.tables)  # (the same decision on every rank: the same model)
            continue
        first = ex.tables[0]
        blocks = [t._block for t in ex.tables]
        assert all(b is not None for b in blocks)
        grads = torch.cat([b.grad if b.grad is not None else torch.zeros_like(b) for b in blocks])  # (U, dim)
        recv = torch.empty(sum(ex.recv_splits), first.dim, dtype=grads.dtype, device=grads.device)  # (R, dim)
        dist.all_to_all_single(recv, grads[ex.order], ex.recv_splits, ex.send_splits, group=first.group)
        record_grads(ex, grads)
        acc = torch.float32 if grads.dtype == torch.bfloat16 else grads.dtype  # sum bf16 rows in fp32
        for t, (pos, local) in zip(ex.tables, ex.served, strict=True):
            rows, inverse = torch.unique(local, return_inverse=True)  # (V,) sorted distinct, (n_t,)
            summed = torch.zeros(rows.numel(), t.dim, dtype=acc, device=recv.device)  # (V, dim)
            summed.index_add_(0, inverse, recv.index_select(0, pos).to(acc))  # rank order on CPU
            grad = torch.sparse_coo_tensor(
                rows[None],
                summed.to(t.weight.dtype),
                tuple(t.weight.shape),
                is_coalesced=True,  # sorted distinct rows by construction
                check_invariants=False,
            )
            if t.weight.requires_grad:  # a frozen table of the exchange gets no gradient (nor update)
                t.weight.grad = grad if t.weight.grad is None else t.weight.grad + grad
        release_tables(ex.tables)


def release_tables(tables: list[ShardedTable]) -> None:
    """Drop the pending prefetch of these tables (local; no collective).

    Args:
        tables: The sharded tables.
    """
    for t in tables:
        t._ids = t._block = t._exchange = None
