"""How much a hot-row cache saves on real text: replay a token stream's Engram rows through cache policies.

Replays the rows of a hashed text batch by batch (each batch deduplicated, as `RowCache.plan` sees
it) through one cache index per layer, capacity and policy (`engram.systems.policies`: lru, clock,
lfu, pinned, pinned+lru) and through Belady's offline optimum, the bound, reporting what
deduplication and the cache leave to fetch per token (`engram cache-sim`). The pinned policies pin
the hottest rows of a `Profile` of another text, so they are not scored on the text they were built
from. With `warm`, every cache (Belady's too) starts holding the profile's hottest rows, as a
server that loads its caches before traffic; otherwise every cache starts empty. Only the index
matters here: no row bytes are held. Design: docs/systems.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engram.systems.policies import (
    BELADY,
    SIM_POLICIES,
    CachePolicy,
    Policy,
    belady_hits,
    make_policy,
    sorted_distinct,
)
from engram.systems.profile import Profile

__all__ = ["CacheSimReport", "batch_rows", "plot_hit_rates", "run_policy", "simulate_cache", "sized_policy"]


@dataclass
class CacheSimReport:
    layer_id: int
    capacity: int  # cache slots (rows)
    tokens: int
    rows_asked: int  # tokens * heads
    rows_distinct: int  # distinct rows per batch, summed over batches (what a deduplicated fetch reads)
    hits: int  # of those, found in the cache
    hits_second_half: int  # hits over the second half of the batches (the cache warm; 0 for 1 batch)
    distinct_second_half: int
    row_bytes: int  # bytes of one stored row (V4.1: 256 FP8 values + 8 scales = 264)
    batches: int  # calls replayed (a warm rate needs >= 2: the first batch is always cold)
    policy: str = "lru"  # a name of SIM_POLICIES

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows_distinct if self.rows_distinct else 0.0

    @property
    def warm_hit_rate(self) -> float | None:
        """Hit rate over the second half of the batches; None with fewer than 2 batches (no warm half)."""
        if self.batches < 2:
            return None
        return self.hits_second_half / self.distinct_second_half if self.distinct_second_half else 0.0

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes fetched per token: every row asked, distinct rows per batch, misses of the cache."""
        per = self.row_bytes / self.tokens
        return {
            "no_dedup": self.rows_asked * per,
            "dedup": self.rows_distinct * per,
            "dedup_and_cache": (self.rows_distinct - self.hits) * per,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "hit_rate": self.hit_rate,
            "warm_hit_rate": self.warm_hit_rate,
            "bytes_per_token": self.bytes_per_token(),
        }


def batch_rows(rows: np.ndarray, batch_tokens: int, layer: int) -> list[np.ndarray]:
    """The sorted distinct int64 rows of layer index `layer` of rows (N, layers, heads), per batch."""
    return [sorted_distinct(rows[s : s + batch_tokens, layer]) for s in range(0, rows.shape[0], batch_tokens)]


def sized_policy(
    name: CachePolicy, capacity: int, seen: int, hottest: np.ndarray | None, pinned_fraction: float
) -> Policy | None:
    """A fresh policy of `capacity` slots for a replay that touches `seen` distinct rows (preload included).

    An lru / clock / lfu cache (or pinned+lru's LRU part) with `seen` slots never evicts, so more
    slots change nothing and are not allocated. `hottest`: the profile's rows, hottest first (pinned
    policies). None: pinned+lru with neither pinned rows nor anything to cache.
    """
    if name is CachePolicy.PINNED_LRU:
        assert hottest is not None
        p = min(hottest.shape[0], round(capacity * pinned_fraction))
        lru_slots = min(capacity - p, seen)
        # pinned_fraction 1: exactly the p rows given are pinned, the other lru_slots run LRU
        return make_policy(name, p + lru_slots, hottest[:p], 1.0) if p + lru_slots else None
    if name is CachePolicy.PINNED:
        assert hottest is not None
        return make_policy(name, capacity, hottest[:capacity])
    return make_policy(name, min(capacity, seen))


