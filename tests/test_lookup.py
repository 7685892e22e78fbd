"""Tests for engram.storage.lookup: gathering selected rows of an FP8 table (the torch path, the reference twin).

Gathered rows must equal `quant.dequantize_rows` of the same rows picked out by plain indexing, exactly;
only the requested rows may be dequantised (repeated ids once). The numba fast path is checked against
this twin, bit for bit, in test_lookup_fast.py.
"""

from __future__ import annotations

import pytest
import torch

from engram.storage import lookup
from engram.storage.lookup import dequantize_gather
from engram.storage.quant import dequantize_rows, quantize_rows


def _table(n: int = 50, dim: int = 64, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.logspace(-20, 20, n).unsqueeze(1)
    return quantize_rows(x)


def _rows_ref(
    values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    v = values.view(torch.uint8)[rows.long()].view(torch.float8_e4m3fn)
    s = scales.view(torch.uint8)[rows.long()].view(torch.float8_e8m0fnu)
    return dequantize_rows(v, s, dtype=dtype)


# -------------------------------------------------------------------------------------------- gather


@pytest.mark.parametrize("idt", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "hi"), [((3, 7), 4), ((2, 3, 5), 50), ((40,), 50), ((), 50), ((0, 4), 50)])
def test_gather_matches_rows(
    idt: torch.dtype, dtype: torch.dtype, shape: tuple[int, ...], hi: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    values, scales = _table()
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, hi, shape, generator=g, dtype=torch.int64).to(idt)
    want = _rows_ref(values, scales, rows, dtype)
    seen: list[int] = []
    real = lookup.dequantize_into

    def spy(v: torch.Tensor, s: torch.Tensor, block: int, out2d: torch.Tensor) -> None:
        seen.append(v.shape[0])
        real(v, s, block, out2d)

    monkeypatch.setattr(lookup, "dequantize_into", spy)
    got = dequantize_gather(values, scales, rows, dtype=dtype, backend="torch")
    assert got.shape == (*shape, 64) and got.dtype == dtype
    assert torch.equal(got, want)
    # Only the requested rows are ever dequantised; with many repeats only the distinct ones.
    n, u = rows.numel(), torch.unique(rows).numel()
    assert sum(seen) == (0 if n == 0 else (u if 2 * u <= n else n))
    # out= is written and returned
    out = torch.full((*shape, 64), 7.0, dtype=dtype)
    assert dequantize_gather(values, scales, rows, dtype=dtype, out=out) is out
    assert torch.equal(out, got)


def test_gather_memory_mapped_table(tmp_path) -> None:
    values, scales = _table(n=20, dim=32)
    path = tmp_path / "table.bin"
    path.write_bytes(values.view(torch.uint8).numpy().tobytes())
    mm = torch.from_file(str(path), shared=False, size=20 * 32, dtype=torch.uint8).view(20, 32)
    rows = torch.tensor([[19, 0], [19, 5]])
    got = dequantize_gather(mm.view(torch.float8_e4m3fn), scales, rows)
    assert torch.equal(got, _rows_ref(values, scales, rows, torch.float32))


# -------------------------------------------------------------------------------------------- errors


def test_gather_nan_scale_byte() -> None:
    values, scales = _table(n=6)
    sb = scales.view(torch.uint8).clone()
    sb[4, 1] = 255
    bad = sb.view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"NaN scale.*table row 4, block 1"):
        dequantize_gather(values, bad, torch.tensor([0, 4, 4, 4]))
    dequantize_gather(values, bad, torch.tensor([0, 5]))  # only requested rows are checked


def test_gather_bad_inputs() -> None:
    values, scales = _table(n=10)
    with pytest.raises(ValueError, match=r"row id -1 at position \(1, 0\) is out of range \[0, 10\)"):
        dequantize_gather(values, scales, torch.tensor([[0, 1], [-1, 10]]))
    with pytest.raises(ValueError, match=r"row id 10 at position \(1, 1\) is out of range \[0, 10\)"):
        dequantize_gather(values, scales, torch.tensor([[0, 1], [3, 10]], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"torch\.float32"):
        dequantize_gather(values, scales, torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"out has shape \(2, 32\)"):
        dequantize_gather(values, scales, torch.tensor([0, 1]), out=torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"table \[N, D\]"):
        dequantize_gather(values.view(2, 5, 64), scales.view(2, 5, 2), torch.tensor([0]))
