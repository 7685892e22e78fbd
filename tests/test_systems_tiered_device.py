"""TieredTable with its hot-row cache indexed on the device (CacheIndex.DEVICE) and placement HOST_UVA.

On a CPU the device-indexed path runs as it does on CUDA (the same plan in torch ops; fills copied from
the host table): results equal FP8Table.gather bit for bit at 0 / 50 / 100 % hits, prefetched or not;
a prefetch's rows survive later fetches (protection), and a prefetch whose scratch region was reused,
or that was dropped from the pending ones, is fetched again, never served. HOST_UVA is refused on a CPU
and for pageable tables, naming the fix. `gpu` tests: the UVA view, the UVA gather against the device
gather and FP8Table.gather, the cache on CUDA (staged and UVA fills), no host sync in a UVA fetch, and
a prefetched loop that overlaps a GPU matmul."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from safetensors.torch import save_file

from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.table import FP8Table
from engram.systems import CacheIndex, Placement, TieredTable
from engram.systems.placement import as_placement
from engram.systems.uva import check_uva_table, uva_view

ROWS, DIM = 500, 64


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.fixture(scope="module")
def fp8() -> FP8Table:
    g = torch.Generator().manual_seed(0)
    spread = torch.exp(torch.randn(ROWS, 1, generator=g) * 2)
    return FP8Table.from_float(torch.randn(ROWS, DIM, generator=g) * spread)


@pytest.fixture(scope="module")
def mmap(fp8: FP8Table, tmp_path_factory) -> MmapFP8Table:
    path = tmp_path_factory.mktemp("ssd") / "t.safetensors"
    save_file({"t.weight": fp8.weight, "t.scale": fp8.scale}, str(path))
    return MmapFP8Table(path, "t.weight", "t.scale")


def dev_table(fp8, mmap=None, cache_rows=40, **kw) -> TieredTable:
    placement = "ssd" if mmap is not None else "host"
    return TieredTable(
        mmap if mmap is not None else fp8, placement, cache_rows=cache_rows, cache_index="device", **kw
    )


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(bits(got), bits(want))


# --------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("cache_rows", [7, 64, 10_000])
@pytest.mark.parametrize("placement", ["host", "ssd"])
def test_device_index_equals_fp8_gather(fp8, mmap, placement, cache_rows):
    t = dev_table(fp8, mmap if placement == "ssd" else None, cache_rows, cache_ways=4)
    assert t.cache is None and t.device_cache is not None and t.cache_index is CacheIndex.DEVICE
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        rows = torch.randint(0, ROWS, (3, 5, 8), generator=g)
        rows[0, 0] = rows[1, 1]
        for dtype in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            got = t.gather(rows.int() if step % 2 else rows, dtype)
            assert same(got, fp8.gather(rows, dtype)), (cache_rows, dtype)
    for rows in (torch.zeros(0, dtype=torch.int64), torch.tensor(7), torch.zeros(2, 0, dtype=torch.int64)):
        assert same(t.gather(rows), fp8.gather(rows))
    s = t.stats()
    assert s["cache_hits"] + s["cache_misses"] == s["rows_distinct"] and s["gathers"] == 23
    assert s["cache_policy"] == "set-lru (device index)"


def test_hit_rates_0_50_100_exact(fp8):
    t = dev_table(fp8, cache_rows=256, cache_ways=16)
    hot = torch.arange(0, 100)
    cold = torch.arange(200, 300)
    for label, rows, rate in (
        ("0%", hot, 0.0),
        ("100%", hot, 1.0),
        ("50%", torch.cat([hot[:50], cold[:50]]), 0.5),
        ("100% again", torch.cat([hot[:50], cold[:50]]), 1.0),
    ):
        t.reset_stats()
        batch = rows[torch.randperm(rows.numel())].view(4, 25)
        assert same(t.gather(batch, torch.bfloat16), fp8.gather(batch, torch.bfloat16)), label
        s = t.stats()
        assert s["cache_hit_rate"] == rate, label
        assert s["cache_host_syncs"] == 1  # a CPU fills from the host table: only the plan's miss count


def test_prefetch_exact_and_counted(fp8):
    t = dev_table(fp8, cache_rows=32, cache_ways=4)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, ROWS, (6, 20), generator=g) for _ in range(5)]
    handles = [t.prefetch(batches[0]), t.prefetch(batches[1])]
    for i, b in enumerate(batches):
        if i + 2 < len(batches):
            handles.append(t.prefetch(b if i % 2 else batches[i + 2], torch.bfloat16 if i == 1 else None))
        want_dtype = torch.bfloat16 if i == 3 else None
        assert same(t.gather(b, want_dtype), fp8.gather(b, want_dtype)), i
    h = t.prefetch(batches[0], torch.float32)
    assert same(t.gather(batches[0], torch.float32, prefetched=h), fp8.gather(batches[0]))
    h = t.prefetch(batches[1], torch.float32)
    assert same(t.gather(batches[1], torch.bfloat16, prefetched=h), fp8.gather(batches[1], torch.bfloat16))
    with pytest.raises(ValueError, match="made for other rows"):
        t.gather(batches[2], prefetched=t.prefetch(batches[3]))
    s = t.stats()
    assert s["prefetch_hits"] >= 5 and s["cache_stale_prefetches"] >= 1  # the bf16 block asked in fp32


def test_prefetched_rows_survive_later_fetches(fp8):
    # a tiny cache: every later fetch wants to evict the prefetched rows; protection keeps them
    t = dev_table(fp8, cache_rows=8, cache_ways=2)
    mine = torch.arange(0, 60).view(3, 20)
    h = t.prefetch(mine)
    h.wait()
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        other = torch.randint(100, ROWS, (50,), generator=g)
        assert same(t.gather(other), fp8.gather(other))
    assert same(t.gather(mine, prefetched=h), fp8.gather(mine))
    s = t.stats()
    assert s["prefetch_hits"] == 1 and s["cache_stale_prefetches"] == 0 and s["cache_spilled"] > 0


def test_reused_region_is_detected_and_refetched(fp8):
    # 3 regions: 1 for direct gathers, 2 for prefetches; a third prefetch ahead reuses the first's
    t = dev_table(fp8, cache_rows=4, cache_ways=2)
    batches = [torch.arange(50 * k, 50 * k + 40).view(2, 20) for k in range(3)]
    handles = [t.prefetch(b) for b in batches]
    t.synchronize()  # all three fetched before any is consumed
    for b, h in zip(batches, handles, strict=True):
        assert same(t.gather(b, prefetched=h), fp8.gather(b))
    s = t.stats()
    assert s["cache_stale_prefetches"] == 1 and s["prefetch_hits"] == 3  # the first one, fetched again


def test_guards_are_load_bearing(fp8, monkeypatch):
    """Without the generation check, or without protection, the two scenarios above serve wrong rows:
    those tests would catch a guard that stopped working."""
    from engram.systems import device_cache

    def served(t: TieredTable, batches: list[torch.Tensor], handles: list) -> list[bool]:
        return [same(t.gather(b, prefetched=h), fp8.gather(b)) for b, h in zip(batches, handles, strict=True)]

    with monkeypatch.context() as m:  # the region reused by a third prefetch ahead, served anyway
        m.setattr(device_cache.DeviceRowCache, "valid", lambda self, plan: True)
        t = dev_table(fp8, cache_rows=4, cache_ways=2)
        batches = [torch.arange(50 * k, 50 * k + 40).view(2, 20) for k in range(3)]
        handles = [t.prefetch(b) for b in batches]
        t.synchronize()
        assert served(t, batches, handles) == [False, True, True]
    plan = device_cache.DeviceRowCache.plan
    with monkeypatch.context() as m:  # later fetches free to evict a pending prefetch's rows
        m.setattr(
            device_cache.DeviceRowCache,
            "plan",
            lambda self, rows, region=0, protect_from=None: plan(self, rows, region=region),
        )
        t = dev_table(fp8, cache_rows=8, cache_ways=2)
        mine = torch.arange(0, 60).view(3, 20)
        h = t.prefetch(mine)
        h.wait()
        for k in range(6):
            t.gather(torch.arange(100 + 50 * k, 150 + 50 * k))
        assert served(t, [mine], [h]) == [False]


def test_dropped_prefetch_is_refetched(fp8):
    t = dev_table(fp8, cache_rows=4, cache_ways=2, max_pending=2)
    batches = [torch.arange(60 * k, 60 * k + 30) for k in range(3)]
    handles = [t.prefetch(b) for b in batches]  # the first drops out of the pending ones
    assert handles[0].forgotten and not handles[1].forgotten
    for b, h in zip(batches, handles, strict=True):
        assert same(t.gather(b, prefetched=h), fp8.gather(b))
    s = t.stats()
    assert s["prefetch_misses"] == 1 and s["prefetch_hits"] == 2


def test_bad_rows_verify_and_copies(fp8):
    t = dev_table(fp8, cache_rows=16, verify=True)
    with pytest.raises(ValueError, match="row id"):
        t.gather(torch.tensor([1, ROWS]))
    h = t.prefetch(torch.tensor([[3, -1]]))
    with pytest.raises(ValueError, match="row id"):
        t.gather(torch.tensor([[3, -1]]), prefetched=h)
    rows = torch.randint(0, ROWS, (40,))
    assert same(t.gather(rows), fp8.gather(rows))
    s = t.stats()
    assert s["verify_rows"] == 40 and s["verify_mismatches"] == 0
    c = copy.deepcopy(t)
    assert c.device_cache is not t.device_cache and c.backing is t.backing
    before = t.stats()["cache_hits"]
    assert same(c.gather(rows, torch.bfloat16), fp8.gather(rows, torch.bfloat16))
    assert c.stats()["cache_hits"] > before == t.stats()["cache_hits"]  # its own cache and counters


def test_cache_index_choice_and_refusals(fp8):
    assert TieredTable(fp8, "host", cache_rows=8).cache_index is CacheIndex.HOST  # CPU default: exact LRU
    assert TieredTable(fp8, "host", cache_rows=8, policy="lfu").cache is not None
    with pytest.raises(ValueError, match="cache_index='host'"):
        TieredTable(fp8, "host", cache_rows=8, cache_index="device", policy="lru")
    with pytest.raises(ValueError, match="cache_rows=0"):
        TieredTable(fp8, "host", cache_index="device")
    with pytest.raises(ValueError, match="'host' or 'device'"):
        TieredTable(fp8, "host", cache_rows=8, cache_index="gpu")
    with pytest.raises(ValueError, match="cache_ways"):
        TieredTable(fp8, "host", cache_rows=8, cache_index="device", cache_ways=0)


def test_host_uva_refusals(fp8, mmap, monkeypatch):
    assert as_placement("host-uva") is Placement.HOST_UVA
    with pytest.raises(ValueError, match="HOST_UVA"):
        as_placement("uva")
    with pytest.raises(ValueError, match=r"compute device is cpu.*use placement HOST"):
        TieredTable(fp8, Placement.HOST_UVA)  # a CPU has no UVA: refused, with the reason
    with pytest.raises(TypeError, match="MmapFP8Table"):
        TieredTable(mmap, Placement.HOST_UVA)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"pinned .* pageable.*pin_memory\(\)"):
        check_uva_table(fp8.weight, fp8.scale, cuda)
    with pytest.raises(ValueError, match="contiguous"):
        check_uva_table(fp8.weight.t(), fp8.scale, cuda)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # as if pinned: the checks pass
    check_uva_table(fp8.weight, fp8.scale, cuda)
    with pytest.raises(ValueError, match="compute device is cpu"):
        uva_view(fp8.weight, torch.device("cpu"))


# --------------------------------------------------------------------------------------------- CUDA


@pytest.fixture
def pinned(fp8) -> FP8Table:
    return FP8Table(fp8.weight.pin_memory(), fp8.scale.pin_memory())


@pytest.mark.gpu
def test_uva_view_aliases_pinned_memory():
    host = torch.arange(1000, dtype=torch.int32).pin_memory()
    view = uva_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view.is_cuda and view.data_ptr() == host.data_ptr() and view.shape == host.shape
    assert torch.equal(view.cpu(), host)
    host[7] = -5  # the device reads the host bytes, not a copy
    assert int(view[7]) == -5
    with pytest.raises(ValueError, match="pageable"):
        uva_view(torch.zeros(4), torch.device("cuda"))


@pytest.mark.gpu
def test_uva_gather_equals_device_gather_and_fp8_gather(pinned, fp8):
    from engram import kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    uv, us = uva_view(pinned.weight, dev), uva_view(pinned.scale, dev)
    rows = torch.randint(0, ROWS, (7, 33), device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        over_uva = kernels.fp8_gather(uv, us, rows, dtype)
        on_device = kernels.fp8_gather(fp8.weight.to(dev), fp8.scale.to(dev), rows, dtype)
        assert same(over_uva, on_device) and same(over_uva.cpu(), fp8.gather(rows.cpu(), dtype))
        assert same(over_uva, kernels.fp8_gather(uv, us, rows.int(), dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["host-uva", "host"])
@pytest.mark.parametrize("cache_rows", [0, 256])
def test_cuda_tiers_equal_fp8_gather_at_0_50_100_percent_hits(pinned, fp8, placement, cache_rows):
    t = TieredTable(pinned, placement, device="cuda", cache_rows=cache_rows)
    if cache_rows:
        assert t.device_cache is not None  # the CUDA default: the device index
    hot, cold = torch.arange(0, 60), torch.arange(300, 360)
    for rows, rate in ((hot, 0.0), (hot, 1.0), (torch.cat([hot[:30], cold[:30]]), 0.5)):
        t.reset_stats()
        batch = rows[torch.randperm(rows.numel())].view(3, 20)
        for dtype in (torch.float32, torch.bfloat16):
            want = fp8.gather(batch, dtype)
            assert same(t.gather(batch, dtype).cpu(), want)
            assert same(t.gather(batch.cuda(), dtype).cpu(), want)
            h = t.prefetch(batch)
            assert same(t.gather(batch, dtype, prefetched=h).cpu(), want)
        if cache_rows:
            s = t.stats()
            first = s["cache_hits"] / max(1, s["cache_hits"] + s["cache_misses"])
            assert first >= rate  # the first gather of the batch at `rate`, the repeats all hits
            per_plan = 6 if rate == 1.0 or placement == "host-uva" else 7  # + the staged miss list back
            assert s["cache_host_syncs"] == per_plan


@pytest.mark.gpu
def test_cuda_uva_fetch_syncs_once(pinned, fp8):
    """A UVA fetch + gather syncs the host once (the miss count); at 100 % hits that is all it does."""
    import warnings

    from engram.systems.device_tier import DeviceTier

    t = TieredTable(pinned, "host-uva", device="cuda", cache_rows=64)
    tier = t._tier
    assert isinstance(tier, DeviceTier)
    rows = torch.randint(0, ROWS, (4, 50), device="cuda")
    t.gather(rows)  # warm: scratch sized, kernels compiled
    for fresh in (False, True):
        if fresh:
            t.device_cache.clear()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught, t._lock:
                warnings.simplefilter("always")
                out = tier.consume(tier.fetch(rows, ahead=False), torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
        assert same(out.cpu(), fp8.gather(rows.cpu(), torch.bfloat16))


@pytest.mark.gpu
def test_cuda_cache_refused_beyond_free_memory(fp8, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    with pytest.raises(ValueError, match=r"only 0\.00 GiB of its 80\.00 GiB are free; use fewer cache_rows"):
        TieredTable(fp8, "host", device="cuda", cache_rows=100_000)
    with pytest.raises(ValueError, match="free"):
        TieredTable(fp8, "host", device="cuda", cache_rows=100_000, policy="lru")


@pytest.mark.gpu
def test_cuda_prefetch_overlaps_compute():
    from engram.benchmarks.bench_lookup import make_ids, make_table

    rows = 1 << 21
    table = make_table(rows, 256, 0)
    t = TieredTable(table, "host", device="cuda", cache_rows=rows // 20)
    batches = [make_ids(rows, 4096, 24, 1.2, s) for s in range(6)]
    for b in batches:  # warm
        t.gather(b, torch.bfloat16)
    torch.cuda.synchronize()

    def fetch_alone() -> float:
        t0 = time.perf_counter()
        for b in batches:
            t.gather(b, torch.bfloat16)
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / len(batches)

    f = min(fetch_alone() for _ in range(3))
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    reps = max(1, round(f / ((time.perf_counter() - t0) / 10)))

    outs: list[torch.Tensor] = []

    def loop(ahead: bool) -> float:
        outs.clear()
        t0 = time.perf_counter()
        if ahead:
            t.prefetch(batches[0])
        for i, b in enumerate(batches):
            if ahead and i + 1 < len(batches):
                t.prefetch(batches[i + 1])
            for _ in range(reps):
                a @ a
            outs.append(t.gather(b, torch.bfloat16))
            torch.cuda.current_stream().synchronize()  # the step reads its result; the prefetch runs on
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    sync = min(loop(False) for _ in range(3))
    ahead = min(loop(True) for _ in range(3))
    assert ahead < 0.85 * sync, (ahead, sync, f)
    for b, out in zip(batches, outs, strict=True):
        assert same(out.cpu(), table.gather(b, torch.bfloat16))