def run_policy(
    cache: Policy | None, batches: list[np.ndarray], preload: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(hits per batch (B,), the missed rows of each batch) of `cache` over sorted distinct batches,
    after one uncounted call with the rows of `preload` (a warm start). None caches nothing."""
    if cache is None:
        return np.zeros(len(batches), dtype=np.int64), list(batches)
    width = max([b.shape[0] for b in batches] + [0 if preload is None else preload.shape[0]])
    slot_of, ins_of = np.empty(width, dtype=np.int64), np.empty(width, dtype=np.int64)
    if preload is not None and preload.shape[0]:
        u = sorted_distinct(preload)
        cache.plan(u, slot_of[: u.shape[0]], ins_of[: u.shape[0]])
    hits = np.zeros(len(batches), dtype=np.int64)
    misses = []
    for b, uniq in enumerate(batches):
        n = uniq.shape[0]
        hits[b] = cache.plan(uniq, slot_of[:n], ins_of[:n])[0]
        misses.append(uniq[slot_of[:n] < 0])
    return hits, misses


def simulate_cache(
    rows: np.ndarray,
    batch_tokens: int,
    capacities: list[int],
    row_bytes: int,
    layer_ids: list[int] | None = None,
    policies: tuple[str, ...] | list[str] = ("lru",),
    profile: Profile | None = None,
    warm: bool = False,
    pinned_fraction: float = 0.5,
) -> list[CacheSimReport]:
    """Replay rows (N, n_layers, heads) of a token stream, `batch_tokens` per call, through one cache
    per (layer, capacity, policy). Returns one report per triple, layers outermost, then capacities.

    `policies`: names of SIM_POLICIES ('belady' is the offline optimum). `profile` (of another text,
    with the same layers) gives the pinned policies their rows and, with `warm`, every cache its
    starting contents: the `capacity` hottest rows.
    """
    if rows.ndim != 3 or rows.shape[0] == 0:
        raise ValueError(f"rows must be (tokens >= 1, layers, heads), got shape {rows.shape}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens={batch_tokens} must be >= 1")
    if not capacities or any(c < 1 for c in capacities):
        raise ValueError(f"capacities {capacities} must be one or more cache sizes >= 1 row")
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"rows must hold integer row ids, got dtype {rows.dtype}")
    if rows.min() < 0:
        pos = tuple(int(i) for i in np.argwhere(rows < 0)[0])
        raise ValueError(f"row id {int(rows[pos])} at position {pos} is negative; row ids are >= 0")
    bad = [p for p in policies if p not in SIM_POLICIES]
    if bad or not policies:
        raise ValueError(
            f"unknown cache policy {bad[0] if bad else None!r}; known: {', '.join(SIM_POLICIES)}"
        )
    if not 0.0 < pinned_fraction <= 1.0:
        raise ValueError(f"pinned_fraction={pinned_fraction!r} must be in (0, 1] (the share of slots pinned)")
    n, n_layers, _ = rows.shape
    layer_ids = list(range(n_layers)) if layer_ids is None else list(layer_ids)
    if len(layer_ids) != n_layers:
        raise ValueError(
            f"layer_ids {layer_ids} name {len(layer_ids)} layer(s) but rows hold {n_layers} (axis 1 of "
            f"shape {rows.shape}); give one id per layer, or layer_ids=None"
        )
    needs_profile = warm or any(p in (CachePolicy.PINNED, CachePolicy.PINNED_LRU) for p in policies)
    if needs_profile and profile is None:
        why = "a warm start" if warm else "the pinned policies"
        raise ValueError(f"{why} need a profile of another text (engram profile); pass profile=...")
    if profile is not None and not set(layer_ids) <= set(profile.layer_ids):
        raise ValueError(
            f"the profile counts layers {list(profile.layer_ids)}, the rows are of layers {layer_ids}"
        )
    n_batches = -(-n // batch_tokens)
    # the warm half: the second half of the batches; with one batch there is none (it is cold)
    half = n_batches // 2 if n_batches >= 2 else n_batches
    reports = []
    for li, lid in enumerate(layer_ids):
        batches = batch_rows(rows, batch_tokens, li)  # computed once per layer
        replay_rows = sorted_distinct(np.concatenate(batches))
        hottest = None if profile is None else profile.hottest(lid)
        sizes = np.array([b.shape[0] for b in batches])
        for cap in capacities:
            preload = hottest[:cap] if warm and hottest is not None else None
            seen = (
                replay_rows.shape[0]
                if preload is None
                else sorted_distinct(np.concatenate([replay_rows, preload])).shape[0]
            )
            for policy in policies:
                if policy == BELADY:
                    hits = belady_hits(batches, cap, preload)
                else:
                    cache = sized_policy(CachePolicy(policy), cap, int(seen), hottest, pinned_fraction)
                    hits = run_policy(cache, batches, preload)[0]
                reports.append(
                    CacheSimReport(
                        layer_id=lid,
                        capacity=cap,
                        tokens=n,
                        rows_asked=int(rows[:, li].size),
                        rows_distinct=int(sizes.sum()),
                        hits=int(hits.sum()),
                        hits_second_half=int(hits[half:].sum()),
                        distinct_second_half=int(sizes[half:].sum()),
                        row_bytes=row_bytes,
                        batches=n_batches,
                        policy=str(policy),
                    )
                )
    return reports


def plot_hit_rates(reports: list[CacheSimReport], path: str, title: str = "") -> None:
    """Hit rate vs cache size, one line per policy, one panel per layer, written to the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(r.layer_id for r in reports))
    policies = list(dict.fromkeys(r.policy for r in reports))
    fig, axes = plt.subplots(1, len(layers), figsize=(5.5 * len(layers), 4.2), squeeze=False)
    for ax, lid in zip(axes[0], layers, strict=True):
        for policy in policies:
            pts = sorted(
                (r.capacity, r.hit_rate) for r in reports if r.layer_id == lid and r.policy == policy
            )
            style = {"color": "black", "linestyle": "--"} if policy == BELADY else {}
            ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", label=policy, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache rows per layer")
        ax.set_ylabel("hit rate (distinct rows per batch)")
        ax.set_title(f"layer {lid}")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
