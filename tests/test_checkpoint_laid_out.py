"""engram.checkpoint.laid_out: a safetensors file laid out first and filled row by row is an ordinary
safetensors file (read back by engram.checkpoint.files, mapped or not); bad rows and a metadata value
of another length are refused naming them."""

from __future__ import annotations

import re

import pytest
import torch

from engram.checkpoint.files import DTYPES, open_tensors, read_header, save_tensors
from engram.checkpoint.laid_out import create, lay_out, set_metadata, write_rows


def test_rows_written_in_any_order_read_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 8, generator=g)
    wide = torch.randn(3, 5, generator=g, dtype=torch.float64)
    fp8 = torch.randint(0, 120, (1000, 2), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    specs = {n: (t.dtype, tuple(t.shape)) for n, t in (("t", table), ("w", wide), ("f", fp8), ("s", scalar))}
    laid = lay_out(specs, {"fp": "0" * 64})
    path = tmp_path / "x.safetensors"
    create(path, laid)
    for a, b in ((700, 1000), (0, 3), (3, 700)):  # as ranks would, each its rows
        write_rows(path, laid, "t", a, table[a:b])
        write_rows(path, laid, "f", a, fp8[a:b])
    write_rows(path, laid, "w", 0, wide)
    write_rows(path, laid, "s", 0, scalar.reshape(1))
    set_metadata(path, "fp", "ab" * 32)
    f = open_tensors(path)
    assert f.metadata == {"format": "pt", "fp": "ab" * 32}
    assert torch.equal(f.tensor("t"), table) and torch.equal(f.mapped("t"), table)
    assert torch.equal(f.mapped("w"), wide) and torch.equal(f.tensor("s"), scalar)
    assert torch.equal(f.mapped("f").view(torch.uint8), fp8.view(torch.uint8))
    n, header = read_header(path)
    assert (8 + n) % 8 == 0 and [k for k in header if k != "__metadata__"] == ["w", "t", "s", "f"]

    with pytest.raises(ValueError, match=re.escape("rows [999, 1001) of 't', which has 1000")):
        write_rows(path, laid, "t", 999, table[:2])
    with pytest.raises(ValueError, match=re.escape("rows of 't' must be torch.float32 (n, 8)")):
        write_rows(path, laid, "t", 0, table.double())
    with pytest.raises(ValueError, match="no tensor 'x'"):
        write_rows(path, laid, "x", 0, table)
    with pytest.raises(ValueError, match="metadata 'fp' was not reserved at 3 characters"):
        set_metadata(path, "fp", "abc")


def test_tensors_lie_where_safetensors_puts_them(tmp_path):
    """Every dtype a checkpoint holds, two of each item size: laid out and filled, the file is
    `save_tensors`' (safetensors' writer) byte for byte, the header's metadata keys aside."""
    tensors = {
        f"{name.lower()}-{i}": torch.zeros(3 + i, 2, dtype=d) for i, (name, d) in enumerate(DTYPES.items())
    }
    want = tmp_path / "saved.safetensors"
    save_tensors(want, tensors)
    got = tmp_path / "laid.safetensors"
    laid = lay_out({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, {})
    create(got, laid)
    for n, t in tensors.items():
        write_rows(got, laid, n, 0, t)
    assert read_header(got) == read_header(want)
    assert got.read_bytes() == want.read_bytes()
