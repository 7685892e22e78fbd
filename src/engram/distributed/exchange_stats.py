"""Counters of the row exchange (`prefetch_tables`, `sync_table_grads`): rows and bytes per rank.

`exchange_stats()` is this process's `ExchangeStats`, which the exchange itself updates: the rows it
was asked for (every position and head: "lookups"), the distinct rows it sent per owner and table
(what the exchange sends: repeats are removed per requesting rank), the rows it served as an owner
(and, with `count_served_distinct`, how many were distinct per table across the requesting ranks),
and the bytes this rank put into and got out of each all-to-all (counts, ids, rows, gradients), all
of them and those to or from other ranks only (the self slot of an all-to-all is a local copy).
`undeduped` is the traffic the same lookups would make if every lookup were sent: the gain of
removing repeats. Counts since the last `reset()`; `copy()` / `-` give a step's share. Cost: a pass
over the rows asked and a few counts to the host (measured on one CPU rank, 2 x 98K lookups: 2.2 ms
of a 1.6 s step). Knows the exchange's splits and rows, nothing of the model. Design:
docs/distributed.md.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

__all__ = ["ExchangeStats", "Traffic", "exchange_stats", "record_grads", "record_prefetch"]

ID_BYTES = 8  # a row id and a count travel as int64


@dataclass
class Traffic:
    """Bytes of one direction of the step's all-to-alls, per phase."""

    counts: int = 0  # how many rows of each table each rank asks each owner for
    ids: int = 0  # the rows asked for
    rows: int = 0  # their values, owners -> requesters
    grads: int = 0  # their gradients, requesters -> owners

    @property
    def total(self) -> int:
        return self.counts + self.ids + self.rows + self.grads

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


_SWITCHES = ("enabled", "count_served_distinct")
_TRAFFIC = ("sent", "sent_remote", "received", "received_remote", "undeduped", "undeduped_remote")


@dataclass
class ExchangeStats:
    """One process's exchange counters since the last `reset()` (every table, every prefetch).

    Rows are table rows (one id, one `dim`-wide value, one gradient); "remote": rows another rank
    owns (or, for served rows, that another rank asked for). Per step: divide by `prefetches`.
    """

    enabled: bool = True  # False: the exchange records nothing (its counting costs a few O(N) passes)
    # rows_served_distinct costs one sort of the served rows per table and step (on a CPU about as
    # much as the exchange's own sort of the rows asked): counted only when asked for
    count_served_distinct: bool = False
    prefetches: int = 0  # prefetch_tables calls (one exchange each, however many tables)
    grad_syncs: int = 0  # exchanges whose gradients were sent back (sync_table_grads)
    lookups: int = 0  # rows asked for, every position and head: before removing repeats
    lookups_remote: int = 0  # of those, rows another rank owns
    rows_requested: int = 0  # distinct rows per table asked of their owners: what the exchange sends
    rows_requested_remote: int = 0  # of those, asked of another rank
    rows_served: int = 0  # rows this rank served as an owner (every requesting rank, itself included)
    rows_served_remote: int = 0  # of those, to another rank
    rows_served_distinct: int = 0  # distinct per table among the served rows (with count_served_distinct)
    sent: Traffic = field(default_factory=Traffic)  # bytes this rank put into the all-to-alls
    sent_remote: Traffic = field(default_factory=Traffic)  # of those, to other ranks
    received: Traffic = field(default_factory=Traffic)
    received_remote: Traffic = field(default_factory=Traffic)
    # This rank's lookups sent one by one (ids and gradients out, values back), repeats included: the
    # bytes the exchange would move for them without removing repeats (counts phase as sent).
    undeduped: Traffic = field(default_factory=Traffic)
    undeduped_remote: Traffic = field(default_factory=Traffic)

    def reset(self) -> None:
        """Every counter back to zero (the switches kept)."""
        for f in fields(self):
            if f.name not in _SWITCHES:
                setattr(self, f.name, Traffic() if f.name in _TRAFFIC else 0)

    def copy(self) -> ExchangeStats:
        return replace(self, **{k: replace(getattr(self, k)) for k in _TRAFFIC})

    def __sub__(self, other: ExchangeStats) -> ExchangeStats:
        """The counts between two copies (`after - before`: one step's)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = a if f.name in _SWITCHES else a - b
        return ExchangeStats(**out)

    @property
    def requested_remote(self) -> Traffic:
        """This rank's own requests' traffic with other ranks as sent (repeats removed): ids and
        gradients out, values back; the counterpart of `undeduped_remote`."""
        return Traffic(self.sent_remote.counts, self.sent_remote.ids, self.received_remote.rows,
                       self.sent_remote.grads)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _TRAFFIC:
            d[k]["total"] = getattr(self, k).total
        d["requested_remote"] = asdict(self.requested_remote) | {"total": self.requested_remote.total}
        return d


_STATS = ExchangeStats()
# Lookups of each pending exchange (all, remote) and its row width in bytes, for the gradients'
# undeduped count: keyed weakly, so a released exchange leaves nothing behind.
_PENDING: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def exchange_stats() -> ExchangeStats:
    """This process's counters (the live object: `reset()` it, `copy()` it, read it)."""
    return _STATS


