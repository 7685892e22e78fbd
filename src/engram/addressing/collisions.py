"""Collision analysis of the hash layout over the n-grams of a real text (SPEC §4, CRT property).

Knows the hasher's layout and a token stream; reports, per (layer, order), how many distinct
n-grams and mix values share rows, and whether two mix values ever share 3 or more heads. Knows
nothing of tables or models. Design: docs/addressing.md.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engram.addressing.hashing import NgramHasher, check_token_ids

__all__ = ["HeadReport", "OrderReport", "analyze_collisions"]

_INT64_MAX = 2**63 - 1


@dataclass
class HeadReport:
    prime: int
    rows_used: int  # distinct rows hit by the text's distinct mix values
    rows_shared: int  # rows hit by two or more distinct mix values
    mixes_in_shared_rows: int  # distinct mix values that land in a shared row


@dataclass
class OrderReport:
    layer_id: int
    order: int
    positions: int
    distinct_ngrams: int
    distinct_mixes: int
    heads: list[HeadReport] = field(default_factory=list)
    pairs_sharing_one_head: int = 0  # (mix pair, head) incidences: pairs sharing a row, summed over heads
    pairs_sharing_two_heads: int = 0  # distinct mix pairs sharing rows in exactly 2 heads
    max_heads_shared: int = 0  # the most heads any two distinct mix values share
    crt_guaranteed: bool = False  # any 3 primes of the order multiply past 2^63
    crt_ok: bool = True  # max_heads_shared <= 2

    @property
    def ngrams_sharing_a_mix(self) -> int:
        """Distinct n-grams whose 64-bit mix equals another n-gram's (identical rows in every head)."""
        return self.distinct_ngrams - self.distinct_mixes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ngrams_sharing_a_mix"] = self.ngrams_sharing_a_mix
        return d


def _pairs(counts: np.ndarray) -> int:
    c = counts.astype(np.int64)
    return int((c * (c - 1) // 2).sum())


def _order_report(
    layer_id: int, order: int, cols: list[np.ndarray], mix: np.ndarray, primes: np.ndarray
) -> OrderReport:
    ngrams = np.stack([c.ravel() for c in cols[:order]], axis=1)  # (N, order)
    mixes = np.unique(mix.ravel())  # (M,) distinct mix values
    rep = OrderReport(
        layer_id=layer_id,
        order=order,
        positions=int(ngrams.shape[0]),
        distinct_ngrams=int(np.unique(ngrams, axis=0).shape[0]),
        distinct_mixes=int(mixes.size),
    )
    rows = mixes[:, None] % primes[None, :]  # (M, K) head-local rows of each distinct mix
    for h, p in enumerate(primes.tolist()):
        _, inverse, counts = np.unique(rows[:, h], return_inverse=True, return_counts=True)
        rep.heads.append(
            HeadReport(
                prime=int(p),
                rows_used=int(counts.size),
                rows_shared=int((counts > 1).sum()),
                mixes_in_shared_rows=int((counts[inverse] > 1).sum()),
            )
        )
        rep.pairs_sharing_one_head += _pairs(counts)

    # Pairs sharing rows in two heads a, b: group by the combined key (fits int64: p_a * p_b < 2^63).
    shared: dict[tuple[int, int], int] = {}
    for a, b in itertools.combinations(range(len(primes)), 2):
        key = rows[:, a] * primes[b] + rows[:, b]
        order_idx = np.argsort(key, kind="stable")
        k_sorted = key[order_idx]
        starts = np.flatnonzero(np.diff(k_sorted) != 0) + 1
        bounds = np.concatenate([[0], starts, [key.size]])
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if hi - lo < 2:
                continue
            members = np.sort(order_idx[lo:hi])  # mix values agreeing on heads a and b (few)
            n_equal = (rows[members][:, None, :] == rows[members][None, :, :]).sum(-1)
            for x, y in zip(*np.triu_indices(members.size, 1), strict=True):
                shared[(int(members[x]), int(members[y]))] = int(n_equal[x, y])
    rep.pairs_sharing_two_heads = sum(1 for v in shared.values() if v == 2)
    rep.max_heads_shared = max(shared.values(), default=1 if rep.pairs_sharing_one_head else 0)
    smallest3 = sorted(int(p) for p in primes)[:3]
    rep.crt_guaranteed = len(smallest3) == 3 and smallest3[0] * smallest3[1] * smallest3[2] > _INT64_MAX
    rep.crt_ok = rep.max_heads_shared <= 2
    return rep


def analyze_collisions(hasher: NgramHasher, token_ids: Any) -> list[OrderReport]:
    """Collision statistics of every (layer, order) over tokenizer ids: [T] one sequence, or [B, T]
    B sequences, each starting with its own pads (the n-grams `hasher.hash` would produce)."""
    ids = check_token_ids(token_ids, hasher.config.vocab_size)
    xc = hasher.compression.lookup[ids if ids.ndim == 2 else ids[None]]  # (B, T): each row its own sequence
    cols = hasher.lookback(xc, None, None)
    reports = []
    for li, layer_id in enumerate(hasher.config.layer_ids):
        for oi, mix in enumerate(hasher.mixes(cols, li)):
            reports.append(_order_report(layer_id, oi + 2, cols, mix, hasher.primes[li, oi]))
    return reports
