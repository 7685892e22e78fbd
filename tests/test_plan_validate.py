"""`engram plan train` validated against measured runs at 1, 2 and 3 gloo ranks (issue 29 item 6).

Each world size trains a born-sharded Engram (two tables, one exchange) on a tiny Llama through the
public HF path (`add_engram`, `prepare_data_parallel(model, "sharded")`, DDP, `build_optimizer`) on the
Bible's bytes, with SparseRowAdam, row-wise Adagrad and Sinkhorn on fp32 tables and SparseRowAdam on
bf16 ones (`engram.benchmarks.bench_plan_check`, small). Each rank measures the tensor bytes of its
shard, optimizer state (and Sinkhorn's workspace), staged rows and gradients, and the exchange's
counters per step; the plan, from row statistics of the very rows the run looked up, must give each
within 10 % (zero where nothing crosses ranks: N = 1). The jobs run in the suite's launch of their
world size (tests/dist_launch.py).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import dist_launch as L
from engram.benchmarks import bench_plan_check as B

pytest.importorskip("transformers")

SMALL = {"rows": 3000, "dim": 16, "steps": 3, "batch": 2, "seq": 96}
WORLDS = (1, 2, 3)


def _job(ctx, **kw) -> dict:
    """One rank's measurements (a tests/dist_launch.py job)."""
    return B.rank_job(dist.get_rank(), dist.get_world_size(), **kw)


for _w in WORLDS:
    L.register(__name__, _w, f"plan-validate-{_w}", "test_plan_validate:_job", **SMALL)


@pytest.mark.parametrize("world", WORLDS)
def test_plan_within_ten_percent_of_the_measured_run(dist_launch, world):
    ranks = L.results(dist_launch(world), f"plan-validate-{world}")
    rows = B.compare(world, ranks, **SMALL)
    compared = [r for r in rows if "not compared" not in r["quantity"]]
    assert {r["run"] for r in compared} == {f"{o}/{d}" for o, d in B.RUNS}
    off = [f"{r['run']} {r['quantity']}: planned {r['predicted']:,.0f}, measured {r['measured']:,.0f}"
           for r in compared if not r["ok"]]  # fmt: skip
    assert not off, "\n".join(off)
    if world == 1:  # nothing crosses ranks: the plan says so exactly
        assert all(r["predicted"] == r["measured"] == 0 for r in compared if "B/step" in r["quantity"])
    else:
        assert all(r["measured"] > 0 for r in compared)
