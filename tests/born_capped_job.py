"""One rank of tests/test_born_capped.py's job (3 gloo ranks, tests/gloo_ranks.spawn): benchmarks/bench_born_sharded.py's
run under a data-segment cap (RLIMIT_DATA) below the whole table + its optimizer state, kept through
the resume (load_table_shards reads in place), then, under the same cap, what a rank holding the
whole table would do (the replicated layout: the table drawn whole at add_engram, SparseRowAdam's
state over all its rows), which must fail."""

from __future__ import annotations

import gc

import torch

from engram.benchmarks import bench_born_sharded as B


def _whole_table_under_the_cap(rows: int) -> str | None:
    """Hold the whole table and its SparseRowAdam state in this (capped) process, no collective:
    None if it fit, else the error."""
    from engram.model.optim import SparseRowAdam

    try:
        model = B.attach(B.backbone(), rows, lazy=False)  # drawn whole, as before tables were born sharded
        table = model.engram.module(1).table.weight
        opt = SparseRowAdam([table], lr=1e-3)
        table.grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, table.shape[1]), table.shape)
        opt.step()  # allocates the state over every row
        return None
    except (MemoryError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        gc.collect()


def job(rank: int, world: int, folder: str, rows: int, cap: float) -> dict:
    """This rank's bench job (its files in `folder`), then the whole table under the same cap."""
    res = B.rank_job(rank, world, folder, rows=rows, cap=cap, steps=2, batch=2, seq=32)
    gc.collect()
    res["whole_error"] = _whole_table_under_the_cap(rows)
    return res
