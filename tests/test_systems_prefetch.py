"""Tests for prefetch (engram.systems.background, TieredTable.prefetch) and engram.systems.prefetch:
prefetched gathers equal synchronous ones, the depth bound holds, and an offloaded model driven by a
Prefetcher gives outputs identical to the plain model."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from engram import EngramConfig, NgramHasher, TokenizerCompression
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.lm import EngramLM, LMConfig
from engram.model.module import Engram
from engram.model.table import FP8Table
from engram.systems import Placement, Prefetcher, TieredTable, offload_engram
from engram.systems.background import FetchWorker, PrefetchHandle

ROWS, DIM = 400, 32


@pytest.fixture(scope="module")
def fp8() -> FP8Table:
    return FP8Table.from_float(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ROWS, (4, 6, 3), generator=g) for _ in range(n)]


@pytest.mark.parametrize("cache_rows", [0, 20])
def test_prefetch_then_gather_equals_sync(fp8, cache_rows):
    t = TieredTable(fp8, "host", cache_rows=cache_rows)
    for rows in batches(4):
        h = t.prefetch(rows)
        assert torch.equal(t.gather(rows, prefetched=h), fp8.gather(rows))
        h2 = t.prefetch(rows.int())
        assert torch.equal(
            t.gather(rows, torch.bfloat16), fp8.gather(rows, torch.bfloat16)
        )  # matched by value
        assert h2.done()
    s = t.stats()
    assert s["prefetch_hits"] == 8 and s["prefetch_misses"] == 0 and s["wait_seconds"] >= 0


@pytest.mark.parametrize("placement", ["host", "device"])
def test_prefetch_with_dtype_dequantises_in_background(fp8, placement):
    t = TieredTable(fp8, placement, cache_rows=10 if placement == "host" else 0)
    for rows in batches(3, seed=4):
        h = t.prefetch(rows, torch.bfloat16)
        if placement == "host":
            assert h.wait(5).out is not None and h.wait(5).out.dtype == torch.bfloat16
        got = t.gather(rows, torch.bfloat16)
        assert torch.equal(got.view(torch.int16), fp8.gather(rows, torch.bfloat16).view(torch.int16))
        t.prefetch(rows, torch.bfloat16)
        assert torch.equal(t.gather(rows), fp8.gather(rows))  # another dtype: dequantised from the bytes
    assert t.stats()["prefetch_hits"] == 6  # DEVICE too: a gather matching a prefetch is a hit


def test_several_in_flight_in_order_and_out_of_order(fp8):
    t = TieredTable(fp8, "host", cache_rows=30, max_inflight=2)
    bs = batches(5, seed=1)
    handles = [t.prefetch(b) for b in bs]  # more than max_inflight: the later ones wait their turn
    for i in (3, 0, 4, 1, 2):  # out of order, matched by value
        assert torch.equal(t.gather(bs[i]), fp8.gather(bs[i]))
    assert t.stats()["prefetch_hits"] == 5 and all(h.done() for h in handles)
    handles = [t.prefetch(b) for b in bs[:3]]
    for i in (2, 1, 0):  # explicit handles, reverse order
        assert torch.equal(t.gather(bs[i], prefetched=handles[i]), fp8.gather(bs[i]))
    assert torch.equal(t.gather(bs[0]), fp8.gather(bs[0]))  # nothing pending: a synchronous fetch
    assert t.stats()["prefetch_hits"] == 8 and t.stats()["prefetch_misses"] == 1


def test_depth_bound_blocks_until_one_completes():
    gate = threading.Event()
    worker = FetchWorker(max_inflight=2)
    rows = torch.zeros(1, dtype=torch.int64)
    h1 = worker.submit(gate.wait, PrefetchHandle(rows, None))
    h2 = worker.submit(gate.wait, PrefetchHandle(rows, None))
    assert worker.inflight == 2
    third_started = threading.Event()
    third: list[PrefetchHandle] = []

    def submit_third() -> None:
        third.append(worker.submit(lambda: "third", PrefetchHandle(rows, None)))
        third_started.set()

    threading.Thread(target=submit_third, daemon=True).start()
    assert not third_started.wait(0.2)  # blocked: two jobs in flight
    assert not h1.done() and not h2.done()
    gate.set()
    assert third_started.wait(5)
    assert third[0].wait(5) == "third" and h1.wait(5) is True
    worker.close()


def test_table_depth_bound(fp8, monkeypatch):
    t = TieredTable(fp8, "host", max_inflight=1)
    gate = threading.Event()
    real = t._fetch
    monkeypatch.setattr(t, "_fetch", lambda host, **kw: (gate.wait(), real(host, **kw))[1])
    bs = batches(2, seed=2)
    t.prefetch(bs[0])
    done = threading.Event()
    threading.Thread(target=lambda: (t.prefetch(bs[1]), done.set()), daemon=True).start()
    assert not done.wait(0.2) and t._worker.inflight == 1
    gate.set()
    assert done.wait(5)
    for b in bs:
        assert torch.equal(t.gather(b), fp8.gather(b))
    assert t.stats()["prefetch_hits"] == 2


def test_prefetch_errors_surface_at_gather(fp8):
    t = TieredTable(fp8, "host")
    bad = torch.tensor([1, ROWS])
    h = t.prefetch(bad)
    with pytest.raises(ValueError, match=rf"row id {ROWS} at position \(1,\)"):
        t.gather(bad, prefetched=h)
    other = TieredTable(fp8, "host")
    rows = torch.tensor([1, 2])
    h = other.prefetch(rows)
    with pytest.raises(ValueError, match=r"handle returned by this table's prefetch"):
        t.gather(rows, prefetched=h)
    with pytest.raises(ValueError, match=r"made for other rows"):
        other.gather(torch.tensor([1, 3]), prefetched=h)
    with pytest.raises(TypeError, match=r"int64 or int32"):
        t.prefetch(torch.zeros(2))
    assert torch.equal(other.gather(rows, prefetched=h), fp8.gather(rows))


def test_device_placement_prefetch_is_a_noop(fp8):
    t = TieredTable(fp8, "device")
    rows = batches(1)[0]
    h = t.prefetch(rows)
    assert h.done()
    assert torch.equal(t.gather(rows, prefetched=h), fp8.gather(rows))
    assert t.stats()["prefetch_hits"] == 1


# ----------------------------------------------------------------------------- offload and Prefetcher

CFG = EngramConfig.preset("tiny").replace(vocab_size=100, compressed_vocab_size=50, pad_token_id=2, name="t")


@pytest.fixture(scope="module")
def hasher() -> NgramHasher:
    return NgramHasher(CFG, TokenizerCompression(lookup=np.arange(100) % 50, fingerprint="test"))


@pytest.fixture(scope="module")
def fp8_model() -> EngramLM:
    """A small LM whose Engram table is FP8 (the plain model the offloaded one must match)."""
    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=100, dim=64, n_layers=2, n_heads=2, mlp_hidden=64, max_seq_len=32, hc=2,
        engram=CFG, engram_zero_init=False,
    )  # fmt: skip
    model = EngramLM(cfg).eval()
    for m in model.engrams.values():
        m.table = FP8Table.from_float(m.table.weight.detach())
    return model


def token_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 100, (2, 12), generator=g) for _ in range(n)]


@pytest.mark.parametrize(
    ("placement", "cache_rows", "depth"), [("host", 0, 1), ("host", 64, 2), ("ssd", 32, 1), ("device", 0, 0)]
)
def test_offloaded_model_with_prefetcher_matches_plain(
    fp8_model, hasher, tmp_path, placement, cache_rows, depth
):
    model = copy.deepcopy(fp8_model)
    tables = offload_engram(model, placement, cache_rows=cache_rows, ssd_dir=tmp_path)
    assert list(tables) == [1] and isinstance(model.engrams["1"].table, TieredTable)
    if placement == "ssd":
        assert isinstance(tables[1].backing, MmapFP8Table)
    ids_list = token_batches(4)
    with torch.no_grad():
        for i, batch in enumerate(Prefetcher(ids_list, hasher, model, depth=depth)):
            assert batch.token_ids is ids_list[i] and batch.rows.shape == (2, 12, 1, CFG.rows_per_token)
            assert set(batch.handles) == {1}
            want = fp8_model(batch.token_ids, batch.rows)
            assert torch.equal(model(batch.token_ids, batch.rows), want)
    s = tables[1].stats()
    assert s["gathers"] == 4
    if placement != "device":
        assert s["prefetch_hits"] == 4 and s["prefetch_misses"] == 0


def test_prefetcher_numpy_batches_and_bare_engram(hasher):
    module = Engram(CFG, 1, table=FP8Table.from_float(torch.randn(40_000, CFG.head_dim)))
    plain = copy.deepcopy(module)
    offload_engram(module, Placement.HOST, cache_rows=128)
    ids = [np.random.default_rng(i).integers(0, 100, (3, 10)) for i in range(3)]
    h = torch.randn(3, 10, CFG.hc_mult, CFG.hidden_size)
    with torch.no_grad():
        for batch in Prefetcher(ids, hasher, module, depth=2):
            rows = batch.rows[:, :, 0]
            assert torch.equal(module(h, rows), plain(h, rows))
    assert module.table.stats()["prefetch_hits"] == 3


def test_offload_and_prefetcher_errors(hasher, fp8_model, tmp_path):
    torch.manual_seed(1)
    float_module = Engram(CFG, 1)
    with pytest.raises(TypeError, match=r"pass quantize=True"):
        offload_engram(float_module, "host")
    tables = offload_engram(float_module, "host", quantize=True)
    want = FP8Table.from_float(float_module.table.backing.to_float()).gather(torch.tensor([5, 6]))
    assert torch.equal(tables[1].gather(torch.tensor([5, 6])), want)
    with pytest.raises(ValueError, match=r"already a TieredTable"):
        offload_engram(float_module, "host")
    model = copy.deepcopy(fp8_model)
    with pytest.raises(ValueError, match=r"pass ssd_dir=<folder>"):
        offload_engram(model, "ssd")
    with pytest.raises(ValueError, match=r"placement='gpu' is not a Placement"):
        offload_engram(model, "gpu")
    with pytest.raises(ValueError, match=r"cache_rows=-3 must be an int >= 0"):
        offload_engram(model, "host", cache_rows=-3)
    with pytest.raises(ValueError, match=r"holds no engram.model.module.Engram"):
        offload_engram(torch.nn.Linear(2, 2), "host")
    with pytest.raises(TypeError, match=r"offload_engram\(model, placement"):
        Prefetcher([], hasher, model)
    assert isinstance(model.engrams["1"].table, FP8Table)  # a refused offload changed nothing
    offload_engram(model, "host")
    with pytest.raises(ValueError, match=r"depth=-1 must be an int >= 0"):
        Prefetcher([], hasher, model, depth=-1)
    with pytest.raises(ValueError, match=r"depth=8 keeps 9 prefetches"):
        Prefetcher([], hasher, model, depth=8)
    with pytest.raises(TypeError, match=r"NgramHasher"):
        Prefetcher([], object(), model)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- review regressions


def test_interrupted_prefetch_leaves_no_orphan_handle(fp8, monkeypatch):
    """A prefetch interrupted in submit (Ctrl-C while blocked on the depth bound) must not stay pending:
    a later gather of those rows would wait forever for a job that never runs."""
    t = TieredTable(fp8, "host", max_inflight=1)
    rows = torch.tensor([2, 3])

    def interrupted(fn, handle):
        raise KeyboardInterrupt

    monkeypatch.setattr(t._worker, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.prefetch(rows)
    monkeypatch.undo()
    assert len(t._pending) == 0
    got: list[torch.Tensor] = []
    th = threading.Thread(target=lambda: got.append(t.gather(rows)), daemon=True)
    th.start()
    th.join(5)
    assert got and torch.equal(got[0], fp8.gather(rows))
    t.synchronize()  # returns: nothing in flight


def test_worker_submit_is_exception_safe():
    """An interrupt between taking a slot and queueing the job gives the slot back and counts nothing."""

    w = FetchWorker(max_inflight=1)
    put, interrupt = w._jobs.put, [True]

    def put_interrupted(job):  # Ctrl-C just before the job is queued
        if interrupt[0]:
            raise KeyboardInterrupt
        put(job)

    w._jobs = type("Q", (), {"put": staticmethod(put_interrupted), "get": w._jobs.get})()
    with pytest.raises(KeyboardInterrupt):
        w.submit(lambda: 1, PrefetchHandle(torch.zeros(1), None))
    assert w.inflight == 0
    interrupt[0] = False
    h = w.submit(lambda: 7, PrefetchHandle(torch.zeros(1), None))  # would block forever on a leaked slot
    assert h.wait(5) == 7
    w.wait_idle()
    assert w.inflight == 0
    w.close()


def test_close_then_submit_never_runs_jobs_concurrently():
    w = FetchWorker(max_inflight=4)
    lock, running, overlap, starts = threading.Lock(), [0], [False], []

    def job(i: int, seconds: float):
        def run() -> int:
            with lock:
                running[0] += 1
                overlap[0] |= running[0] > 1
                starts.append((i, threading.get_ident()))
            threading.Event().wait(seconds)
            with lock:
                running[0] -= 1
            return i

        return run

    hs = [w.submit(job(0, 0.1), PrefetchHandle(torch.zeros(1), None)) for _ in range(2)]
    w.close()  # the queued jobs still run, then the thread stops
    hs.append(w.submit(job(2, 0.0), PrefetchHandle(torch.zeros(1), None)))  # a new thread
    assert [h.wait(5) for h in hs] == [0, 0, 2]
    assert not overlap[0] and [i for i, _ in starts] == [0, 0, 2]
    w.close()
    alive = [th for th in threading.enumerate() if th.name == w.name]
    assert not alive


def test_synchronize_waits_for_jobs_in_flight(fp8, monkeypatch):
    t = TieredTable(fp8, "host", max_inflight=2)
    gate = threading.Event()
    real = t._fetch
    monkeypatch.setattr(t, "_fetch", lambda host, **kw: (gate.wait(), real(host, **kw))[1])
    hs = [t.prefetch(b) for b in batches(2, seed=6)]
    synced = threading.Event()
    threading.Thread(target=lambda: (t.synchronize(), synced.set()), daemon=True).start()
    assert not synced.wait(0.1)
    gate.set()
    assert synced.wait(5) and all(h.done() for h in hs)


def test_handle_for_other_rows_names_the_position(fp8):
    for placement in ("host", "device"):
        t = TieredTable(fp8, placement)
        h = t.prefetch(torch.tensor([1, 2, 3]))
        with pytest.raises(ValueError, match=r"made for other rows than these: row 9 at position \(1,\)"):
            t.gather(torch.tensor([1, 9, 3]), prefetched=h)
        with pytest.raises(ValueError, match=r"made for other rows \(shape \(3,\)\)"):
            t.gather(torch.tensor([1, 2]), prefetched=h)


def test_device_placement_matches_prefetches_like_the_other_tiers(fp8):
    t = TieredTable(fp8, "device")
    rows = batches(1, seed=7)[0]
    t.prefetch(rows)
    assert torch.equal(t.gather(rows.int()), fp8.gather(rows))  # implicit match: a hit
    assert torch.equal(t.gather(rows), fp8.gather(rows))  # nothing pending: a miss
    assert (t.stats()["prefetch_hits"], t.stats()["prefetch_misses"]) == (1, 1)
    bad = torch.tensor([1, ROWS])
    h = t.prefetch(bad)  # does not raise here ...
    with pytest.raises(ValueError, match=rf"row id {ROWS} at position \(1,\)"):
        h.wait()  # ... but when waited for
    with pytest.raises(ValueError, match=rf"row id {ROWS} at position \(1,\)"):
        t.gather(bad)  # and at the gather it serves


def test_reused_handle_never_returns_the_same_tensor(fp8):
    t = TieredTable(fp8, "host")
    rows = torch.tensor([1, 2, 3])
    h = t.prefetch(rows, torch.float32)
    first = t.gather(rows, prefetched=h)
    first.zero_()  # the caller owns its result
    second = t.gather(rows, prefetched=h)
    assert second is not first and torch.equal(second, fp8.gather(rows))


def test_matching_compares_int32_and_int64_without_wrapping(fp8):
    t = TieredTable(fp8, "host")
    h = t.prefetch(torch.tensor([2**32 + 5]))  # a bad id that wraps to 5 in int32
    assert not h.matches(torch.tensor([5], dtype=torch.int32))
    assert torch.equal(t.gather(torch.tensor([5], dtype=torch.int32)), fp8.gather(torch.tensor([5])))
    assert t.stats()["prefetch_misses"] == 1


def test_handle_from_before_a_move_is_refetched(fp8):
    t = TieredTable(fp8, "host", cache_rows=8)
    rows = torch.tensor([4, 5, 4])
    h = t.prefetch(rows)
    h.wait(5)
    h.device = torch.device("meta")  # as if fetched for another device before model.to(...)
    assert torch.equal(t.gather(rows, prefetched=h), fp8.gather(rows))
    assert t.stats()["prefetch_misses"] == 1


def test_fetch_threads_rejects_bools(fp8):
    with pytest.raises(ValueError, match=r"fetch_threads=True must be None or an int >= 1"):
        TieredTable(fp8, "host", fetch_threads=True)


def test_dead_masks_shorter_than_batches(hasher):
    module = Engram(CFG, 1, table=FP8Table.from_float(torch.randn(40_000, CFG.head_dim)))
    offload_engram(module, "host")
    ids = token_batches(3)
    masks = [torch.zeros(2, 12, dtype=torch.bool)]
    with pytest.raises(ValueError, match=r"dead_masks ran out at batch 1.*one \(B, T\) bool mask per batch"):
        for _ in Prefetcher(ids, hasher, module, depth=1, dead_masks=masks):
            pass


@pytest.mark.parametrize(("placement", "cache_rows"), [("host", 16), ("device", 0)])
def test_deepcopy_of_offloaded_model(fp8_model, hasher, placement, cache_rows):
    model = copy.deepcopy(fp8_model)
    tables = offload_engram(model, placement, cache_rows=cache_rows)
    ids = token_batches(2)
    tables[1].prefetch(torch.tensor([1, 2]))  # pending and in flight: not carried over
    twin = copy.deepcopy(model)
    table, copied = tables[1], twin.engrams["1"].table
    assert isinstance(copied, TieredTable) and copied is not table
    assert copied.backing is table.backing and copied.weight.data_ptr() == table.weight.data_ptr()  # shared
    assert copied._worker is not table._worker and len(copied._pending) == 0
    assert copied.stats() == table.stats()
    if cache_rows:
        assert copied.cache is not table.cache
    with torch.no_grad():
        for batch in Prefetcher(ids, hasher, twin, depth=1):
            want = fp8_model(batch.token_ids, batch.rows)
            assert torch.equal(twin(batch.token_ids, batch.rows), want)
            assert torch.equal(model(batch.token_ids, batch.rows), want)
    assert copied.stats()["prefetch_hits"] == 2


@pytest.mark.gpu
def test_cuda_handle_from_before_model_to(fp8):
    t = TieredTable(fp8, "host", cache_rows=16)
    rows = torch.randint(0, ROWS, (40,))
    t.gather(rows)  # the cache holds some rows, moved by .cuda() below
    h = t.prefetch(rows)
    torch.nn.ModuleDict({"t": t}).cuda()
    got = t.gather(rows, prefetched=h)  # fetched for the CPU: refetched on the GPU
    assert got.device.type == "cuda" and torch.equal(got.cpu(), fp8.gather(rows))
    assert torch.equal(t.gather(rows).cpu(), fp8.gather(rows))  # cache hits from the moved bytes
