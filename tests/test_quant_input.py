"""The quantisers' shared input handling (engram.storage.quant_input): checks, row names, float32 chunks."""

from __future__ import annotations

import math

import pytest
import torch

from engram.storage.quant_input import check_float_rows, float32_chunks, row_name


def test_check_float_rows_rejects_what_the_quantisers_reject():
    check_float_rows(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        check_float_rows([1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype torch\.int32"):
        check_float_rows(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        check_float_rows(torch.tensor(1.0))


def test_row_name():
    assert row_name(0, ()) == "the (only) row"
    assert row_name(5, (7,)) == "row 5"
    assert row_name(5, (2, 3)) == "row (1, 2) (flat row 5)"


def test_float32_chunks_cover_the_rows_and_name_the_first_bad_value():
    x = torch.arange(10 * 4, dtype=torch.float64).view(10, 4)
    got = list(float32_chunks(x, 3, "who", str))
    assert [(a, b) for a, b, _ in got] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert torch.equal(torch.cat([c for _, _, c in got]), x.float())
    x[7, 2] = math.inf
    x[8, 1] = 1e300
    with pytest.raises(ValueError, match=r"who: x at 7, column 2 is inf, which is not finite"):
        list(float32_chunks(x, 3, "who", str))
    x[7, 2] = 0.0
    with pytest.raises(ValueError, match=r"who: x at 8, column 1 is 1e\+300, which overflows float32"):
        list(float32_chunks(x, 3, "who", str))
