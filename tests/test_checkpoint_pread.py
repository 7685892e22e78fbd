"""Rows read by position (engram.checkpoint.files.TensorFile.read_rows_into / iter_rows) and the shard
reader built on them (engram.checkpoint.shards.RowShards): equal to what safetensors reads, in blocks
as in one read, a file truncated after it was opened refused naming it and the tensor, the cast into
a model tensor of another float dtype, rows that span two files, and no copy-on-write mapping of a
shard file left behind (what grew a resuming rank's memory)."""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
import torch

from engram.checkpoint.files import open_tensors, read_header, save_tensors
from engram.checkpoint.shard_format import SHARDS_FOLDER, ShardIdentity, TableRange, shard_file, tensor_crc32
from engram.checkpoint.shards import RowShards, write_shard

ROWS, DIM, NAME = 10, 3, "engrams.1.table"
FIELDS = ("exp_avg", "exp_avg_sq_row", "step")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a_f32": torch.randn(7, 5, generator=g),
        "b_f64": torch.randn(6, 2, 3, generator=g, dtype=torch.float64),
        "c_bf16": torch.randn(9, 4, generator=g).bfloat16(),
        "d_i32": torch.arange(11, dtype=torch.int32),
        "e_fp8": torch.randn(5, 8, generator=g).to(torch.float8_e4m3fn),
        "f_bool": torch.rand(4, 3, generator=g) > 0.5,
        "g_empty": torch.zeros(0, 4),
    }


@pytest.fixture
def tfile(tmp_path):
    path = tmp_path / "t.safetensors"
    full = _tensors()
    save_tensors(path, full)
    return path, full


