"""engram.hf.export_quantised: the Engram part with its tables in an integer row format (INT8, 4-bit),
served memory-mapped (and through engram.systems) with exactly the logits of the model whose tables
were quantised the same way; an unknown format refused before anything is written."""

from __future__ import annotations

import pytest
import torch

import hf_setup as S
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.hf import add_engram, export_quantised, load_engram
from engram.model.table import QuantTable
from engram.rowformat.formats import RowFormat

transformers = pytest.importorskip("transformers")


def _trained():
    model = add_engram(S.llama(), S.engram_config((0, 2)), compression=S.compression())
    with torch.no_grad():
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.3)
            m.q_weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("fmt", ["int8", "int8-row", "int4"])
def test_export_served_from_a_memory_mapped_table(tmp_path, fmt: str) -> None:
    model = _trained()
    x = S.batch(2, 9)
    part = export_quantised(model, tmp_path / fmt, fmt)
    served = load_engram(S.llama(), part, mmap=True, tokenizer=S.tokenizer())
    table = served.engram.module(0).table
    assert isinstance(table, MmapQuantTable)
    # head_dim 32: one block a row, so int8-row is int8's bytes (and loads under that name)
    assert table.row_format.same_bytes(RowFormat(fmt), table.dim)
    with torch.no_grad():  # the attached model with its tables quantised to the format
        for m in model.engram.layers.values():
            m.table = QuantTable.from_float(m.table.weight, fmt)
        ref = model(x).logits
        assert torch.equal(served(x).logits, ref)
        from engram.systems.prefetch import offload_engram

        offload_engram(served, "ssd", cache_rows=8)  # the systems tier reads the same file
        assert torch.equal(served(x).logits, ref)


def test_unknown_format_refused_before_writing(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"format='nf4' is not a row format.*fp8, int8, int8-row, int4"):
        export_quantised(_trained(), tmp_path / "x", "nf4")
    assert not (tmp_path / "x").exists()
