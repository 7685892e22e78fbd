"""engram.storage.outpool.OutputPool: a kept buffer is reused only when nothing made from it is alive."""

from __future__ import annotations

import copy

import torch

from engram.model.table import FP8Table
from engram.storage.outpool import OutputPool

SHAPE = (512, 1024)  # 2 MiB of float32: pooled


def test_reused_only_when_free() -> None:
    p = OutputPool(max_buffers=2)
    a = p.empty(SHAPE, torch.float32)
    a.fill_(1.0)
    b = p.empty(SHAPE, torch.float32)
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() % 64 == 0
    ptr = a.data_ptr()
    del a
    c = p.empty(SHAPE, torch.float32)
    assert c.data_ptr() == ptr and p.reused == 1
    view = c[10:20]  # a view keeps the buffer busy
    del c
    d = p.empty(SHAPE, torch.float32)
    assert d.data_ptr() != ptr
    view.fill_(7.0)
    assert bool((view == 7.0).all())
    arr = d.numpy()  # a numpy array of it too
    dptr = d.data_ptr()
    del d
    e = p.empty(SHAPE, torch.bfloat16)
    assert e.data_ptr() != dptr and e.dtype == torch.bfloat16 and tuple(e.shape) == SHAPE
    assert arr.shape == SHAPE


def test_small_outputs_not_pooled_and_copies_start_empty() -> None:
    p = OutputPool()
    small = p.empty((4, 8), torch.float32)
    assert small.shape == (4, 8) and p.allocated == 0
    big = p.empty(SHAPE, torch.float32)
    q = copy.deepcopy(p)
    assert q.allocated == 0 and big.shape == SHAPE


def test_fp8table_results_survive_later_gathers() -> None:
    t = FP8Table.from_float(torch.randn(1000, 256))
    rows_a = torch.randint(0, 1000, (2048,), generator=torch.Generator().manual_seed(0))
    rows_b = torch.randint(0, 1000, (2048,), generator=torch.Generator().manual_seed(1))
    a = t.gather(rows_a)  # 2 MiB: from the pool
    keep = a.clone()
    for _ in range(6):
        t.gather(rows_b)  # freed at once: their buffer is reused, a's is not
    assert torch.equal(a, keep)
    assert t.out_pool.reused >= 4
    assert torch.equal(t.gather(rows_a), keep)
