"""Tests for engram.model.table: TrainableTable, FP8Table and MmapFP8Table (engram.checkpoint.files, which
MmapFP8Table opens its file with, has its own tests in tests/test_checkpoint_files.py).

The FP8 tables are checked against `quant.dequantize_rows` of the same rows (their plain twin), exactly.
Memory-mapped tables are written with the `safetensors` package itself (an independent writer), and one
is a sparse 8 GiB file whose far end is read without reading the rest.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from engram import EngramConfig
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.model.module import Engram
from engram.model.table import FP8Table, TrainableTable
from engram.rowformat.fp8 import BLOCK, check_rows
from engram.storage import quant

ROWS, DIM = 1000, 64


def random_table(rows: int = ROWS, dim: int = DIM, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(rows, 1, generator=g) * 2)  # rows of very different magnitudes
    return torch.randn(rows, dim, generator=g) * spread


def reference_gather(t: FP8Table | MmapFP8Table, rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The plain twin: index the stored bytes row by row, then dequantize_rows."""
    flat = rows.reshape(-1).long()
    v = torch.stack([t.weight[int(r)] for r in flat]) if flat.numel() else t.weight[:0]
    s = torch.stack([t.scale[int(r)] for r in flat]) if flat.numel() else t.scale[:0]
    return quant.dequantize_rows(v, s, dtype).reshape(*rows.shape, t.dim)


@pytest.fixture(scope="module")
def fp8() -> FP8Table:
    return FP8Table.from_float(random_table())


def write_fp8_file(path: Path, table: FP8Table, **extra: torch.Tensor) -> Path:
    save_file({"t.weight": table.weight, "t.scale": table.scale, **extra}, str(path))
    return path


# ------------------------------------------------------------------------------------------ check_rows


def test_check_rows_errors():
    check_rows(torch.tensor([0, 9]), 10)
    with pytest.raises(ValueError, match=r"row id 10 at position \(1,\)"):
        check_rows(torch.tensor([0, 10]), 10)
    with pytest.raises(TypeError, match="int64 or int32"):
        check_rows(torch.tensor([0.0]), 10)


# ------------------------------------------------------------------------------------- TrainableTable