def test_read_rows_into_and_blocks_equal_safetensors(tfile):
    """Every tensor of a file (each dtype, each at its own offset), any row range, into a fresh tensor and
    block by block: the bytes safetensors reads; `mapped` (the same offsets) agrees."""
    path, full = tfile
    f = open_tensors(path)
    for name, want in full.items():
        n = want.shape[0]
        for lo, hi in {(0, n), (min(1, n), n), (0, max(0, n - 2)), (n // 2, n // 2)}:
            out = torch.empty((hi - lo, *want.shape[1:]), dtype=want.dtype)
            got = f.read_rows_into(name, lo, hi, out)
            assert got is out and torch.equal(got.view(torch.uint8), want[lo:hi].view(torch.uint8))
        for chunk in (1, 7, 40, 1 << 20):
            blocks = [(r0, rows.clone()) for r0, rows in f.iter_rows(name, chunk_bytes=chunk)]
            at = 0
            for r0, rows in blocks:  # consecutive blocks, each at most `chunk` bytes unless one row
                assert r0 == at and (len(rows) == 1 or rows.numel() * rows.element_size() <= chunk)
                at += len(rows)
            assert at == n
            if n:
                joined = torch.cat([b for _, b in blocks])
                assert torch.equal(joined.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(f.mapped(name).view(torch.uint8), want.view(torch.uint8))


def test_crc32_in_blocks_is_the_whole_tensors(tfile):
    """tensor_crc32(block, crc) over the blocks of a file's tensor = tensor_crc32 of the whole tensor
    = zlib.crc32 of its C-order bytes."""
    path, full = tfile
    f = open_tensors(path)
    for name in ("a_f32", "b_f64", "e_fp8"):
        crc = 0
        for _, rows in f.iter_rows(name, chunk_bytes=13):
            crc = tensor_crc32(rows, crc)
        whole = full[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert crc == tensor_crc32(full[name]) == zlib.crc32(whole)


def test_truncated_file_is_refused_naming_it_and_the_tensor(tfile):
    """A file truncated after open_tensors checked it: refused at the first read ("changed after it was
    opened"), or mid-way through reading (a short read: the file ends before the tensor's bytes); never a
    SIGBUS, never zeros."""
    path, full = tfile
    f = open_tensors(path)
    size = path.stat().st_size
    os.truncate(path, size - 16)
    with pytest.raises(
        ValueError, match=rf"{path}.* changed after it was opened \({size - 16} bytes, was {size}"
    ):
        f.read_rows_into("a_f32", 0, 2, torch.empty(2, 5))
    with open(path, "r+b") as g:  # restored; a new handle reads it, then it is cut again
        g.truncate(size)
    g_file = open_tensors(path)
    g_file.read_rows_into("a_f32", 0, 1, torch.empty(1, 5))  # the descriptor is open now
    os.truncate(path, size - 16)
    last = list(full)[-2]  # the last tensor with data ("f_bool"): its bytes are cut
    with pytest.raises(
        ValueError, match=rf"{path}: tensor '{last}': the file ends at byte {size - 16}.*truncated"
    ):
        g_file.read_rows_into(last, 0, 4, torch.empty(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"{path}: tensor '{last}'.*truncated"):
        list(g_file.iter_rows(last))


def test_bad_destinations_and_ranges(tfile):
    path, _ = tfile
    f = open_tensors(path)
    with pytest.raises(
        ValueError, match=r"rows \[0, 2\) are F32 \[2, 5\], but out is torch.float64 \[2, 5\]"
    ):
        f.read_rows_into("a_f32", 0, 2, torch.empty(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"but out is torch.float32 \[3, 5\]"):
        f.read_rows_into("a_f32", 0, 2, torch.empty(3, 5))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        f.read_rows_into("a_f32", 0, 2, torch.empty(5, 2).t())
    with pytest.raises(ValueError, match=r"rows \[3, 9\) of tensor 'a_f32' are outside its 7 rows"):
        f.read_rows_into("a_f32", 3, 9, torch.empty(6, 5))
    with pytest.raises(ValueError, match=r"no tensor 'zz'"):
        list(f.iter_rows("zz"))


# ------------------------------------------------------------------------------------------- shards


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        f"{NAME}.weight": torch.randn(ROWS, DIM, generator=g, dtype=torch.float64),
        f"{NAME}.optimizer.exp_avg": torch.randn(ROWS, DIM, generator=g, dtype=torch.float64),
        f"{NAME}.optimizer.exp_avg_sq_row": torch.rand(ROWS, generator=g),
        f"{NAME}.optimizer.step": torch.arange(ROWS, dtype=torch.int32),
    }


def _shards(folder, bounds=(0, 4, 10), full=None) -> RowShards:
    full = _full() if full is None else full
    ident = ShardIdentity("run", 3, len(bounds) - 1, "f" * 64, "SparseRowAdam")
    for r, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        t = TableRange(NAME, ROWS, DIM, lo, hi, 0, FIELDS)
        write_shard(folder, ident, r, [t], {k: v[lo:hi] for k, v in full.items()})
    return RowShards(folder, ident)


def _cow_maps(folder) -> list[str]:
    """This process's private writable mappings of the folder's shard files (/proc/self/maps)."""
    root = str(folder / SHARDS_FOLDER)
    with open("/proc/self/maps") as f:
        return [ln for ln in f if root in ln and ln.split()[1].startswith("rw")]


@pytest.mark.parametrize("chunk", [24, 1 << 24], ids=["blocks-of-one-row", "one-block"])
def test_read_into_across_two_files_and_cast(tmp_path, chunk):
    """Rows [2, 8) span rank 0's file [0, 4) and rank 1's [4, 10): read into an F64 tensor (by position), an
    F32 one (cast block by block), a non-contiguous one; fresh rows equal; no file left mapped."""
    full = _full()
    shards = _shards(tmp_path, full=full)
    shards.chunk_bytes = chunk
    w = full[f"{NAME}.weight"]
    out = torch.empty(6, DIM, dtype=torch.float64)
    shards.read_into(NAME, f"{NAME}.weight", 2, 8, out, scan=True)
    assert torch.equal(out, w[2:8])
    out32 = torch.full((6, DIM), 7.0)
    shards.read_into(NAME, f"{NAME}.weight", 2, 8, out32)
    assert torch.equal(out32, w[2:8].float())
    strided = torch.empty(DIM, 6).t()
    shards.read_into(NAME, f"{NAME}.weight", 2, 8, strided)
    assert torch.equal(strided, w[2:8].float())
    for key in full:
        assert torch.equal(shards.read_rows(NAME, key, 2, 8), full[key][2:8])
    assert shards.read({NAME: (2, 8)})[NAME]["step"].dtype == torch.int32
    assert _cow_maps(tmp_path) == []  # the old reader's torch handle mapped each file copy-on-write


def test_read_into_refusals_change_nothing(tmp_path):
    """An integer tensor into a float table, a wrong shape, a damaged file: refused before `out` changes."""
    full = _full()
    shards = _shards(tmp_path, full=full)
    out = torch.zeros(6, DIM)
    with pytest.raises(
        ValueError, match=r"tensor 'engrams.1.table.optimizer.step' has dtype I32, but the model's"
    ):
        shards.read_into(NAME, f"{NAME}.optimizer.step", 2, 8, torch.zeros(6))
    with pytest.raises(ValueError, match=r"are \[6, 3\], the destination \[5, 3\]"):
        shards.read_into(NAME, f"{NAME}.weight", 2, 8, torch.zeros(5, DIM))
    path = tmp_path / SHARDS_FOLDER / shard_file(1)
    raw = bytearray(path.read_bytes())
    n, header = read_header(path)
    raw[8 + n + header[f"{NAME}.weight"]["data_offsets"][0] + 3] ^= 0x01  # rank 1's row 4
    path.write_bytes(bytes(raw))
    shards = RowShards(tmp_path, shards.expect)
    shards.chunk_bytes = 24
    with pytest.raises(
        ValueError, match=r"rank-00001.safetensors: tensor 'engrams.1.table.weight' has CRC32"
    ):
        shards.read_into(NAME, f"{NAME}.weight", 2, 8, out)
    assert torch.equal(out, torch.zeros(6, DIM))


def test_nan_scan_in_blocks_names_the_rows(tmp_path):
    """A NaN in row 7 (rank 1's file), scanned a row at a time: the error names the file, the table and
    the block's rows; a range that does not hold it passes."""
    full = _full()
    full[f"{NAME}.weight"][7, 2] = float("nan")
    shards = _shards(tmp_path, full=full)
    shards.chunk_bytes = 24  # one row of 3 float64 a block
    shards.check_rows(NAME, f"{NAME}.weight", 0, 7, scan=True)
    with pytest.raises(
        ValueError,
        match=r"rank-00001.safetensors: table 'engrams.1.table', tensor 'engrams.1.table.weight', rows \[7, 8\) "
        r"\(positions from row 7\): 1 of its 3 values are NaN or Inf \(the first, nan, at row 0, column 2\)",
    ):
        shards.check(verify=True)
