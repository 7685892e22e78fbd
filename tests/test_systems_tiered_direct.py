"""TieredTable's synchronous CPU gather straight from the cache's slots (all distinct rows fit), mixed with
prefetches and with calls that overflow the cache: bit-exact with FP8Table.gather throughout."""

from __future__ import annotations

import numpy as np
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


def test_verify_counts_a_corrupted_cached_row(tmp_path) -> None:
    from engram.checkpoint.files import save_tensors
    from engram.checkpoint.mmap_table import MmapFP8Table

    g = torch.Generator().manual_seed(0)
    table = FP8Table.from_float(torch.randn(200, 64, generator=g))
    save_tensors(tmp_path / "t.safetensors", {"w": table.weight, "s": table.scale})
    for backing, placement in (
        (table, Placement.HOST),
        (MmapFP8Table(tmp_path / "t.safetensors", "w", "s"), "ssd"),
    ):
        for rows in (torch.tensor([3, 4, 5, 3]), torch.arange(100)):  # fits the cache / overflows it
            t = TieredTable(backing, placement, cache_rows=16, verify=True)
            t.gather(rows)
            assert t.stats()["verify_mismatches"] == 0 and t.stats()["verify_rows"] == rows.unique().numel()
            slot = int(t.cache.slot_of(np.array([4]))[0])
            t.cache.values.view(torch.uint8)[slot, 1] ^= 0x04  # a flipped bit in a cached row
            t.gather(torch.tensor([4, 5]))
            assert t.stats()["verify_mismatches"] == 1
            t.prefetch(torch.tensor([4]))
            t.gather(torch.tensor([4]))  # a prefetched block is checked too
            assert t.stats()["verify_mismatches"] == 2
    plain = TieredTable(table, Placement.HOST, cache_rows=16)
    plain.gather(torch.tensor([1, 2]))
    assert plain.stats()["verify_rows"] == 0  # off by default
