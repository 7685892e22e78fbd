"""engram.kernels.cpu_cache.unique_rows against torch.unique(sorted=True, return_inverse=True)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.kernels.cpu_cache import unique_rows


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**40), min_size=0, max_size=300),
    wide=st.booleans(),
    int32=st.booleans(),
)
def test_matches_torch_unique(ids: list[int], wide: bool, int32: bool) -> None:
    num_rows = 2**41 if wide else 2**31 - 1
    a = np.array([i % num_rows for i in ids], dtype=np.int64)
    if int32:
        a = (a % (2**31 - 1)).astype(np.int32)
    uniq, inverse, bad = unique_rows(a, num_rows)
    tu, tinv = torch.unique(torch.from_numpy(a.astype(np.int64)), sorted=True, return_inverse=True)
    assert bad == -1
    assert np.array_equal(uniq, tu.numpy()) and np.array_equal(inverse, tinv.numpy())
    assert uniq.dtype == np.int64 and inverse.dtype == np.int64


def test_reports_the_first_bad_position() -> None:
    assert unique_rows(np.array([3, 1, 10, -1, 12]), 10)[2] == 2
    assert unique_rows(np.array([3, -1, 10]), 10)[2] == 1
    assert unique_rows(np.array([0, 9]), 10)[2] == -1
