"""Tests for engram.storage.integrity: the NaN / Inf scans every checkpoint loader shares."""

from __future__ import annotations

import pytest
import torch

from engram.storage import integrity
from engram.storage.integrity import UnscannedTableWarning, check_finite, check_fp8_table, scan_table


def test_check_finite_names_count_and_first_position(monkeypatch):
    check_finite(torch.randn(5, 3), "w")
    check_finite(torch.arange(4), "ints")  # integers are always finite
    t = torch.zeros(5, 3)
    t[2, 1], t[4, 0] = float("nan"), float("inf")
    with pytest.raises(
        ValueError,
        match=r"^f.safetensors: tensor 'w': 2 of its 15 values are NaN or Inf "
        r"\(the first, nan, at row 2, column 1\); the file is damaged",
    ):
        check_finite(t, "f.safetensors: tensor 'w'")
    monkeypatch.setattr(integrity, "_CHUNK_BYTES", 8)  # chunked scans find the same
    with pytest.raises(ValueError, match=r"2 of its 15 values .* at row 2, column 1"):
        check_finite(t, "w")
    with pytest.raises(ValueError, match=r"1 of its 1 values"):
        check_finite(torch.tensor(float("-inf")), "s")


def test_check_fp8_table_finds_nan_bytes():
    w = torch.zeros(4, 64, dtype=torch.uint8)
    s = torch.full((4, 2), 127, dtype=torch.uint8)
    check_fp8_table(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "t")
    for byte in (0x7F, 0xFF):
        bad = w.clone()
        bad[3, 5] = byte
        with pytest.raises(
            ValueError,
            match=r"t: 1 of its 256 values are the byte 0x7F / 0xFF, NaN in e4m3 "
            r"\(the first at row 3, column 5\)",
        ):
            check_fp8_table(bad.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "t")
    bad = s.clone()
    bad[1, 1] = 255
    with pytest.raises(ValueError, match=r"1 of its 8 scales are the byte 255, NaN in ue8m0"):
        check_fp8_table(w.view(torch.float8_e4m3fn), bad.view(torch.float8_e8m0fnu), "t")


def test_scan_table_limit_and_verify():
    limit = integrity.SCAN_LIMIT_BYTES
    assert scan_table(limit, False, "t") and scan_table(10 * limit, True, "t")
    with pytest.warns(
        UnscannedTableWarning, match=r"table x \(1.2 GiB\) was not scanned .* only with --verify"
    ):
        assert not scan_table(5 * limit, False, "table x")
