"""engram.distributed.exchange_stats: the row exchange's counters equal a count made here from the batches.

2 and 3 gloo ranks (3: uneven shards), every rank owning rows or the tables on some ranks only; each
rank asks for its own rows each step: uneven counts, many repeats, rows another rank also asks for,
and a rank with no rows at all. The job (one of the suite's 2- and 3-rank launches, tests/dist_launch.py)
returns each step's counters (`after - before`); the test recounts them with plain Python sets from the
same batches.
"""

from __future__ import annotations

import pytest
import torch

import dist_launch as L
from engram.distributed.exchange_stats import ExchangeStats, Traffic, exchange_stats

SIZES, DIM = (1000, 777), 8
STEPS = 4
OWNERS = {2: (None, (1,)), 3: (None, (0, 2))}
ID = 8


def batch(world: int, rank: int, step: int) -> list[torch.Tensor]:
    """Rank `rank`'s rows of each table at `step`: uneven sizes and shapes, repeats; rank 1 asks for
    nothing at step 1; every rank asks for rows 0-19 (rows several ranks ask the same owner for)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + world)
    out = []
    for n in SIZES:
        if rank == 1 and step == 1:
            out.append(torch.empty(0, dtype=torch.int64))
            continue
        k = int(torch.randint(1, 40, (1,), generator=g))
        rows = torch.randint(0, n, (k, 3), generator=g)
        rows[:, 1] = torch.randint(0, 20, (k,), generator=g)  # shared and repeated rows
        rows[0, 0] = n - 1  # the last row: the last owner's
        out.append(rows)
    return out


def bounds(n: int, world: int, owners: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """[lo, hi) of every rank: owner i of N holds [i * n // N, (i + 1) * n // N)."""
    own = list(range(world)) if owners is None else list(owners)
    out, i = [], 0
    for r in range(world):
        if r in own:
            out.append((i * n // len(own), (i + 1) * n // len(own)))
            i += 1
        else:
            out.append((i * n // len(own),) * 2)
    return out


def job(ctx: object) -> dict:
    """Every case of this world size on this rank of a tests/dist_launch.py launch: each step's counters."""
    import torch.distributed as dist

    from engram.distributed import ShardedTable, prefetch_tables, release_tables, sync_table_grads

    world, rank = dist.get_world_size(), dist.get_rank()
    stats = exchange_stats()  # the process's counters: the launch's other jobs count into them too
    was = (stats.enabled, stats.count_served_distinct)
    stats.enabled, stats.count_served_distinct = True, True
    res: dict = {}
    try:
        for owners in OWNERS[world]:
            for dtype in (torch.float32, torch.bfloat16):
                tables = [
                    ShardedTable(n, DIM, owners=owners, dtype=dtype, seed=i) for i, n in enumerate(SIZES)
                ]
                steps = []
                for step in range(STEPS):
                    rows = batch(world, rank, step)
                    before = stats.copy()
                    train = step != 2  # step 2: a lookup without backward (no gradient exchange)
                    with torch.set_grad_enabled(train):
                        prefetch_tables(list(zip(tables, rows, strict=True)))
                        loss = sum(
                            (t.gather(r).float() * (1 + r[..., None])).sum()
                            for t, r in zip(tables, rows, strict=True)
                        )
                    if train:
                        loss.backward()
                        sync_table_grads(tables)
                    else:
                        release_tables(tables)
                    steps.append((stats - before).to_dict())
                res[(owners, str(dtype))] = steps
        stats.count_served_distinct = False  # the one counter that costs a sort: off by default
        before = stats.copy()
        t = ShardedTable(SIZES[0], DIM)
        prefetch_tables([(t, batch(world, rank, 0)[0])])
        release_tables([t])
        res["no_distinct"] = (stats - before).to_dict()
        stats.enabled = False  # a disabled counter counts nothing
        before = stats.copy()
        t = ShardedTable(SIZES[0], DIM)
        prefetch_tables([(t, batch(world, rank, 0)[0])])
        t.gather(batch(world, rank, 0)[0]).sum().backward()
        sync_table_grads([t])
        res["disabled"] = (stats - before).to_dict()
    finally:
        stats.enabled, stats.count_served_distinct = was
    return res


WORLDS = (2, 3)
for _world in WORLDS:
    L.register(__name__, _world, f"exchange-stats-{_world}", "test_exchange_stats:job")


@pytest.fixture(scope="module")
def runs(dist_launch) -> dict[int, list[dict]]:
    """world -> every rank's result (the suite's 2-rank launch, then its 3-rank one)."""
    root = dist_launch(WORLDS[-1])
    return {w: L.results(root, f"exchange-stats-{w}") for w in WORLDS}


def expected(world: int, rank: int, step: int, owners: tuple[int, ...] | None, row_b: int) -> dict:
    """The counters of `rank` at `step`, recounted from every rank's batch."""
    asked = [[set(r.reshape(-1).tolist()) for r in batch(world, s, step)] for s in range(world)]
    mine = batch(world, rank, step)
    b = [bounds(n, world, owners) for n in SIZES]

    def owner(t: int, row: int) -> int:
        return next(o for o, (lo, hi) in enumerate(b[t]) if lo <= row < hi)

    lookups = sum(r.numel() for r in mine)
    local = sum(sum(1 for x in r.reshape(-1).tolist() if owner(t, x) == rank) for t, r in enumerate(mine))
    send = [
        sum(1 for t in range(len(SIZES)) for x in asked[rank][t] if owner(t, x) == o) for o in range(world)
    ]
    recv = [
        sum(1 for t in range(len(SIZES)) for x in asked[s][t] if owner(t, x) == rank) for s in range(world)
    ]
    distinct = sum(
        len({x for s in range(world) for x in asked[s][t] if owner(t, x) == rank}) for t in range(2)
    )
    n_tab, train = len(SIZES), step != 2
    cnt, cnt_r = world * n_tab * ID, (world - 1) * n_tab * ID
    a, a_r, v, v_r = sum(send), sum(send) - send[rank], sum(recv), sum(recv) - recv[rank]
    rem = lookups - local
    g = row_b if train else 0
    return {
        "prefetches": 1, "grad_syncs": int(train), "lookups": lookups, "lookups_remote": rem,
        "rows_requested": a, "rows_requested_remote": a_r, "rows_served": v, "rows_served_remote": v_r,
        "rows_served_distinct": distinct,
        "sent": Traffic(cnt, a * ID, v * row_b, a * g), "sent_remote": Traffic(cnt_r, a_r * ID, v_r * row_b, a_r * g),
        "received": Traffic(cnt, v * ID, a * row_b, v * g),
        "received_remote": Traffic(cnt_r, v_r * ID, a_r * row_b, v_r * g),
        "undeduped": Traffic(cnt, lookups * ID, lookups * row_b, lookups * g),
        "undeduped_remote": Traffic(cnt_r, rem * ID, rem * row_b, rem * g),
    }  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_counters_equal_a_count_from_the_batches(runs, world):
    for owners in OWNERS[world]:
        for dtype, elem in ((torch.float32, 4), (torch.bfloat16, 2)):
            for rank in range(world):
                got = runs[world][rank][(owners, str(dtype))]
                for step in range(STEPS):
                    want = expected(world, rank, step, owners, DIM * elem)
                    for key, value in want.items():
                        g = got[step][key]
                        if isinstance(value, Traffic):
                            g = Traffic(g["counts"], g["ids"], g["rows"], g["grads"])
                        assert g == value, (world, owners, dtype, rank, step, key)


@pytest.mark.parametrize("world", [2, 3])
def test_counts_balance_across_ranks_and_repeats_are_removed(runs, world):
    """What one rank sends another receives; the exchange sends fewer rows than were looked up."""
    for case in runs[world][0]:
        if case in ("disabled", "no_distinct"):
            continue
        for step in range(STEPS):
            per = [runs[world][r][case][step] for r in range(world)]
            for phase in ("counts", "ids", "rows", "grads"):
                assert sum(p["sent_remote"][phase] for p in per) == sum(
                    p["received_remote"][phase] for p in per
                )
            assert sum(p["rows_requested"] for p in per) == sum(p["rows_served"] for p in per)
            assert sum(p["rows_requested"] for p in per) < sum(p["lookups"] for p in per)  # repeats removed
            for p in per:
                assert p["requested_remote"]["total"] <= p["undeduped_remote"]["total"]
                assert p["rows_served_distinct"] <= p["rows_served"]


def test_disabled_counts_nothing(runs):
    for world in (2, 3):
        for r in runs[world]:
            nd = r["no_distinct"]
            assert nd["rows_served_distinct"] == 0 and nd["prefetches"] == 1 and nd["lookups"] > 0
            d = r["disabled"]
            assert d["prefetches"] == d["lookups"] == d["sent"]["total"] == d["grad_syncs"] == 0


def test_reset_copy_and_difference():
    s = ExchangeStats(prefetches=3, lookups=10, sent=Traffic(1, 2, 3, 4))
    c = s.copy()
    s.sent.rows += 5  # the copy's Traffic is its own
    assert c.sent == Traffic(1, 2, 3, 4) and (s - c).sent == Traffic(0, 0, 5, 0)
    s.enabled = False
    s.reset()
    assert s == ExchangeStats(enabled=False)
    assert s.to_dict()["sent"]["total"] == 0 and exchange_stats() is exchange_stats()
    assert not ExchangeStats().count_served_distinct  # off unless asked: it costs a sort a table
