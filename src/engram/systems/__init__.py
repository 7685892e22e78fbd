"""Systems layer: Engram tables on storage tiers, a hot-row cache and prefetch, wrapped around the model.

The model code (`engram.model.module`, `engram.model.lm`) knows nothing of this package: `offload_engram` swaps
each Engram module's table for a `TieredTable`, and `Prefetcher` starts fetching a batch's rows before
its forward pass. Inference only (V4.1 tables are frozen).

Holds:
- `Placement` (`placement.py`): DEVICE, HOST, SSD.
- `RowCache` (`cache.py`): FP8 rows on the compute device, exact LRU, hit / miss / eviction counters.
- `TieredTable` (`tiered.py`): a table on a tier; `gather` is bitwise `FP8Table.gather`.
- `FetchedBlock` (`staging.py`): a fetch's result on the device; pinned staging and the CUDA copy.
- `PrefetchHandle`, `FetchWorker` (`background.py`): the bounded-depth background fetch.
- `offload_engram`, `Prefetcher`, `PrefetchedBatch`, `engram_modules` (`prefetch.py`).
- `simulate_cache` (`cache_sim.py`, `engram cache-sim`): what deduplication and an LRU cache save
  on a real text's rows (imported from its module, not here).

Importing it compiles nothing: the cache's numba kernel compiles (or loads from disk) on first use.
"""

from engram.systems.background import FetchWorker, PrefetchHandle
from engram.systems.cache import CachePlan, RowCache
from engram.systems.placement import Placement
from engram.systems.prefetch import PrefetchedBatch, Prefetcher, engram_modules, offload_engram
from engram.systems.staging import FetchedBlock
from engram.systems.tiered import TieredTable

__all__ = [
    "CachePlan",
    "FetchWorker",
    "FetchedBlock",
    "Placement",
    "PrefetchHandle",
    "PrefetchedBatch",
    "Prefetcher",
    "RowCache",
    "TieredTable",
    "engram_modules",
    "offload_engram",
]