def record_prefetch(exchange: Any, pairs: list[tuple[Any, torch.Tensor]]) -> None:
    """Count one prefetch: `exchange` holds its splits (`send_splits[o]`: distinct rows asked of
    owner o; `recv_splits[s]`: rows served to rank s; `served`: per table (positions, local rows)),
    `pairs` the tables and the rows asked for (any shape, repeats included). Called by
    `prefetch_tables` once the rows are in; a sync point on CUDA (a few counts to the host)."""
    s = _STATS
    if not s.enabled:
        return
    tables = exchange.tables
    first = tables[0]
    rank, world, n_tab = first.rank, first.world, len(tables)
    send, recv = list(exchange.send_splits), list(exchange.recv_splits)
    row_b = first.dim * first.weight.element_size()
    lookups = local = 0
    for t, rows in pairs:
        flat = rows.reshape(-1)
        lookups += flat.numel()
        if t.hi > t.lo and flat.numel():
            local += int(((flat >= t.lo) & (flat < t.hi)).sum())  # sync point on CUDA
    if s.count_served_distinct:
        s.rows_served_distinct += sum(int(torch.unique(loc).numel()) for _, loc in exchange.served)
    asked, served = sum(send), sum(recv)
    asked_remote, served_remote = asked - send[rank], served - recv[rank]
    counts_b, counts_remote_b = world * n_tab * ID_BYTES, (world - 1) * n_tab * ID_BYTES
    s.prefetches += 1
    s.lookups += lookups
    s.lookups_remote += lookups - local
    s.rows_requested += asked
    s.rows_requested_remote += asked_remote
    s.rows_served += served
    s.rows_served_remote += served_remote
    s.sent += Traffic(counts_b, asked * ID_BYTES, served * row_b)
    s.sent_remote += Traffic(counts_remote_b, asked_remote * ID_BYTES, served_remote * row_b)
    s.received += Traffic(counts_b, served * ID_BYTES, asked * row_b)
    s.received_remote += Traffic(counts_remote_b, served_remote * ID_BYTES, asked_remote * row_b)
    s.undeduped += Traffic(counts_b, lookups * ID_BYTES, lookups * row_b)
    s.undeduped_remote += Traffic(counts_remote_b, (lookups - local) * ID_BYTES, (lookups - local) * row_b)
    _PENDING[exchange] = (lookups, lookups - local)


def record_grads(exchange: Any, grads: torch.Tensor) -> None:
    """Count one gradient exchange of `exchange` (`grads` (U, dim): the rows' gradients as sent).
    Called by `sync_table_grads`."""
    s = _STATS
    if not s.enabled:
        return
    rank = exchange.tables[0].rank
    send, recv = list(exchange.send_splits), list(exchange.recv_splits)
    grad_b = grads.shape[1] * grads.element_size()
    lookups, lookups_remote = _PENDING.pop(exchange, (0, 0))  # (0, 0): counted while disabled
    s.grad_syncs += 1
    s.sent.grads += sum(send) * grad_b
    s.sent_remote.grads += (sum(send) - send[rank]) * grad_b
    s.received.grads += sum(recv) * grad_b
    s.received_remote.grads += (sum(recv) - recv[rank]) * grad_b
    s.undeduped.grads += lookups * grad_b
    s.undeduped_remote.grads += lookups_remote * grad_b
