"""engram.systems.cache_sim against a plain LRU replay written here, and `engram cache-sim`."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest

from engram.cli import main
from engram.systems.cache_sim import simulate_cache


def plain_lru(batches: list[np.ndarray], capacity: int) -> tuple[int, int]:
    """(hits, distinct) of sorted distinct batches through an LRU: hits touched first, then misses
    admitted in ascending order, never evicting a row of the same batch (RowCache's documented rules)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = distinct = 0
    for uniq in batches:
        rows = [int(r) for r in uniq]
        distinct += len(rows)
        cached = [r for r in rows if r in lru]
        hits += len(cached)
        for r in cached:
            lru.move_to_end(r)
        room = capacity - len(cached)  # slots this batch may fill without evicting its own hits
        for r in [r for r in rows if r not in lru][: max(room, 0)]:
            if len(lru) >= capacity:
                lru.popitem(last=False)
            lru[r] = None
    return hits, distinct


@pytest.mark.parametrize("capacity", [1, 7, 40, 1000])
def test_matches_plain_lru(capacity):
    rng = np.random.default_rng(capacity)
    rows = rng.zipf(1.3, size=(300, 2, 5)) % 97  # (tokens, layers, heads), many repeats
    reports = simulate_cache(rows, 16, [capacity], row_bytes=264, layer_ids=[1, 14])
    assert [r.layer_id for r in reports] == [1, 14]
    for li, r in enumerate(reports):
        batches = [np.unique(rows[s : s + 16, li]) for s in range(0, 300, 16)]
        hits, distinct = plain_lru(batches, capacity)
        assert (r.hits, r.rows_distinct) == (hits, distinct)
        assert r.rows_asked == 300 * 5 and r.tokens == 300
        b = r.bytes_per_token()
        assert b["no_dedup"] == pytest.approx(5 * 264)
        assert b["no_dedup"] >= b["dedup"] >= b["dedup_and_cache"]


def test_bad_arguments():
    rows = np.zeros((4, 1, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="batch_tokens"):
        simulate_cache(rows, 0, [4], 264)
    with pytest.raises(ValueError, match="capacities"):
        simulate_cache(rows, 2, [0], 264)
    with pytest.raises(ValueError, match="tokens >= 1"):
        simulate_cache(rows[:0], 2, [4], 264)


def test_cli_on_real_text(capsys, tmp_path):
    argv = [
        "cache-sim",
        "--max-chars",
        "20000",
        "--cache-rows",
        "1Ki",
        "64Ki",
        "--json",
        "--plot",
        str(tmp_path / "h.png"),
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["source"] == "King James Bible, held-out books"
        and out["profile"] == "King James Bible, training books"
    )
    assert out["warm"] is True
    reports = out["reports"]
    names = ["lru", "clock", "lfu", "pinned", "pinned+lru", "belady"]
    assert [(r["layer_id"], r["capacity"], r["policy"]) for r in reports] == [
        (lid, cap, p) for lid in (1, 14) for cap in (1024, 65536) for p in names
    ]
    for i in range(0, len(reports), 6):  # every policy starts from the same contents: Belady bounds them
        group = reports[i : i + 6]
        assert all(0 <= r["hit_rate"] <= group[-1]["hit_rate"] for r in group)
        assert group[0]["bytes_per_token"]["no_dedup"] == 24 * 264
    assert (tmp_path / "h.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        main(["cache-sim", "--cache-rows", "lots"])


def test_policies_and_profile_in_simulate_cache():
    from engram.systems.profile import Profile

    rng = np.random.default_rng(3)
    rows = (rng.zipf(1.3, size=(400, 1, 4)) % 300).astype(np.int64)
    ids, counts = np.unique(rows[:200], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    prof = Profile((5,), (ids[order],), (counts[order],), 1, 200, "l", "t", {}, "first half")
    reps = simulate_cache(rows[200:], 20, [8, 64], 264, [5], ["lru", "pinned", "pinned+lru", "belady"], prof)
    by = {(r.capacity, r.policy): r for r in reps}
    batches = [np.unique(rows[200:][s : s + 20, 0]) for s in range(0, 200, 20)]
    assert by[8, "lru"].hits == plain_lru(batches, 8)[0]  # cold: the LRU of today
    for cap in (8, 64):
        assert max(by[cap, p].hits for p in ("lru", "pinned", "pinned+lru")) <= by[cap, "belady"].hits
    warm = simulate_cache(rows[200:], 20, [8], 264, [5], ["lru", "belady"], prof, warm=True)
    assert warm[0].hits <= warm[1].hits
    with pytest.raises(ValueError, match="the pinned policies need a profile"):
        simulate_cache(rows, 20, [8], 264, policies=["pinned"])
    with pytest.raises(ValueError, match="a warm start need a profile"):
        simulate_cache(rows, 20, [8], 264, warm=True)
    with pytest.raises(ValueError, match="unknown cache policy 'arc'"):
        simulate_cache(rows, 20, [8], 264, policies=["lru", "arc"])
    with pytest.raises(ValueError, match=r"the profile counts layers \[5\]"):
        simulate_cache(rows, 20, [8], 264, [7], ["pinned"], prof)


def test_bad_rows_and_layer_ids():
    rows = np.random.default_rng(0).integers(0, 50, (100, 2, 3))
    with pytest.raises(ValueError, match=r"layer_ids \[7\] name 1 layer\(s\) but rows hold 2"):
        simulate_cache(rows, 10, [4], 264, layer_ids=[7])
    neg = rows.copy()
    neg[3, 1, 2] = -1
    with pytest.raises(ValueError, match=r"row id -1 at position \(3, 1, 2\) is negative"):
        simulate_cache(neg, 10, [8], 264)
    with pytest.raises(ValueError, match=r"integer row ids, got dtype float64"):
        simulate_cache(rows.astype(np.float64), 10, [8], 264)


def test_warm_rate_needs_two_batches(capsys):
    rows = np.random.default_rng(0).integers(0, 50, (100, 1, 3))
    one = simulate_cache(rows, 1000, [4], 264)[0]  # one batch: cold only
    assert one.batches == 1 and one.warm_hit_rate is None and one.to_dict()["warm_hit_rate"] is None
    assert (one.hits_second_half, one.distinct_second_half) == (0, 0)
    two = simulate_cache(rows, 50, [64], 264)[0]  # two batches: the second one is the warm half
    second = np.unique(rows[50:, 0])
    assert two.batches == 2 and two.distinct_second_half == second.size
    assert two.warm_hit_rate == pytest.approx(np.isin(second, np.unique(rows[:50, 0])).mean())
    argv = ["cache-sim", "--max-chars", "300", "--batch-tokens", "100000", "--cache-rows", "1Ki", "--json"]
    assert main(argv) == 0
    reports = json.loads(capsys.readouterr().out)["reports"]
    assert {r["warm_hit_rate"] for r in reports} == {None}
