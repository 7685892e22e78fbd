"""engram.systems.planner: nested caches against a composition of the plain LRU twin, the link
arithmetic, refusals, and `engram plan-memory`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engram.cli import main
from engram.systems.planner import nested_hit_rates, plan_memory
from policy_reference import PlainLRU


def batches_of(seed: int, n: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(rng.zipf(1.3, 25) % 400).astype(np.int64) for _ in range(n)]


@pytest.mark.parametrize(("hbm", "dram"), [(5, 20), (30, 100), (1, 0), (200, 1000)])
def test_nested_lru_matches_two_plain_lrus(hbm, dram):
    batches = batches_of(hbm)
    first, second = PlainLRU(hbm), PlainLRU(dram) if dram else None
    h1 = h2 = n2 = 0
    for b in batches:
        hits, _ = first.call(b.tolist())
        h1 += len(hits)
        misses = [r for r in b.tolist() if r not in set(hits)]
        if second is not None:
            h2 += len(second.call(misses)[0])
            n2 += len(misses)
    got = nested_hit_rates(batches, hbm, dram, "lru")
    assert 0 <= got[3] <= 1 - got[1]  # first touches are DRAM misses
    distinct = sum(b.shape[0] for b in batches)
    assert got[0] == pytest.approx(h1 / distinct)
    assert got[1] == pytest.approx(h2 / n2 if n2 else 0.0)
    assert got[2] == np.unique(np.concatenate(batches)).shape[0]


def test_plan_arithmetic_and_bottleneck():
    rng = np.random.default_rng(0)
    rows = (rng.zipf(1.2, (2000, 1, 4)) % 5000).astype(np.int64)
    plan = plan_memory(rows, [1], [10_000], 100, 100 * 50, 100 * 500, 1e5, batch_tokens=100,
                       pcie_gbps=1e-3, ssd_gbps=1.0, ssd_read_bytes=4096)  # fmt: skip
    (ly,) = plan.layers
    assert (ly.hbm_rows, ly.dram_rows, ly.ssd_rows) == (50, 500, 9450)
    assert ly.ssd_rate == pytest.approx((1 - ly.hbm_hit_rate) * (1 - ly.dram_hit_rate))
    assert plan.pcie_bytes_per_token == pytest.approx(ly.distinct_per_token * (1 - ly.hbm_hit_rate) * 100)
    assert plan.ssd_bytes_per_token == pytest.approx(ly.distinct_per_token * ly.ssd_rate * 4096)
    d = plan.to_dict()
    assert d["dram_to_device_bytes_per_s"] == pytest.approx(plan.pcie_bytes_per_token * 1e5)
    assert d["bottleneck"] == "dram_to_device" and d["fits"] is False  # 1 MB/s of PCIe, tens of MB/s asked
    whole = plan_memory(rows, [1], [10_000], 100, 100 * 50, 100 * 9950, 1000.0, batch_tokens=100)
    assert whole.layers[0].ssd_rows == 0 and whole.layers[0].ssd_rate == 0.0
    assert whole.link_limits()["ssd_to_dram"] == float("inf")


def test_plan_refusals():
    rows = np.zeros((10, 1, 2), dtype=np.int64)
    with pytest.raises(ValueError, match=r"HBM budget 99 bytes holds less than one 100-byte row"):
        plan_memory(rows, [1], [1000], 100, 99, 1000, 1.0)
    with pytest.raises(
        ValueError, match=r"DRAM budget 200,000 bytes is larger than the whole table \(100,000"
    ):
        plan_memory(rows, [1], [1000], 100, 1000, 200_000, 1.0)
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        plan_memory(rows, [1], [1000], 100, 1000, 1000, 1.0, policy="mru")
    with pytest.raises(ValueError, match="'pinned' needs a profile"):
        plan_memory(rows, [1], [1000], 100, 1000, 1000, 1.0, policy="pinned")


def test_cli_plan_memory(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("And God said, Let there be light: and there was light.\n" * 60)
    argv = ["plan-memory", "--preset", "tiny", "--text-file", str(text), "--hbm", "20KB", "--dram", "200KB",
            "--tokens-per-s", "5000"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (ly,) = d["layers"]
    assert ly["hbm_rows"] == 20_000 // 33 and ly["dram_rows"] == 200_000 // 33
    assert d["warm"] is True and "first 90 %" in d["profile"] and "last 10 %" in d["source"]
    assert d["bottleneck"] in ("dram_to_device", "ssd_to_dram")
    assert main([*argv, "--policy", "pinned+lru", "--cold"]) == 0
    out = capsys.readouterr().out
    assert "the link that limits throughput" in out and "policy pinned+lru" in out
