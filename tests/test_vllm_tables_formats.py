"""The vLLM plugin's tables (`engram.vllm.tables`, no vLLM import) with a part exported in an integer row
format (`engram.hf.export_quantised`): every table mode (memory, host, mmap, rowfile) serves exactly
the rows of the in-memory table of that format; runs without vLLM."""

from __future__ import annotations

import pytest
import torch

import vllm_setup
from engram.addressing.compression import TokenizerCompression
from engram.checkpoint.convert import write_row_files
from engram.checkpoint.v41 import load_engram_modules
from engram.rowformat.formats import RowFormat
from engram.systems import LevelTable, TieredTable

pytest.importorskip("transformers")

SHAPE = dict(hidden_size=vllm_setup.HIDDEN, num_layers=2, vocab_size=vllm_setup.VOCAB)


@pytest.fixture(scope="module", params=["int8", "int4"])
def folder(request, tmp_path_factory):
    from engram.hf import add_engram, export_quantised

    torch.manual_seed(0)
    model = vllm_setup.backbone("llama").eval()
    add_engram(model, vllm_setup.engram_config(), compression=TokenizerCompression.identity(vllm_setup.VOCAB))
    folder = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(folder)
    write_row_files(export_quantised(model, folder, request.param))
    return folder, RowFormat(request.param)


@pytest.mark.parametrize("mode", ["memory", "host", "mmap", "rowfile"])
def test_every_mode_serves_the_formats_rows(folder, mode: str) -> None:
    from engram.vllm.folder import read_part
    from engram.vllm.tables import ServeOptions, TableMode, load_tables

    path, fmt = folder
    with pytest.warns(UserWarning, match="not checked against a tokenizer"):
        part = read_part(path, **SHAPE)
    assert part.fp8  # a quantised part: the tiered modes serve it
    modules = load_tables(part, ServeOptions(TableMode(mode), 0.05), torch.float32)
    _, want = load_engram_modules(part.part, mmap=False)
    for lid, m in modules.items():
        t = m.table
        if mode == "host" or mode == "mmap":
            assert isinstance(t, TieredTable) and t.row_format is fmt
        elif mode == "rowfile":
            assert isinstance(t, LevelTable) and t.row_format is fmt
        rows = torch.randint(0, t.num_rows, (3, 40))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(t.gather(rows, dtype), want[lid].table.gather(rows, dtype))


@pytest.mark.parametrize("fmt", ["int8-row", "int4"])
def test_tensor_parallel_shards_an_integer_table(fmt: str) -> None:
    """`shard_tables` splits a QuantTable's rows over ranks; the ranks' partial gathers sum to the table's."""
    import copy

    from engram.addressing.layout import Layout
    from engram.config import EngramConfig
    from engram.model.module import Engram
    from engram.model.table import QuantTable
    from engram.vllm.tensor_parallel import shard_tables

    config = EngramConfig.preset("tiny")
    lid = config.layer_ids[0]
    n = Layout(config).layer(lid).num_embeddings
    full = Engram(config, lid, table=QuantTable.from_float(torch.randn(n, config.head_dim), fmt))
    rows = torch.randint(0, n, (4, 9))
    want = full.table.gather(rows)
    partial = []
    for rank in range(3):
        mods = {lid: copy.deepcopy(full)}
        shard_tables(mods, rank, 3, lambda x: x)  # each rank's share, its all-reduce left to the sum below
        assert mods[lid].table.shard.row_format is RowFormat(fmt)
        partial.append(mods[lid].table.gather(rows))
    assert torch.equal(sum(partial), want)
