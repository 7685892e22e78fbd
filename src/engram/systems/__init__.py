"""Systems layer: Engram tables on storage tiers, a hot-row cache and prefetch, wrapped around the model.

The model code (`engram.model.module`, `engram.model.lm`) knows nothing of this package:
`offload_engram` swaps each Engram module's table for a `TieredTable`, and `Prefetcher` starts
fetching a batch's rows before its forward pass; `LevelTable` keeps a table in three levels (device
cache, host cache, SSD row file). Inference only (V4.1 tables are frozen).
`simulate_cache` (`engram cache-sim`) is imported from `engram.systems.cache_sim`, not here.
Importing this package compiles nothing. Design: docs/systems.md.
"""

from engram.systems.background import FetchWorker, PrefetchHandle
from engram.systems.cache import CachePlan, RowCache
from engram.systems.levels import LevelStats, LevelTable
from engram.systems.placement import Placement
from engram.systems.prefetch import PrefetchedBatch, Prefetcher, engram_modules, offload_engram
from engram.systems.staging import FetchedBlock
from engram.systems.tiered import TieredTable

__all__ = [
    "CachePlan",
    "FetchWorker",
    "FetchedBlock",
    "LevelStats",
    "LevelTable",
    "Placement",
    "PrefetchHandle",
    "PrefetchedBatch",
    "Prefetcher",
    "RowCache",
    "TieredTable",
    "engram_modules",
    "offload_engram",
]
