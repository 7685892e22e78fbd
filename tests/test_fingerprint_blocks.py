"""An FP8 table's fingerprint taken from blocks read off a file (how a sharded part's rank 0 records it,
never mapping the file) equals `table_fingerprint` of the whole tensors, at any block size."""

from __future__ import annotations

import torch

from engram.checkpoint.files import open_tensors, save_tensors
from engram.model.table import FP8Table
from engram.storage.integrity import fingerprint_blocks, table_fingerprint


def test_blocks_read_from_the_file_give_the_whole_tables_fingerprint(tmp_path):
    t = FP8Table.from_float(torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)))
    want = table_fingerprint(t.weight, t.scale)
    save_tensors(tmp_path / "t.safetensors", {"w": t.weight, "s": t.scale})
    f = open_tensors(tmp_path / "t.safetensors")
    for chunk in (64, 1000, 4096, 1 << 20):  # one row, rows, blocks that split the table unevenly, all
        values, scales = ((b for _, b in f.iter_rows(n, chunk_bytes=chunk)) for n in ("w", "s"))
        assert fingerprint_blocks(t.weight.shape, t.scale.shape, values, scales) == want, chunk
    other = t.weight.clone()
    other.view(torch.uint8)[999, 63] ^= 1  # one bit of the last row
    assert table_fingerprint(other, t.scale) != want
