"""Systems layer: Engram tables on storage tiers, a hot-row cache and prefetch, wrapped around the model.

The model code (`engram.model.module`, `engram.model.lm`) knows nothing of this package:
`offload_engram` swaps each Engram module's table for a `TieredTable`, and `Prefetcher` starts
fetching a batch's rows before its forward pass; `LevelTable` keeps a table in three levels (device
cache, host cache, SSD row file). Inference only (V4.1 tables are frozen).
`RowCache` runs one of the `CachePolicy` replacement policies (`engram.systems.policies`) with its
index on the host; `DeviceRowCache` keeps a set-associative LRU index on the device (`CacheIndex`),
and placement HOST_UVA has the CUDA gather read a pinned host table in place (`engram.systems.uva`).
`simulate_cache` (`engram cache-sim`), `Profile` (`engram profile`) and `plan_memory`
(`engram plan-memory`) are imported from `.cache_sim`, `.profile` and `.planner`, not here.
Importing this package compiles nothing. Design: docs/systems.md.
"""

from engram.systems.background import FetchWorker, PrefetchHandle
from engram.systems.cache import CachePlan, RowCache
from engram.systems.device_cache import DeviceRowCache
from engram.systems.levels import LevelStats, LevelTable
from engram.systems.placement import CacheIndex, Placement
from engram.systems.policies import CachePolicy
from engram.systems.prefetch import PrefetchedBatch, Prefetcher, engram_modules, offload_engram
from engram.systems.staging import FetchedBlock
from engram.systems.tiered import TieredTable

__all__ = [
    "CacheIndex",
    "CachePlan",
    "CachePolicy",
    "DeviceRowCache",
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
