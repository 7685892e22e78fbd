"""What hardware a table needs: rows per memory level, hit rates on a text, link traffic and the bottleneck.

`plan_memory` splits each layer's table over three levels — a device (HBM) cache, a host DRAM cache
of the device's misses, and SSD for the rest — from byte budgets shared by the layers in proportion
to their rows. It replays a hashed text through the two caches nested (`nested_hit_rates`: the DRAM
cache sees only the device cache's misses, batch by batch) to get each level's hit rate, turns
those into bytes per second each link carries at a given token rate, and names the link that limits
throughput. Every row fetched to the device crosses the DRAM -> device link (PCIe); every DRAM miss
is read from SSD, `ssd_read_bytes` per row (one 4 KiB page: a row of the page-aligned row file).
Knows rows, bytes and rates; nothing of tensors. Design: docs/systems.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engram.systems.cache_sim import batch_rows, run_policy, sized_policy
from engram.systems.policies import CachePolicy, policy_name, sorted_distinct
from engram.systems.profile import Profile

__all__ = ["LayerPlan", "MemoryPlan", "nested_hit_rates", "plan_memory"]

PCIE_GBPS = 25.0  # GB/s host -> device: PCIe 4.0 x16 as measured in practice (about 25 of 32 GB/s)
SSD_GBPS = 7.0  # GB/s: one PCIe 4.0 NVMe drive's rated read (random 4 KiB reads reach it at high queue depth)
SSD_READ_BYTES = 4096  # bytes read from SSD per missed row: one page of the page-aligned row file


@dataclass
class LayerPlan:
    layer_id: int
    table_rows: int
    hbm_rows: int  # device cache slots
    dram_rows: int  # host cache slots
    ssd_rows: int  # the rest of the table
    distinct_rows_seen: int  # distinct rows the text touches (a cache larger than this holds them all)
    distinct_per_token: float  # rows fetched per token after per-batch deduplication
    hbm_hit_rate: float  # of the distinct rows of a batch
    dram_hit_rate: float  # of the device cache's misses
    dram_first_touch: (
        float  # of the device cache's misses: rows the text touches first (see nested_hit_rates)
    )
    ssd_rate: float  # share of the distinct rows read from SSD


@dataclass
class MemoryPlan:
    config: str
    row_bytes: int
    tokens: int  # tokens of the text replayed
    tokens_per_s: float
    policy: str
    warm: bool
    pcie_gbps: float
    ssd_gbps: float
    ssd_read_bytes: int
    layers: list[LayerPlan] = field(default_factory=list)

    @property
    def pcie_bytes_per_token(self) -> float:
        """Bytes per token crossing DRAM -> device: every row the device cache misses."""
        return sum(ly.distinct_per_token * (1 - ly.hbm_hit_rate) for ly in self.layers) * self.row_bytes

    @property
    def ssd_bytes_per_token(self) -> float:
        """Bytes per token read from SSD: every DRAM miss costs `ssd_read_bytes`."""
        return sum(ly.distinct_per_token * ly.ssd_rate for ly in self.layers) * self.ssd_read_bytes

    @property
    def ssd_bytes_per_token_spread(self) -> float:
        """`ssd_bytes_per_token` if the rows the text touches first lay spread evenly over the rows
        outside the device, so DRAM held dram_rows / (table_rows - hbm_rows) of them: an estimate for a
        DRAM cache that has served far more text than this one (the measured rate is its lower end)."""
        total = 0.0
        for ly in self.layers:
            outside = ly.table_rows - ly.hbm_rows
            held = ly.dram_first_touch * (ly.dram_rows / outside if outside else 1.0)
            total += ly.distinct_per_token * (1 - ly.hbm_hit_rate) * max(0.0, 1 - ly.dram_hit_rate - held)
        return total * self.ssd_read_bytes

    def link_limits(self) -> dict[str, float]:
        """Tokens per second each link allows (inf: the link carries nothing)."""

        def cap(gbps: float, per_token: float) -> float:
            return gbps * 1e9 / per_token if per_token > 0 else float("inf")

        return {
            "dram_to_device": cap(self.pcie_gbps, self.pcie_bytes_per_token),
            "ssd_to_dram": cap(self.ssd_gbps, self.ssd_bytes_per_token),
        }

    @property
    def bottleneck(self) -> str:
        limits = self.link_limits()
        return min(limits, key=lambda k: limits[k])

    def to_dict(self) -> dict[str, Any]:
        limits = self.link_limits()
        return asdict(self) | {
            "dram_to_device_bytes_per_s": self.pcie_bytes_per_token * self.tokens_per_s,
            "ssd_to_dram_bytes_per_s": self.ssd_bytes_per_token * self.tokens_per_s,
            "ssd_to_dram_bytes_per_s_spread": self.ssd_bytes_per_token_spread * self.tokens_per_s,
            "max_tokens_per_s": {k: (v if v != float("inf") else None) for k, v in limits.items()},
            "bottleneck": self.bottleneck,
            "fits": min(limits.values()) >= self.tokens_per_s,
        }


def nested_hit_rates(
    batches: list[np.ndarray],
    hbm_rows: int,
    dram_rows: int,
    policy: str | CachePolicy,
    hottest: np.ndarray | None = None,
    warm: bool = False,
    pinned_fraction: float = 0.5,
) -> tuple[float, float, int, float]:
    """(device hit rate, DRAM hit rate of the device's misses, distinct rows seen, first-touch share) of
    batches through a
    device cache of `hbm_rows` then a DRAM cache of `dram_rows` (0: none), both under `policy`.
    `hottest` (a profile's rows, hottest first): the pinned policies' rows; with `warm` the device cache
    starts with the hbm_rows hottest, the DRAM cache with the next dram_rows. The first-touch share:
    of the DRAM cache's lookups, the rows neither cache ever held nor the text asked before (misses
    of any cache that starts from this profile; a long-running one may hold some of them)."""
    name = policy_name(policy)
    if name in (CachePolicy.PINNED, CachePolicy.PINNED_LRU) and hottest is None:
        raise ValueError(f"cache policy {name.value!r} needs a profile's hottest rows; give a profile")
    if warm and hottest is None:
        raise ValueError("a warm start needs a profile's hottest rows; give a profile or start cold")
    seen_rows = sorted_distinct(np.concatenate(batches)) if batches else np.empty(0, np.int64)
    distinct = sum(b.shape[0] for b in batches)
    pre1 = hottest[:hbm_rows] if warm and hottest is not None else None
    pre2 = hottest[hbm_rows : hbm_rows + dram_rows] if warm and hottest is not None else None
    seen = int(seen_rows.shape[0]) + (0 if pre1 is None else pre1.shape[0] + pre2.shape[0])
    hbm = sized_policy(name, hbm_rows, max(seen, 1), hottest, pinned_fraction)
    hits1, misses = run_policy(hbm, batches, pre1)
    h1 = int(hits1.sum())
    if dram_rows == 0 or not sum(m.shape[0] for m in misses):
        return (h1 / distinct if distinct else 0.0), 0.0, int(seen_rows.shape[0]), 0.0
    # the DRAM level pins the rows after the device's (its own hottest are the device's misses)
    rest = None if hottest is None else hottest[hbm_rows:]
    dram = sized_policy(name, dram_rows, max(seen, 1), rest, pinned_fraction)
    h2 = int(run_policy(dram, misses, pre2)[0].sum())
    n2 = sum(m.shape[0] for m in misses)
    held = [p for p in (pre1, pre2) if p is not None]
    first = _first_touches(batches, sorted_distinct(np.concatenate(held)) if held else None)
    cold = sum(int(np.isin(m, f, assume_unique=True).sum()) for m, f in zip(misses, first, strict=True))
    return h1 / distinct, h2 / n2, int(seen_rows.shape[0]), cold / n2


def _first_touches(batches: list[np.ndarray], held: np.ndarray | None) -> list[np.ndarray]:
    """Per batch, its rows that no earlier batch asked and `held` (sorted) does not hold."""
    flat = np.concatenate(batches)
    batch = np.repeat(np.arange(len(batches)), [b.shape[0] for b in batches])
    order = np.argsort(flat, kind="stable")  # grouped by row, earliest batch first
    s = flat[order]
    first = order[np.concatenate([[True], s[1:] != s[:-1]])] if s.shape[0] else order
    keep = np.zeros(flat.shape[0], dtype=bool)
    keep[first] = True
    if held is not None and held.shape[0]:
        keep &= ~np.isin(flat, held)
    return [flat[(batch == b) & keep] for b in range(len(batches))]


def plan_memory(
    rows: np.ndarray,
    layer_ids: list[int],
    table_rows: list[int],
    row_bytes: int,
    hbm_bytes: int,
    dram_bytes: int,
    tokens_per_s: float,
    *,
    config_name: str = "custom",
    batch_tokens: int = 4096,
    policy: str | CachePolicy = CachePolicy.LRU,
    profile: Profile | None = None,
    warm: bool = False,
    pcie_gbps: float = PCIE_GBPS,
    ssd_gbps: float = SSD_GBPS,
    ssd_read_bytes: int = SSD_READ_BYTES,
    pinned_fraction: float = 0.5,
) -> MemoryPlan:
    """The three-level plan for a table of `table_rows` rows per layer, from text rows (N, layers, heads).

    The byte budgets are split over the layers in proportion to their rows; each must be >= one row
    per layer and no larger than the whole table (a larger one is not a cache: put the table there).
    """
    name = policy_name(policy)
    total = sum(table_rows) * row_bytes
    for what, b in (("HBM", hbm_bytes), ("DRAM", dram_bytes)):
        if isinstance(b, bool) or not isinstance(b, int) or b < row_bytes * len(table_rows):
            raise ValueError(
                f"the {what} budget {b!r} bytes holds less than one {row_bytes}-byte row per layer; "
                f"give at least {row_bytes * len(table_rows)} bytes"
            )
        if b > total:
            raise ValueError(
                f"the {what} budget {b:,} bytes is larger than the whole table ({total:,} bytes): the table "
                f"fits there without a cache; give at most {total:,} bytes"
            )
    if not tokens_per_s > 0 or tokens_per_s == float("inf"):
        raise ValueError(f"tokens_per_s={tokens_per_s!r} must be a finite number > 0")
    for what, v in (("pcie_gbps", pcie_gbps), ("ssd_gbps", ssd_gbps), ("ssd_read_bytes", ssd_read_bytes)):
        if not v > 0 or v == float("inf"):
            raise ValueError(f"{what}={v!r} must be a finite number > 0")
    if rows.ndim != 3 or rows.shape[1] != len(layer_ids) or rows.shape[0] == 0:
        raise ValueError(
            f"rows must be (tokens >= 1, {len(layer_ids)} layers, heads), got shape {rows.shape}"
        )
    plan = MemoryPlan(config_name, row_bytes, int(rows.shape[0]), float(tokens_per_s), name.value, warm,
                      float(pcie_gbps), float(ssd_gbps), int(ssd_read_bytes))  # fmt: skip
    share = np.array(table_rows, dtype=np.float64) / sum(table_rows)
    for li, (lid, t_rows) in enumerate(zip(layer_ids, table_rows, strict=True)):
        hbm = min(t_rows, max(1, int(hbm_bytes * share[li]) // row_bytes))
        dram = min(t_rows - hbm, int(dram_bytes * share[li]) // row_bytes)
        batches = batch_rows(rows, batch_tokens, li)
        if profile is not None:
            profile.check_rows(lid, t_rows)  # a row id past the table would pin nothing real
        hottest = None if profile is None else profile.hottest(lid)
        h1, h2, seen, cold = nested_hit_rates(batches, hbm, dram, name, hottest, warm, pinned_fraction)
        if hbm == t_rows:  # the device holds the whole layer: not a cache
            h1 = 1.0
        if hbm + dram == t_rows:  # DRAM holds the rest: nothing is read from SSD
            h2 = 1.0
        plan.layers.append(
            LayerPlan(
                layer_id=lid,
                table_rows=t_rows,
                hbm_rows=hbm,
                dram_rows=dram,
                ssd_rows=t_rows - hbm - dram,
                distinct_rows_seen=seen,
                distinct_per_token=sum(b.shape[0] for b in batches) / rows.shape[0],
                hbm_hit_rate=h1,
                dram_hit_rate=h2,
                dram_first_touch=cold if hbm + dram < t_rows else 0.0,
                ssd_rate=(1 - h1) * (1 - h2),
            )
        )
    return plan
