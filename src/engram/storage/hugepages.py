"""Transparent huge pages for big host tensors (tables and their per-row optimizer state).

A table's rows are read and written at scattered places: on 4 KiB pages every touched row of a
table of gigabytes is a TLB miss, on 2 MiB pages few are (measured here: a 64M x 16 fp32 table's
scattered `index_add_` of 400K rows 1.6x faster, its first touch 1.8x). Linux gives anonymous memory
huge pages when asked (`madvise(MADV_HUGEPAGE)`, the kernel's default THP mode "madvise") before
the pages are first touched; `empty` allocates so. Elsewhere (another OS, CUDA, THP "never", a small
tensor) it is a plain `torch.empty`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

__all__ = ["HUGEPAGE_MIN_BYTES", "advise_hugepages", "empty"]

HUGEPAGE_MIN_BYTES = 64 << 20  # below this a tensor spans few pages: not worth a system call
_MADV_HUGEPAGE = 14  # linux/mman.h
_PAGE = 4096


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux to back `t`'s memory (a contiguous CPU tensor of at least HUGEPAGE_MIN_BYTES) with
    huge pages; whether it was asked (and accepted). Effective for pages not yet touched."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < HUGEPAGE_MIN_BYTES:
        return False
    fn = _madvise()
    if fn is None:
        return False
    addr = t.data_ptr()
    start = -(-addr // _PAGE) * _PAGE  # madvise takes page-aligned ranges
    return fn(start, addr + nbytes - start, _MADV_HUGEPAGE) == 0


def empty(
    shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """`torch.empty(shape)`, on huge pages where `advise_hugepages` can ask for them."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_hugepages(t)
    return t
