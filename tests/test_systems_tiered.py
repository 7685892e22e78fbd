"""Tests for engram.systems.tiered.TieredTable: every placement, with and without a cache, returns
exactly what FP8Table.gather returns; counters; boundary errors. CUDA paths are marked `gpu`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from engram import EngramConfig, Layout
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.module import Engram
from engram.model.table import FP8Table
from engram.systems import Placement, TieredTable

ROWS, DIM = 500, 64


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that results compare exactly (NaN included)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.fixture(scope="module")
def fp8() -> FP8Table:
    g = torch.Generator().manual_seed(0)
    spread = torch.exp(torch.randn(ROWS, 1, generator=g) * 2)  # rows of very different magnitudes
    return FP8Table.from_float(torch.randn(ROWS, DIM, generator=g) * spread)


@pytest.fixture(scope="module")
def mmap(fp8: FP8Table, tmp_path_factory) -> MmapFP8Table:
    path = tmp_path_factory.mktemp("ssd") / "t.safetensors"
    save_file({"t.weight": fp8.weight, "t.scale": fp8.scale}, str(path))
    return MmapFP8Table(path, "t.weight", "t.scale")


def make(fp8: FP8Table, mmap: MmapFP8Table, placement: str, cache_rows: int, **kw) -> TieredTable:
    return TieredTable(mmap if placement == "ssd" else fp8, placement, cache_rows=cache_rows, **kw)


CASES = [("device", 0), ("host", 0), ("host", 7), ("host", 10_000), ("ssd", 0), ("ssd", 50)]


@pytest.mark.parametrize(("placement", "cache_rows"), CASES)
def test_equals_fp8_gather(fp8, mmap, placement, cache_rows):
    t = make(fp8, mmap, placement, cache_rows)
    g = torch.Generator().manual_seed(1)
    for step in range(4):  # the cache warms up over the calls
        rows = torch.randint(0, ROWS, (3, 5, 8), generator=g)
        rows[0, 0] = rows[1, 1]  # repeats within a call
        for dtype in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            ids = rows.int() if step % 2 else rows
            got = t.gather(ids, dtype)
            want = fp8.gather(rows, dtype)
            assert got.shape == (3, 5, 8, DIM) and got.dtype == want.dtype and got.device.type == "cpu"
            assert torch.equal(bits(got), bits(want)), (placement, cache_rows, dtype)
    s = t.stats()
    assert s["placement"] == placement and s["gathers"] == 20 and s["prefetch_misses"] == 20
    if placement != "device":
        assert s["bytes_fetched"] <= s["rows_distinct"] * (DIM + DIM // 32)
    if cache_rows:
        assert s["cache_hits"] + s["cache_misses"] == s["rows_distinct"]
        assert s["cache_bytes_fetched"] == s["bytes_fetched"]


def test_empty_and_scalar_rows(fp8, mmap):
    t = make(fp8, mmap, "host", 4)
    assert t.gather(torch.empty(0, 3, dtype=torch.int64)).shape == (0, 3, DIM)
    assert torch.equal(t.gather(torch.tensor(7)), fp8.gather(torch.tensor(7)))


def test_cache_counters_on_crafted_calls(fp8, mmap):
    t = make(fp8, mmap, "host", 3)
    row_bytes = DIM + DIM // 32
    t.gather(torch.tensor([[1, 2], [3, 1]]))  # 3 distinct: 3 misses
    t.gather(torch.tensor([1, 1, 1]))  # 1 hit
    t.gather(torch.tensor([4, 2]))  # 2 hit, 4 miss evicts 3 (LRU)
    t.gather(torch.tensor([3]))  # miss again, evicts 1
    s = t.stats()
    assert (s["cache_hits"], s["cache_misses"], s["cache_evictions"]) == (2, 5, 2)
    assert s["bytes_fetched"] == 5 * row_bytes and s["rows_requested"] == 10 and s["rows_distinct"] == 7
    assert t.cache is not None and t.cache.lru_order().tolist() == [2, 4, 3]
    t.reset_stats()
    assert t.stats()["cache_hits"] == 0 and t.stats()["bytes_fetched"] == 0


def test_more_distinct_rows_than_cache(fp8, mmap):
    t = make(fp8, mmap, "host", 5)
    rows = torch.arange(0, 60).view(6, 10)
    for _ in range(3):
        assert torch.equal(t.gather(rows), fp8.gather(rows))
        assert torch.equal(t.gather(rows[:2]), fp8.gather(rows[:2]))
    assert t.stats()["cache_resident"] == 5


@settings(max_examples=25, deadline=None)
@given(calls=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30), min_size=1, max_size=8))
def test_random_calls_never_change_results(fp8, calls):
    t = TieredTable(fp8, "host", cache_rows=6)
    distinct = 0
    for rows in calls:
        r = torch.tensor(rows)
        assert torch.equal(t.gather(r), fp8.gather(r))
        distinct += len(set(rows))
    s = t.stats()
    assert s["cache_hits"] + s["cache_misses"] == distinct == s["rows_distinct"]


def test_in_engram_module(fp8):
    config = EngramConfig.preset("tiny")
    n = Layout(config).layer(1).num_embeddings
    g = torch.Generator().manual_seed(2)
    table = FP8Table.from_float(torch.randn(n, config.head_dim, generator=g))
    plain = Engram(config, 1, table=table)
    tiered = Engram(config, 1, table=TieredTable(table, "host", cache_rows=100))
    tiered.load_state_dict({k: v for k, v in plain.state_dict().items() if not k.startswith("table.")})
    h = torch.randn(2, 6, config.hc_mult, config.hidden_size, generator=g)
    rows = torch.randint(0, n, (2, 6, config.rows_per_token), generator=g)
    for _ in range(2):
        assert torch.equal(tiered(h, rows), plain(h, rows))
    tiered.half().float()  # a parent's dtype change leaves the FP8 bytes alone (wkv is rounded)
    plain.half().float()
    assert torch.equal(tiered(h, rows), plain(h, rows))
    assert isinstance(tiered.table, TieredTable) and tiered.table.weight.dtype == torch.float8_e4m3fn


def test_module_to_keeps_host_table_on_host(fp8):
    t = TieredTable(fp8, "host", cache_rows=4)
    m = torch.nn.ModuleDict({"t": t}).to("cpu")
    assert m["t"] is t and t.weight.data_ptr() == fp8.weight.data_ptr()  # not copied
    assert list(t.state_dict()) == []  # inference wrapper: the table is not in the state_dict


def test_boundary_errors(fp8, mmap):
    t = TieredTable(fp8, "host")
    with pytest.raises(ValueError, match=r"row id 500 at position \(1,\)"):
        t.gather(torch.tensor([3, 500]))
    with pytest.raises(ValueError, match=r"row id -1"):
        t.gather(torch.tensor([[-1]]))
    with pytest.raises(TypeError, match=r"int64 or int32 row ids, got torch.float32"):
        t.gather(torch.zeros(3))
    with pytest.raises(TypeError, match=r"torch.Tensor of row ids, got list"):
        t.gather([1, 2])
    with pytest.raises(ValueError, match=r"placement='disk' is not a Placement.*'ssd'"):
        TieredTable(fp8, "disk")
    assert TieredTable(fp8, "HOST").placement is Placement.HOST
    with pytest.raises(ValueError, match=r"cache_rows=-1 must be an int >= 0"):
        TieredTable(fp8, "host", cache_rows=-1)
    with pytest.raises(TypeError, match=r"placement SSD .* pass an MmapFP8Table"):
        TieredTable(fp8, "ssd")
    with pytest.raises(TypeError, match=r"placement HOST .* MmapFP8Table: use placement SSD"):
        TieredTable(mmap, "host")
    with pytest.raises(ValueError, match=r"cache_rows=8 but placement DEVICE"):
        TieredTable(fp8, "device", cache_rows=8)
    with pytest.raises(TypeError, match=r"FP8Table.from_float"):
        TieredTable(torch.zeros(4, 32), "host")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_inflight=0 must be an int >= 1"):
        TieredTable(fp8, "host", max_inflight=0)
    with pytest.raises(ValueError, match=r"device='tpu' is not a device name|device='tpu'"):
        TieredTable(fp8, "host", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available"):
            TieredTable(fp8, "host", device="cuda")


def test_device_placement_from_mmap(fp8, mmap):
    t = TieredTable(mmap, "device")
    rows = torch.randint(0, ROWS, (4, 9))
    assert torch.equal(t.gather(rows), fp8.gather(rows))


# --------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize(("placement", "cache_rows"), [("device", 0), ("host", 0), ("host", 40), ("ssd", 40)])
def test_cuda_equals_fp8_gather(fp8, mmap, placement, cache_rows):
    t = make(fp8, mmap, placement, cache_rows, device="cuda")
    ref = FP8Table(fp8.weight.cuda(), fp8.scale.cuda())
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        rows = torch.randint(0, ROWS, (6, 16), generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            want = ref.gather(rows.cuda(), dtype)
            got = t.gather(rows if step % 2 else rows.cuda(), dtype)
            assert got.device.type == "cuda" and torch.equal(bits(got), bits(want))
            h = t.prefetch(rows)
            assert torch.equal(bits(t.gather(rows, dtype, prefetched=h)), bits(want))
    if placement != "device":  # the device-indexed cache stages row ids (and misses) through its own buffers
        staging = t._tier._row_staging if t._tier is not None else t._staging
        assert all(s.pinned for s in staging) and staging[0].buf.is_pinned()


@pytest.mark.gpu
def test_cuda_model_to_rehomes_cache(fp8):
    t = TieredTable(fp8, "host", cache_rows=16)
    rows = torch.randint(0, ROWS, (30,))
    t.gather(rows)
    torch.nn.ModuleDict({"t": t}).cuda()
    assert t.device.type == "cuda" and t.cache is not None and t.cache.values.device.type == "cuda"
    assert t.weight.device.type == "cpu"  # the host table stays on the host
    assert torch.equal(t.gather(rows).cpu(), fp8.gather(rows))


def test_tmp_files_are_cleaned(tmp_path: Path):
    # SSD placement from a file written here, read back exactly, and the file removable afterwards
    fp8 = FP8Table.from_float(torch.randn(40, 32))
    path = tmp_path / "s.safetensors"
    save_file({"w": fp8.weight, "s": fp8.scale}, str(path))
    t = TieredTable(MmapFP8Table(path, "w", "s"), "ssd", cache_rows=8)
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 40, (5, 7)))
    assert torch.equal(t.gather(rows), fp8.gather(rows))
    del t
    path.unlink()
    assert not path.exists()


_TRUNCATE = textwrap.dedent(
    """
    import os, sys, torch
    from safetensors.torch import save_file
    from engram.checkpoint.mmap_table import MmapFP8Table
    from engram.model.table import FP8Table
    from engram.systems import TieredTable

    path = sys.argv[1]
    fp8 = FP8Table.from_float(torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)))
    save_file({"w": fp8.weight, "s": fp8.scale}, path)
    mmap = MmapFP8Table(path, "w", "s")
    tables = {"ssd": TieredTable(mmap, "ssd"), "ssd+cache": TieredTable(mmap, "ssd", cache_rows=64)}
    for t in tables.values():
        t.gather(torch.tensor([1, 2]))  # pages of the intact file are mapped now
    os.truncate(path, 4096)  # the data ends inside row 0's values
    runs = {name: lambda t=t: t.gather(torch.arange(4000)) for name, t in tables.items()}
    t, rows = tables["ssd+cache"], torch.arange(100, 4000)
    runs["prefetch"] = lambda: t.gather(rows, prefetched=t.prefetch(rows))  # raised by the worker
    runs["mmap"] = lambda: mmap.gather(torch.arange(4000))
    runs["to_float"] = lambda: mmap.to_float()
    for name, run in runs.items():
        try:
            run()
            print(name, "no error")
        except ValueError as e:
            print(name, "ValueError:", e)
    """
)


def test_truncated_ssd_file_raises_instead_of_sigbus(tmp_path):
    """A table file truncated after it was opened: every read path (TieredTable SSD with and without
    a cache, a prefetch, MmapFP8Table.gather / to_float) raises a ValueError naming the file and the
    sizes instead of dying of SIGBUS (exit 135). In a subprocess, so a regression fails this test
    rather than killing pytest."""
    path = tmp_path / "t.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} (-7: killed by SIGBUS)\n{proc.stderr[-2000:]}"
    )
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["ssd", "ssd+cache", "prefetch", "mmap", "to_float"]
    for line in lines:
        assert f"ValueError: {path} was truncated after it was opened: 4096 bytes, expected" in line, line
        assert "Restore the file" in line, line


@pytest.mark.parametrize("policy", ["lru", "clock", "lfu", "pinned", "pinned+lru"])
@pytest.mark.parametrize("placement", ["host", "ssd"])
def test_every_policy_equals_fp8_gather(fp8, mmap, placement, policy):
    """A cache of any policy serves the backing table's bytes, synchronously and prefetched; the pinned
    policies admit their misses in their own order, so a call without hits must re-point too."""
    pinned = np.arange(0, ROWS, 97) if policy.startswith("pinned") else None
    t = make(fp8, mmap, placement, 40, policy=policy, pinned_rows=pinned)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        rows = torch.randint(0, ROWS, (4, 9), generator=g)
        if step == 3:
            rows[0, :3] = torch.from_numpy(pinned[:3]) if pinned is not None else rows[0, :3]
        want = fp8.gather(rows, torch.float32)
        handle = t.prefetch(rows, torch.float32) if step % 2 else None
        got = t.gather(rows, torch.float32, prefetched=handle)
        assert torch.equal(bits(got), bits(want)), (policy, placement, step)
    assert t.stats()["cache_hits"] + t.stats()["cache_misses"] == t.stats()["rows_distinct"]


def test_policy_without_cache_refused(fp8):
    with pytest.raises(ValueError, match="cache_rows=0 makes no cache"):
        TieredTable(fp8, "host", policy="lfu")


@pytest.mark.parametrize("policy", ["pinned", "pinned+lru"])
def test_pinned_first_call_without_hits(fp8, policy):
    """An empty cache, a call whose pinned rows sort after unpinned ones: no hits, and the plan lists
    the admitted (pinned) misses first; the rows must still come back in the caller's order."""
    t = TieredTable(fp8, "host", cache_rows=8, policy=policy, pinned_rows=np.array([97, 194]))
    rows = torch.tensor([[1, 2, 194, 3, 97, 2]])
    for _ in range(2):  # the second call hits the pinned rows
        assert torch.equal(bits(t.gather(rows)), bits(fp8.gather(rows)))


def test_dequantising_prefetch_from_cache_slots_in_another_dtype(fp8):
    """A CPU prefetch whose rows all sit in the cache dequantises them straight from the slots and keeps
    only that output: a gather asking another dtype fetches again, exact all the same."""
    t = TieredTable(fp8, "host", cache_rows=ROWS)
    rows = torch.randint(0, ROWS, (3, 7), generator=torch.Generator().manual_seed(3))
    t.gather(rows)  # every row cached
    handle = t.prefetch(rows, torch.float32)
    got = t.gather(rows, torch.bfloat16, prefetched=handle)
    assert torch.equal(bits(got), bits(fp8.gather(rows, torch.bfloat16)))
    handle = t.prefetch(rows, torch.float32)
    assert torch.equal(bits(t.gather(rows, prefetched=handle)), bits(fp8.gather(rows)))
