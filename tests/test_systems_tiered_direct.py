"""TieredTable's synchronous CPU gather straight from the cache's slots (all distinct rows fit), mixed with
prefetches and with calls that overflow the cache: bit-exact with FP8Table.gather throughout."""

from __future__ import annotations

import torch

from engram.model.table import FP8Table
from engram.systems import Placement, TieredTable


def test_direct_path_exact_with_prefetch_and_overflow() -> None:
    g = torch.Generator().manual_seed(0)
    table = FP8Table.from_float(torch.randn(500, 64, generator=g))
    t = TieredTable(table, Placement.HOST, cache_rows=64)
    for step in range(30):
        hi = (40, 500, 64)[step % 3]  # fits / overflows / exactly the cache
        rows = torch.randint(0, hi, (3, 50), generator=g)
        if step % 4 == 1:
            t.prefetch(rows)  # a prefetched block holds copies, never the cache's slots
        dtype = (torch.float32, torch.bfloat16)[step % 2]
        want = table.gather(rows, dtype)
        got = t.gather(rows, dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        held = got.clone()
        t.gather(torch.randint(0, 500, (200,), generator=g))  # evicts: an earlier result must not change
        assert torch.equal(got, held)
    s = t.stats()
    assert s["cache_hits"] > 0 and s["prefetch_hits"] > 0