def test_trainable_gather_dedups_and_grad_is_sparse():
    t = TrainableTable(50, 8)
    rows = torch.tensor([[3, 3, 7], [7, 3, 49]])
    out = t.gather(rows)
    assert torch.equal(out, t.weight.detach()[rows])
    out.sum().backward()
    grad = t.weight.grad
    assert grad is not None and grad.is_sparse
    dense = grad.coalesce().to_dense()
    assert dense[3].eq(3).all() and dense[7].eq(2).all() and dense[49].eq(1).all()
    assert dense.sum() == 6 * 8
    assert t.gather(rows, torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- FP8Table


def test_from_float_is_quantize_rows_and_to_float_is_dequantize_rows(fp8):
    w = random_table()
    v, s = quant.quantize_rows(w)
    assert torch.equal(fp8.weight.view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(fp8.scale.view(torch.uint8), s.view(torch.uint8))
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.scale.dtype == torch.float8_e8m0fnu
    assert (fp8.num_rows, fp8.dim) == (ROWS, DIM)
    assert torch.equal(fp8.to_float(), quant.dequantize_rows(v, s))
    assert torch.equal(fp8.to_float(torch.bfloat16), quant.dequantize_rows(v, s, torch.bfloat16))
    assert torch.equal(fp8.to_float(torch.float64), quant.dequantize_rows(v, s).double())
    # within e4m3's half-ulp: 2**-4 relative for normal values, 2**-10 * block scale for subnormal ones
    block_scale = quant.scale_bytes_to_float(fp8.scale).repeat_interleave(BLOCK, dim=1)
    assert (fp8.to_float() - w).abs().le(w.abs() * 2**-4 + block_scale * 2**-10).all()


def test_from_float_chunks(monkeypatch):
    import engram.model.table as table_mod

    monkeypatch.setattr(table_mod, "_CHUNK_ROWS", 7)  # many chunks, a ragged last one
    w = random_table(50, 32)
    small = FP8Table.from_float(w)
    v, s = quant.quantize_rows(w)
    assert torch.equal(small.weight.view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(small.to_float(), quant.dequantize_rows(v, s))


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fp8_gather_equals_dequantize_rows(fp8, dtype):
    rows = torch.randint(0, ROWS, (3, 5, 24), generator=torch.Generator().manual_seed(1))
    out = fp8.gather(rows, dtype)
    expected_dtype = torch.float32 if dtype is None else dtype
    assert out.shape == (3, 5, 24, DIM) and out.dtype == expected_dtype
    ref = reference_gather(fp8, rows, torch.float32 if dtype in (None, torch.float64) else dtype)
    assert torch.equal(out, ref.to(expected_dtype))


def test_fp8_gather_dedup(fp8):
    rows = torch.tensor([5, 5, 5, 5, 9, 9, 5, 0], dtype=torch.int32)  # >= 2x repeats: the dedup path
    out = fp8.gather(rows)
    assert torch.equal(out, reference_gather(fp8, rows))
    assert torch.equal(out[0], out[6]) and torch.equal(out[4], out[5])
    assert fp8.gather(torch.zeros(0, 24, dtype=torch.long)).shape == (0, 24, DIM)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=64))
def test_fp8_gather_any_rows(fp8_rows):
    table = FP8Table.from_float(random_table())
    rows = torch.tensor(fp8_rows)
    assert torch.equal(table.gather(rows), reference_gather(table, rows))


@pytest.mark.parametrize("bad", [-1, ROWS, ROWS + 10**9])
def test_fp8_gather_out_of_range(fp8, bad):
    with pytest.raises(ValueError, match=rf"row id {bad} .*out of range \[0, {ROWS}\)"):
        fp8.gather(torch.tensor([[0, 1], [2, bad]]))


def test_fp8_gather_bad_row_dtype(fp8):
    with pytest.raises(TypeError, match=r"int64 or int32 row ids"):
        fp8.gather(torch.tensor([0.0]))


def test_fp8_table_validates():
    v = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    s = torch.zeros(4, 2, dtype=torch.float8_e8m0fnu)
    with pytest.raises(TypeError, match=r"values has dtype torch\.uint8, expected torch\.float8_e4m3fn"):
        FP8Table(v.view(torch.uint8), s)
    with pytest.raises(
        TypeError, match=r"scales has dtype torch\.float8_e4m3fn, expected torch\.float8_e8m0fnu"
    ):
        FP8Table(v, s.view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"scales have shape \[4, 1\], expected \[4, 2\]"):
        FP8Table(v, s[:, :1])
    with pytest.raises(ValueError, match="not a multiple of 32"):
        FP8Table(v[:, :40], s)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        FP8Table.from_float(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="finite"):
        FP8Table.from_float(torch.full((2, 32), float("nan")))


def test_fp8_state_dict_and_module(fp8):
    assert set(fp8.state_dict()) == {"weight", "scale"}
    config = EngramConfig.preset("tiny")  # head_dim 32
    table = FP8Table.from_float(random_table(33048, 32))
    m = Engram(config, 1, table=table)
    sd = m.state_dict()
    assert sd["table.weight"].dtype == torch.float8_e4m3fn and sd["table.scale"].dtype == torch.float8_e8m0fnu
    m2 = Engram(config, 1, table=FP8Table.from_float(torch.zeros(33048, 32)))
    m2.load_state_dict(sd)
    h = torch.randn(2, 6, 2, 64)
    rows = torch.randint(0, 33048, (2, 6, 8))
    assert torch.equal(m(h, rows), m2(h, rows))
    assert torch.equal(m2.table.weight.view(torch.uint8), table.weight.view(torch.uint8))


def test_fp8_table_survives_dtype_casts(fp8):
    """A parent's .to(bf16)/.half()/.float() must not convert the stored FP8 bytes."""
    table = FP8Table.from_float(random_table(64, 32))
    before = table.weight.view(torch.uint8).clone(), table.scale.view(torch.uint8).clone()
    holder = torch.nn.Sequential(table, torch.nn.Linear(4, 4))
    holder.to(torch.bfloat16)
    holder.half()
    holder.float()
    holder.to("cpu", torch.float64)
    assert holder[1].weight.dtype == torch.float64  # other modules are converted as usual
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(table.weight.view(torch.uint8), before[0])
    assert torch.equal(table.scale.view(torch.uint8), before[1])


@pytest.mark.gpu
def test_fp8_table_on_cuda(fp8):
    table = FP8Table.from_float(random_table()).to("cuda")
    assert table.weight.is_cuda and table.scale.is_cuda
    rows = torch.randint(0, ROWS, (4, 24))
    assert torch.equal(table.gather(rows.cuda(), torch.bfloat16).cpu(), fp8.gather(rows, torch.bfloat16))


# ------------------------------------------------------------------------------------- MmapFP8Table


def test_mmap_gather_equals_fp8(tmp_path, fp8):
    path = write_fp8_file(tmp_path / "t.safetensors", fp8, other=torch.ones(3))
    m = MmapFP8Table(path, "t.weight", "t.scale")
    assert (m.num_rows, m.dim) == (ROWS, DIM)
    assert dict(m.state_dict()) == {}  # not buffers: a memory map stays on the host
    assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float8_e8m0fnu
    rows = torch.randint(0, ROWS, (2, 7, 24), generator=torch.Generator().manual_seed(2))
    for dtype in (None, torch.bfloat16, torch.float64):
        assert torch.equal(m.gather(rows, dtype), fp8.gather(rows, dtype))
    assert torch.equal(m.gather(rows), reference_gather(m, rows))
    dup = torch.tensor([1, 1, 1, 2, 2, 1], dtype=torch.int32)
    assert torch.equal(m.gather(dup), fp8.gather(dup))
    assert torch.equal(m.gather(rows, device="cpu"), fp8.gather(rows))
    assert torch.equal(m.to_float(), fp8.to_float())
    with pytest.raises(ValueError, match=rf"row id {ROWS} .*out of range"):
        m.gather(torch.tensor([0, ROWS]))


def test_mmap_table_in_module(tmp_path):
    config = EngramConfig.preset("tiny")
    table = FP8Table.from_float(random_table(33048, 32))
    path = write_fp8_file(tmp_path / "t.safetensors", table)
    a, b = Engram(config, 1, table=table), Engram(config, 1, table=MmapFP8Table(path, "t.weight", "t.scale"))
    b.load_state_dict({k: v for k, v in a.state_dict().items() if not k.startswith("table.")}, strict=False)
    h = torch.randn(2, 6, 2, 64)
    rows = torch.randint(0, 33048, (2, 6, 8))
    assert torch.equal(a(h, rows), b(h, rows))
    b.to(torch.float64)  # the memory map is unaffected; the gather follows h's dtype
    assert b(h.double(), rows).dtype == torch.float64


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("gib", [8, 64])
def test_mmap_sparse_huge_table(tmp_path, gib):
    """A table far larger than this test may read: header + holes (zeros) + a few real rows at the far end.
    64 GiB is more than this project's machines' RAM + swap: a copy-on-write mapping would be refused."""
    dim = 256
    row_bytes = dim + dim // 32
    rows = (gib << 30) // dim  # gib GiB of values (+ 1/32 of that of scales)
    header = {
        "__metadata__": {"format": "pt"},
        "embed.weight": {"dtype": "F8_E4M3", "shape": [rows, dim], "data_offsets": [0, rows * dim]},
        "embed.scale": {
            "dtype": "F8_E8M0",
            "shape": [rows, dim // 32],
            "data_offsets": [rows * dim, rows * row_bytes],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    path = tmp_path / "huge.safetensors"
    src = FP8Table.from_float(random_table(3, dim, seed=5))
    far = [rows - 3, rows - 2, rows - 1]
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(data_start + rows * row_bytes)  # sparse: holes read as zeros
        f.seek(data_start + far[0] * dim)
        f.write(src.weight.view(torch.uint8).numpy().tobytes())
        f.seek(data_start + rows * dim + far[0] * (dim // 32))
        f.write(src.scale.view(torch.uint8).numpy().tobytes())
    assert path.stat().st_size > gib << 30
    if hasattr(os.stat_result, "st_blocks"):
        assert path.stat().st_blocks * 512 < 64 << 20  # the file really is sparse

    src.gather(torch.tensor([[2, 0, 0], [1, 1, 2]]))  # compile (or load) the gather kernel before measuring
    rss0 = _rss_bytes()
    t = MmapFP8Table(path, "embed.weight", "embed.scale")
    assert t.num_rows == rows
    ids = torch.tensor([[far[2], 0, far[0]], [far[1], far[1], 12345678]])
    out = t.gather(ids)
    expected = src.to_float()
    assert torch.equal(out[0, 0], expected[2]) and torch.equal(out[0, 2], expected[0])
    assert torch.equal(out[1, 0], expected[1]) and torch.equal(out[1, 1], expected[1])
    assert out[0, 1].eq(0).all() and out[1, 2].eq(0).all()  # holes: zero values, scale byte 0
    assert _rss_bytes() - rss0 < 64 << 20  # only the touched pages were read
    with pytest.raises(ValueError, match=rf"row id {rows} .*out of range \[0, {rows}\)"):
        t.gather(torch.tensor([rows]))


# ------------------------------------------------------------------------------ header validation


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_mmap_wrong_dtype(tmp_path, fp8):
    path = tmp_path / "t.safetensors"
    save_file({"t.weight": fp8.to_float(), "t.scale": fp8.scale}, str(path))
    with pytest.raises(ValueError, match=r"tensor 't.weight' has dtype F32, expected F8_E4M3"):
        MmapFP8Table(path, "t.weight", "t.scale")
    save_file({"t.weight": fp8.weight, "t.scale": fp8.scale.view(torch.uint8)}, str(path))
    with pytest.raises(ValueError, match=r"tensor 't.scale' has dtype U8, expected F8_E8M0"):
        MmapFP8Table(path, "t.weight", "t.scale")


def test_mmap_wrong_shape(tmp_path, fp8):
    path = tmp_path / "t.safetensors"
    save_file({"t.weight": fp8.weight, "t.scale": fp8.scale[:-1]}, str(path))
    with pytest.raises(
        ValueError, match=rf"tensor 't.scale' has shape \[{ROWS - 1}, 2\], expected \[{ROWS}, 2\]"
    ):
        MmapFP8Table(path, "t.weight", "t.scale")
    save_file({"t.weight": fp8.weight[:, :48].contiguous(), "t.scale": fp8.scale}, str(path))
    with pytest.raises(ValueError, match="multiple of 32"):
        MmapFP8Table(path, "t.weight", "t.scale")
    save_file({"t.weight": fp8.weight.reshape(-1), "t.scale": fp8.scale}, str(path))
    with pytest.raises(
        ValueError, match=r"tensor 't.weight' has shape \[64000\], expected \['rows', 'dim'\]"
    ):
        MmapFP8Table(path, "t.weight", "t.scale")


def test_mmap_missing_tensor(tmp_path, fp8):
    path = write_fp8_file(tmp_path / "t.safetensors", fp8)
    with pytest.raises(ValueError, match=r"no tensor 'embed.weight' \(the file holds: t.scale, t.weight\)"):
        MmapFP8Table(path, "embed.weight", "t.scale")
    with pytest.raises(FileNotFoundError, match="no such safetensors file"):
        MmapFP8Table(tmp_path / "nope.safetensors", "t.weight", "t.scale")


def test_mmap_truncated_file(tmp_path, fp8):
    path = write_fp8_file(tmp_path / "t.safetensors", fp8)
    size = path.stat().st_size
    for cut in (size - 1, 20, 3):
        os.truncate(path, cut)
        with pytest.raises(
            ValueError, match=rf"t.safetensors: not a readable safetensors file \({cut} bytes"
        ):
            MmapFP8Table(path, "t.weight", "t.scale")


def test_mmap_damaged_headers(tmp_path):
    """safetensors validates the header; every refusal names the file (the wrapper's own tests are in
    tests/test_checkpoint_files.py)."""
    entry = {"dtype": "F8_E4M3", "shape": [2, 32], "data_offsets": [0, 64]}
    scale = {"dtype": "F8_E8M0", "shape": [2, 1], "data_offsets": [64, 66]}
    ok = _write_raw(tmp_path / "ok.safetensors", {"w": entry, "s": scale}, bytes(66))
    assert MmapFP8Table(ok, "w", "s").num_rows == 2
    cases = [
        {"w": {**entry, "data_offsets": [0, 60]}, "s": {**scale, "data_offsets": [60, 62]}},
        {"w": {**entry, "data_offsets": [64, 0]}, "s": scale},
        {"w": {**entry, "dtype": "Q4"}, "s": scale},
        {"w": {**entry, "shape": [2, -32]}, "s": scale},
        {"w": {"dtype": "F8_E4M3"}, "s": scale},
        {"w": {**entry, "data_offsets": [0, 128]}, "s": scale},
    ]
    for header in cases:
        path = _write_raw(tmp_path / "bad.safetensors", header, bytes(66))
        with pytest.raises(ValueError, match=r"bad.safetensors: not a readable safetensors file"):
            MmapFP8Table(path, "w", "s")
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    for name in ("junk", "huge"):
        with pytest.raises(ValueError, match=rf"{name}.safetensors: not a readable safetensors file"):
            MmapFP8Table(tmp_path / f"{name}.safetensors", "w", "s")


@pytest.mark.gpu
def test_mmap_gather_to_cuda(tmp_path, fp8):
    path = write_fp8_file(tmp_path / "t.safetensors", fp8)
    m = MmapFP8Table(path, "t.weight", "t.scale")
    rows = torch.randint(0, ROWS, (4, 24))
    out = m.gather(rows.cuda(), torch.bfloat16)  # rows on the GPU: result follows them
    assert out.is_cuda and torch.equal(out.cpu(), fp8.gather(rows, torch.bfloat16))
    assert m.gather(rows, device="cuda").is_cuda


def test_trainable_gather_gradient_is_reproducible():
    """Repeated rows' gradients are summed in a fixed order even with several threads (training
    must be reproducible run to run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        gen = torch.Generator().manual_seed(0)
        table = TrainableTable(50_000, 32)
        rows = torch.randint(0, 3000, (32, 128, 12), generator=gen)
        upstream = torch.randn(32, 128, 12, 32, generator=gen)
        grads = []
        for _ in range(4):
            table.weight.grad = None
            (table.gather(rows) * upstream).sum().backward()
            grads.append(table.weight.grad.coalesce().values().clone())
        assert all(torch.equal(grads[0], g) for g in grads[1:])
    finally:
        torch.set_num_threads(threads)
