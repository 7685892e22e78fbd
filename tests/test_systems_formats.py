"""The tiers with the integer row formats: `RowCache`, `TieredTable` (device / host / SSD, cache, prefetch)
and `LevelTable` (a row file, a mapped or an in-memory backing) serve exactly what `QuantTable.gather`
gives for INT8 (per 32 / per row) and 4-bit tables, count each format's bytes a row, and
`offload_engram(quantize=True, row_format=...)` quantises to the format asked for."""

from __future__ import annotations

import pytest
import torch

from engram.checkpoint.files import save_tensors
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import QuantTable
from engram.rowformat.formats import RowFormat
from engram.storage.rowfile import RowFile, write_row_file
from engram.systems import LevelTable, TieredTable, offload_engram
from engram.systems.cache import RowCache

INT_FORMATS = [RowFormat.INT8_BLOCK32, RowFormat.INT8_ROW, RowFormat.INT4_BLOCK32]
DIM = 64


def table(fmt: RowFormat, rows: int = 300, seed: int = 0) -> QuantTable:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, DIM, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    return QuantTable.from_float(w, fmt)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def batches(n: int = 9, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(n):
        if step % 3 == 0:
            out.append(torch.randint(0, 300, (5, 16), generator=g))
        elif step % 3 == 1:
            out.append(torch.randint(0, 12, (50,), generator=g))  # repeated hot rows
        else:
            out.append(torch.randint(0, 300, (3, 7), generator=g).int())
    return out


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_row_cache_holds_the_formats_bytes(fmt: RowFormat) -> None:
    t = table(fmt)
    c = RowCache(8, DIM, fmt=fmt)
    assert (c.value_bytes, c.scale_bytes, c.row_bytes) == (
        fmt.value_bytes(DIM),
        fmt.scale_bytes(DIM),
        fmt.row_bytes(DIM),
    )
    rows = torch.tensor([4, 9, 250])
    v = t.weight[rows].contiguous().view(torch.uint8)
    s = t.scale[rows].contiguous().view(torch.uint8)
    slots = torch.tensor([7, 0, 3])
    c.write(slots, v, s)
    assert torch.equal(c.values[slots], t.weight[rows]) and torch.equal(c.scales[slots], t.scale[rows])
    ov, os_ = torch.empty_like(v), torch.empty_like(s)
    c.read(slots, ov, os_)
    assert torch.equal(ov, v) and torch.equal(os_, s)
    with pytest.raises(
        ValueError, match=rf"values must be uint8 \(3, {fmt.value_bytes(DIM)}\).*{fmt.value} cache"
    ):
        c.write(slots, torch.zeros(3, DIM + 1, dtype=torch.uint8), s)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("placement", ["device", "host", "ssd"])
@pytest.mark.parametrize("cache_rows", [0, 20])
def test_tiered_table_is_bit_exact(tmp_path, fmt: RowFormat, placement: str, cache_rows: int) -> None:
    t = table(fmt)
    src: QuantTable | MmapQuantTable = t
    if placement == "ssd":
        save_tensors(tmp_path / "t.safetensors", {"w": t.weight, "s": t.scale})
        src = MmapQuantTable(tmp_path / "t.safetensors", "w", "s", fmt)
    if placement == "device" and cache_rows:
        pytest.skip("placement DEVICE holds every row: no cache")
    tt = TieredTable(src, placement, cache_rows=cache_rows)
    assert tt.row_format is fmt and tt.row_bytes == fmt.row_bytes(DIM)
    for i, rows in enumerate(batches()):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        handle = tt.prefetch(rows, dtype if i % 3 == 0 else None) if i % 2 == 0 else None
        got = tt.gather(rows, dtype, prefetched=handle)
        assert torch.equal(bits(got), bits(t.gather(rows.long(), dtype)))
    s = tt.stats()
    if placement != "device":
        assert s["bytes_fetched"] == (
            s["cache_misses"] if cache_rows else s["rows_distinct"]
        ) * fmt.row_bytes(DIM)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("kind", ["rowfile", "mmap", "memory"])
@pytest.mark.parametrize("budgets", [(7, 20), (40, 0), (300, 300)])
def test_level_table_is_bit_exact(tmp_path, fmt: RowFormat, kind: str, budgets: tuple[int, int]) -> None:
    t = table(fmt)
    if kind == "rowfile":
        backing = RowFile(write_row_file(tmp_path / "t.rows", t.weight, t.scale, fmt=fmt), expect_format=fmt)
    elif kind == "mmap":
        save_tensors(tmp_path / "t.safetensors", {"w": t.weight, "s": t.scale})
        backing = MmapQuantTable(tmp_path / "t.safetensors", "w", "s", fmt)
    else:
        backing = t
    lt = LevelTable(backing, device_rows=budgets[0], host_rows=budgets[1], verify=True)
    assert lt.row_format is fmt
    for i, rows in enumerate(batches()):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        assert torch.equal(bits(lt.gather(rows, dtype)), bits(t.gather(rows.long(), dtype)))
    s = lt.stats()
    assert s["verify_rows"] > 0 and s["verify_mismatches"] == 0
    assert s["backing"]["bytes_in"] == s["backing"]["hits"] * fmt.row_bytes(DIM)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_offload_quantises_to_the_format_asked_for(tmp_path, fmt: str) -> None:
    config = EngramConfig.preset("tiny")
    torch.manual_seed(0)
    m = Engram(config, config.layer_ids[0])
    float_rows = m.table.weight.detach().clone()
    tables = offload_engram(m, "ssd", quantize=True, row_format=fmt, ssd_dir=tmp_path, cache_rows=16)
    (tt,) = tables.values()
    assert tt.row_format is RowFormat(fmt) and isinstance(tt.backing, MmapQuantTable)
    rows = torch.tensor([[1, 5, 5, 200]])
    assert torch.equal(tt.gather(rows), QuantTable.from_float(float_rows, fmt).gather(rows))
    with pytest.raises(ValueError, match="row_format='q4' is not a row format"):
        offload_engram(Engram(config, config.layer_ids[0]), "host", quantize=True, row_format="q4")
