"""Three levels (engram.systems.levels.LevelTable): bit-exact with FP8Table.gather, counters, verify, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.checkpoint.files import save_tensors
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.table import FP8Table
from engram.storage.rowfile import RowFile, RowFileHeader, write_row_file
from engram.systems.levels import LevelTable


def _table(rows: int = 300, dim: int = 64, seed: int = 0) -> FP8Table:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    return FP8Table.from_float(w)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.fixture(params=["rowfile", "mmap", "fp8"])
def backing(request, tmp_path):
    t = _table()
    if request.param == "rowfile":
        return t, RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale))
    if request.param == "mmap":
        save_tensors(tmp_path / "t.safetensors", {"w": t.weight, "s": t.scale})
        return t, MmapFP8Table(tmp_path / "t.safetensors", "w", "s")
    return t, t


@pytest.mark.parametrize("budgets", [(1, 1), (7, 20), (40, 120), (300, 300), (64, 8), (7, 0), (64, 0)])
def test_bit_exact_random_and_repeated(backing, budgets) -> None:
    t, b = backing
    lt = LevelTable(b, device_rows=budgets[0], host_rows=budgets[1])
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        if step % 3 == 0:
            rows = torch.randint(0, 300, (5, 16), generator=g)  # random
        elif step % 3 == 1:
            rows = torch.randint(0, 12, (50,), generator=g)  # repeated hot rows
        else:
            rows = torch.randint(0, 300, (3, 7), generator=g).int()
        dtype = (torch.float32, torch.bfloat16)[step % 2]
        got = lt.gather(rows, dtype)
        assert got.shape == (*rows.shape, 64)
        assert torch.equal(_bits(got), _bits(t.gather(rows.long(), dtype)))
    s = lt.stats()
    assert s["device"]["hits"] + s["device"]["misses"] == s["rows_distinct"]
    if budgets[1]:
        assert s["host"]["hits"] + s["host"]["misses"] == s["device"]["misses"]
        assert s["backing"]["hits"] == s["host"]["misses"]
    else:  # no host level: level 1's misses read from the backing store
        assert s["host"]["hits"] == s["host"]["misses"] == 0
        assert s["backing"]["hits"] == s["device"]["misses"]
    assert s["backing"]["bytes_in"] == s["backing"]["hits"] * 66  # 64 values + 2 scales


def test_all_rows_and_float64(backing) -> None:
    t, b = backing
    lt = LevelTable(b, device_rows=50, host_rows=100)
    every = torch.arange(300)
    assert torch.equal(lt.gather(every), t.gather(every))  # budget below the call's distinct rows
    assert torch.equal(lt.gather(every.flip(0), torch.float64), t.gather(every.flip(0), torch.float64))


def test_levels_fill_in_order(tmp_path) -> None:
    t = _table()
    lt = LevelTable(
        RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale)), device_rows=4, host_rows=16
    )
    lt.gather(torch.arange(10))  # distinct 10 > 4: 4 admitted to level 1, all 10 to level 2
    s = lt.stats()
    assert (s["device"]["misses"], s["host"]["misses"], s["backing"]["hits"]) == (10, 10, 10)
    assert s["backing"]["pages_read"] == 1  # rows 0..9 share the first page
    lt.reset_stats()
    lt.gather(torch.arange(10))  # 6 not in level 1 are found in level 2: nothing read from the file
    s = lt.stats()
    assert s["device"]["hits"] == 4 and s["host"]["hits"] == 6 and s["backing"]["hits"] == 0
    assert s["backing"]["reads"] == 0
    lt.reset_stats()
    lt.gather(torch.tensor([6, 7, 8, 9]))  # the last four admitted are the most recent in level 1
    s = lt.stats()
    assert s["device"]["hits"] + s["host"]["hits"] == 4 and s["backing"]["hits"] == 0


def test_verify_counts_corrupted_cache_and_file(tmp_path) -> None:
    t = _table()
    path = write_row_file(tmp_path / "t.rows", t.weight, t.scale)
    lt = LevelTable(RowFile(path), device_rows=8, host_rows=32, verify=True)
    rows = torch.tensor([3, 4, 5, 3])
    lt.gather(rows)
    assert lt.stats()["verify_mismatches"] == 0 and lt.stats()["verify_rows"] == 3
    slot = int(lt.l1.slot_of(np.array([4]))[0])
    lt.l1.values.view(torch.uint8)[slot, 0] ^= 0x01  # a flipped bit in a cached row
    lt.gather(rows)
    assert lt.stats()["verify_mismatches"] == 1
    # the file changes under the cache: row 5's cached bytes no longer match the file
    off = int(RowFileHeader(300, 64).offset_of(np.array([5]))[0])
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(bytes([(t.weight[5, 0].view(torch.uint8).item() ^ 0x02)]))
    lt.gather(torch.tensor([5]))
    assert lt.stats()["verify_mismatches"] == 2
    off_by_default = LevelTable(RowFile(path), device_rows=8, host_rows=32)
    off_by_default.gather(rows)
    assert off_by_default.stats()["verify_rows"] == 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"device_rows": 0, "host_rows": 10}, r"device_rows=0 rows.*budget >= 1.*TieredTable"),
        ({"device_rows": 10, "host_rows": -1}, r"host_rows=-1"),
        ({"device_rows": 10, "host_rows": 0, "host_policy": "lru"}, r"host_rows=0 leaves out the host level"),
        (
            {"device_rows": 301, "host_rows": 10},
            r"device_rows=301 rows is larger than the table \(300 rows\)",
        ),
        ({"device_rows": 10, "host_rows": 10**6}, r"host_rows=1000000.*at most 300"),
    ],
)
def test_bad_budgets(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        LevelTable(_table(), **kw)


def test_bad_input() -> None:
    lt = LevelTable(_table(), device_rows=4, host_rows=8)
    assert lt.gather(torch.empty(2, 0, dtype=torch.int32)).shape == (2, 0, 64)  # no rows: an empty result
    with pytest.raises(ValueError, match="row id 300"):
        lt.gather(torch.tensor([1, 300]))
    with pytest.raises(TypeError, match="int64 or int32"):
        lt.gather(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="RowFile"):
        LevelTable(torch.zeros(3), device_rows=1, host_rows=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device_rows"):
        LevelTable(_table(), device_rows=1.5, host_rows=1)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("budgets", [(4, 16), (64, 128)])
def test_cuda_level_one_on_the_device(tmp_path, budgets) -> None:
    t = _table()
    ref = FP8Table(t.weight.cuda(), t.scale.cuda())
    lt = LevelTable(
        RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale)),
        device_rows=budgets[0],
        host_rows=budgets[1],
        device="cuda",
        verify=True,
    )
    assert lt.l1.values.device.type == "cuda" and lt.l2.values.device.type == "cpu"
    g = torch.Generator().manual_seed(5)
    for step in range(6):
        rows = torch.randint(0, 300 if step % 2 else 20, (4, 12), generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            got = lt.gather(rows.cuda() if step % 3 else rows, dtype)
            assert got.device.type == "cuda"
            assert torch.equal(_bits(got), _bits(ref.gather(rows.cuda(), dtype)))
    assert lt.stats()["verify_mismatches"] == 0 and lt.stats()["device"]["hits"] > 0


def test_deepcopy_has_its_own_caches(backing) -> None:
    import copy

    t, b = backing
    lt = LevelTable(b, device_rows=8, host_rows=32)
    rows = torch.tensor([1, 2, 3])
    lt.gather(rows)
    twin = copy.deepcopy(lt)
    assert (twin.backing is b) == (not isinstance(b, RowFile))
    assert twin.l1 is not lt.l1 and twin.stats()["device"]["misses"] == 3
    assert torch.equal(twin.gather(rows), t.gather(rows)) and twin.stats()["device"]["hits"] == 3
    assert lt.stats()["device"]["hits"] == 0


def test_level_one_misses_in_any_order() -> None:
    """A pinned policy may list level 1's misses admitted-first (not ascending): level 2 still plans them
    sorted and every row lands where it belongs."""
    from engram.systems.cache import CachePlan

    t = _table()
    lt = LevelTable(t, device_rows=4, host_rows=64)
    real = lt.l1.plan

    def shuffled(uniq: np.ndarray) -> CachePlan:
        p = real(uniq)
        none = np.empty(0, dtype=np.int64)
        return CachePlan(p.hit_idx, p.hit_slots, p.miss_idx[::-1].copy(), none)  # admit nothing, descending

    lt.l1.plan = shuffled  # type: ignore[method-assign]
    rows = torch.tensor([[250, 3, 77], [3, 120, 9]])
    assert torch.equal(lt.gather(rows), t.gather(rows))
    assert lt.stats()["host"]["misses"] == 5
