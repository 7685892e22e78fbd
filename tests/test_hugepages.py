"""engram.storage.hugepages: big CPU tables asked for Linux's transparent huge pages before their
first touch; everything else a plain torch.empty."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engram.model.table import TrainableTable
from engram.storage import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mappings that overlap `t`'s memory, from /proc/self/smaps."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_small_noncontiguous_and_odd_tensors_are_left_alone():
    assert not hugepages.advise_hugepages(torch.empty(1024, 16))  # below HUGEPAGE_MIN_BYTES
    big = torch.empty(hugepages.HUGEPAGE_MIN_BYTES // 4 // 16 * 2, 16)
    assert not hugepages.advise_hugepages(big.t())  # not contiguous
    t = hugepages.empty((3, 5), dtype=torch.float64)
    assert t.shape == (3, 5) and t.dtype == torch.float64


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off (or not Linux)")
def test_a_big_table_gets_huge_pages_and_keeps_its_values():
    rows = hugepages.HUGEPAGE_MIN_BYTES // 4 // 32 * 2  # 128 MiB of fp32 rows of 32
    table = TrainableTable(rows, 32)
    assert hugepages.advise_hugepages(table.weight.data)  # accepted (it was asked at allocation too)
    assert _huge_kb(table.weight) > 0  # at least part of it is on 2 MiB pages
    assert abs(float(table.weight.std()) - table.init_std) < 1e-3  # initialised as before
    plain = torch.empty(rows, 32).fill_(1.0)  # not advised: 4 KiB pages (THP mode "madvise")
    if "[madvise]" in THP.read_text():
        assert _huge_kb(plain) == 0
