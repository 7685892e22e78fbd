"""The SSD row file written without a gather (issue 29, item 3), in every row format (issue 38):
`engram.storage.rowfile`'s `create_row_file` / `write_row_range` / `set_row_file_tables` give
`write_row_file`'s bytes whatever the split of rows among writers, and
`engram.distributed.hf.part.write_part(..., row_files=True)` on 2 and 3 gloo ranks (one job of 3:
`table_ranks` 2, then all) publishes each layer's row file beside the FP8 part, byte for byte what
`write_row_files` makes of that part in one process; one process then serves `generate()` through the
row-file tier (`engram.vllm.tables.load_tables`, tables='rowfile') with the tokens of the in-memory FP8
table. A rank failing while it writes its rows of a row file publishes nothing. In every row format
(`engram.distributed.export_quantised`: fp8, int8, int8-row, int4) the ranks' part and row files are
those `engram.hf.export_quantised` and `write_row_files` write in one process, byte for byte (the
header's metadata keys in any order: safetensors' own is arbitrary), and load memory-mapped.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
import hf_setup as S
from engram.storage import rowfile
from engram.storage.quant import quantize_rows
from engram.storage.rowfile import (
    RowFile,
    RowFileHeader,
    create_row_file,
    set_row_file_tables,
    write_row_file,
    write_row_range,
)

LAYERS = (1, 2)
WORLD = 3
OWNERS = (2, 3)  # ranks holding rows (table_ranks): 2 of the 3, then all 3
FORMATS = ("fp8", "int8", "int8-row", "int4")
# (row width, format) of the parts export_quantised writes: 64-wide rows (two blocks, so int8-row's one
# scale a row is not int8's two) in every format, and int8-row rows one block wide (int8's bytes, which
# the one-process export records and serves as int8)
PARTS = (*((64, fmt) for fmt in FORMATS), (32, "int8-row"))


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("dim", [32, 256, 8192])  # 124 rows a page, 15, a row over two pages
def test_rows_written_in_ranges_equal_write_row_file(tmp_path, dim):
    """Ranges in any order, boundaries off the groups and across chunks: write_row_file's bytes."""
    n = 301 if dim < 8192 else 5
    values, scales = quantize_rows(torch.randn(n, dim, generator=torch.Generator().manual_seed(dim)))
    want = write_row_file(
        tmp_path / "one", values, scales, layer_id=2, identity="lay", tables="tab", label="x"
    )
    h = RowFileHeader(n, dim, layer_id=2, identity="lay", label="x")
    create_row_file(tmp_path / "many", h)
    cuts = [0, 1, n // 3, n // 3 + 1, n - 2, n]
    with mock.patch.object(rowfile, "_WRITE_CHUNK_ROWS", 7):  # several chunks a range
        for lo, hi in reversed(list(itertools.pairwise(cuts))):
            write_row_range(tmp_path / "many", h, lo, values[lo:hi], scales[lo:hi])
    with pytest.raises(ValueError, match="has tables='' but the table needs tables='tab'"):
        RowFile(tmp_path / "many", expect_tables="tab")  # until the fingerprint is recorded
    set_row_file_tables(tmp_path / "many", "tab")
    assert (tmp_path / "many").read_bytes() == want.read_bytes()
    with pytest.raises(ValueError, match=r"rows \[300, 302\) of a row file of 301 rows"):
        write_row_range(tmp_path / "many", RowFileHeader(301, dim), 300, values[:2], scales[:2])


def test_refusals_before_any_collective():
    """Refused on the caller's rank before it looks at the model or meets another rank: row files of a
    float part; a row format this engram does not know (listing those it does, as engram.hf's)."""
    from engram.distributed import export_quantised
    from engram.distributed.hf.part import write_part

    with pytest.raises(ValueError, match="row_files=True needs a quantised part"):
        write_part(torch.nn.Linear(1, 1), "unused", None, row_files=True)
    known = "choose one of fp8, int8, int8-row, int4"
    with pytest.raises(ValueError, match=f"format='int3' is not a row format this engram knows; {known}"):
        export_quantised(torch.nn.Linear(1, 1), "unused", "int3")
    with pytest.raises(ValueError, match=f"format='fp4' is not a row format this engram knows; {known}"):
        write_part(torch.nn.Linear(1, 1), "unused", "fp4")


# ---------------------------------------------------------------------------- the spawned job
def _write(rank: int, owners: int, folder: str) -> dict:
    """The FP8 part with row files, the rows owned by ranks 0..owners-1 (changed on each rank); then
    the same save failing on rank 1 while it writes its rows of the last layer's row file."""
    import engram.distributed.hf.part as hf_part
    from engram.distributed import export_fp8, prepare_data_parallel
    from engram.hf import add_engram

    model = add_engram(S.llama(seed=3), S.engram_config(LAYERS), compression=S.compression())
    prepare_data_parallel(model, "sharded", table_ranks=owners if owners < WORLD else None)
    res: dict = {"bounds": [], "full": []}
    with torch.no_grad():
        for lid in LAYERS:
            t = model.engram.module(lid).table
            t.weight.mul_(1 + rank).add_(0.25 * rank)  # values no rank drew: a trained table's
            res["bounds"].append((t.lo, t.hi))
            res["full"].append(t.full_weight(0))
            # Engram's output large enough to change greedy tokens
            model.engram.module(lid).wkv.weight.normal_(std=2.0, generator=torch.Generator().manual_seed(5))
    res["part"] = export_fp8(model, folder, row_files=True)  # the public call: write_part with row files
    dist.barrier()
    part = Path(folder) / "engram"
    before = {f.name: f.read_bytes() for f in part.iterdir()}
    write_row_range = hf_part.write_row_range

    def disk_full(path, header, first_row, values, scales):
        if rank == 1 and header.layer_id == LAYERS[-1]:
            raise OSError(28, "No space left on device (rank 1, simulated)")
        return write_row_range(path, header, first_row, values, scales)

    with torch.no_grad():
        model.engram.module(LAYERS[0]).table.weight.add_(1.0)  # a part that would differ
    with mock.patch.object(hf_part, "write_row_range", disk_full):
        try:
            hf_part.write_part(model, folder, "fp8", row_files=True)
            res["failed"] = None
        except (OSError, RuntimeError) as e:
            res["failed"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    res["unchanged"] = {f.name: f.read_bytes() for f in part.iterdir()} == before
    return res


def _config(width: int):
    return dataclasses.replace(S.engram_config(LAYERS), head_dim=width)  # the tables' rows: head_dim wide


def _sharded(owners: int, width: int):
    from engram.distributed import prepare_data_parallel
    from engram.hf import add_engram

    model = add_engram(S.llama(seed=3), _config(width), compression=S.compression())
    prepare_data_parallel(model, "sharded", table_ranks=owners if owners < WORLD else None)
    return model


def _quantised(rank: int, owners: int, out: str) -> dict:
    """{width: the parts of PARTS of that width}: a model with rows `width` wide (changed on each rank)
    exported with row files (`export_quantised`) into `out/q{owners}-{width}-{format}`, with rank 0's
    dense weights and the whole tables for the one-process export; "narrow": what each rank raised
    exporting one with 16-wide rows."""
    from engram.distributed import export_quantised

    res: dict = {}
    for width in sorted({w for w, _ in PARTS}):
        model = _sharded(owners, width)
        with torch.no_grad():
            for lid in LAYERS:
                model.engram.module(lid).table.weight.mul_(1 + rank).add_(0.25 * rank)
        res[width] = {
            "full": {lid: model.engram.module(lid).table.full_weight(0) for lid in LAYERS},
            "dense": {k: v for k, v in model.state_dict().items() if not k.endswith("table.weight")},
            "parts": {
                fmt: export_quantised(model, f"{out}/q{owners}-{width}-{fmt}", fmt, row_files=True)
                for w, fmt in PARTS
                if w == width
            },
        }
    try:
        export_quantised(_sharded(owners, 16), f"{out}/narrow{owners}", "int4")
        res["narrow"] = None
    except ValueError as e:
        res["narrow"] = str(e)
    return res


def _job(rank: int, out: str) -> dict:
    res = {owners: _write(rank, owners, f"{out}/model{owners}") for owners in OWNERS}
    for owners in OWNERS:
        res[owners]["q"] = _quantised(rank, owners, out)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, list[dict]]]:
    """{owners: (the HF folder, each rank's results)}: one job of 3 ranks, rows on 2 of them, then 3."""
    d = tmp_path_factory.mktemp("rows")
    for owners in OWNERS:  # HF folders: the part goes to folder/engram
        S.llama(seed=3).save_pretrained(d / f"model{owners}")
        S.tokenizer().save(str(d / f"model{owners}" / "tokenizer.json"))
    got = gloo_ranks.spawn(_job, WORLD, d, str(d), timeout_s=60)
    return {owners: (d / f"model{owners}", [g[owners] for g in got]) for owners in OWNERS}


@pytest.fixture(params=OWNERS, ids=[f"{n}-ranks" for n in OWNERS])
def job(request, runs) -> tuple[Path, list[dict]]:
    return runs[request.param]


def test_ranks_write_the_row_files_of_one_process(job, tmp_path):
    """Each row file equals write_row_files on the published part (one process, whole table), which
    equals the whole table quantised; shard boundaries fall inside page groups."""
    from engram.checkpoint.convert import open_row_file, row_file_path, write_row_files

    folder, runs = job
    part = folder / "engram"
    assert Path(runs[0]["part"]) == part and all(r["part"] is None for r in runs[1:])
    ref = tmp_path / part.name  # (the folder's name is the loaded config's, a row file's label)
    shutil.copytree(part, ref, ignore=shutil.ignore_patterns("*.rows"))
    assert len(write_row_files(ref)) == len(LAYERS)
    for i, lid in enumerate(LAYERS):
        got = row_file_path(part, lid)
        assert got.read_bytes() == row_file_path(ref, lid).read_bytes(), lid
        values, scales = quantize_rows(runs[0]["full"][i])
        f = open_row_file(part, lid, verify=True)
        rows = torch.arange(len(values))
        v, s = f.gather_bytes(rows)
        assert torch.equal(v.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), scales.view(torch.uint8))
        starts = [lo for lo, hi in (r["bounds"][i] for r in runs[1:]) if hi > lo]
        assert any(lo % f.header.rows_per_group for lo in starts), starts  # a group shared by two ranks
    assert not [p.name for p in part.iterdir() if p.name.startswith(".")]


def test_one_process_serves_the_row_files(job):
    """generate() with the tables read from the row files (tables='rowfile': the row-file tier, a
    hot-row cache in front) gives the tokens of the in-memory FP8 table, every row's bytes equal."""
    from transformers import AutoModelForCausalLM

    from engram.hf import load_engram
    from engram.systems import LevelTable
    from engram.vllm.folder import read_part
    from engram.vllm.tables import ServeOptions, TableMode, load_tables

    folder, _ = job
    served = read_part(folder, hidden_size=S.HIDDEN, num_layers=3, vocab_size=S.vocab())
    modules = load_tables(served, ServeOptions(TableMode.ROWFILE, 0.05), torch.float32)
    prompt = torch.tensor([S.tokenizer().encode(S.TEXT[0]).ids[:12]])
    out = {}
    for mode in ("memory", "rowfile"):
        model = load_engram(AutoModelForCausalLM.from_pretrained(folder).eval(), folder, mmap=False)
        if mode == "rowfile":
            for lid in LAYERS:
                want = model.engram.module(lid).table
                got = modules[lid].table
                assert isinstance(got, LevelTable)
                rows = torch.arange(want.num_rows).reshape(1, -1, 1)
                assert torch.equal(got.gather(rows, torch.float32), want.gather(rows, torch.float32))
                model.engram.module(lid).table = got
        with torch.no_grad():
            out[mode] = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(out["rowfile"], out["memory"])
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        alone = plain.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert not torch.equal(alone, out["memory"]), "Engram does not change the tokens: the test shows nothing"


def test_a_rank_failing_in_a_row_file_publishes_nothing(job):
    """Rank 1 fails writing its rows of the last layer's row file: every rank raises, the folder keeps
    the earlier part and row files byte for byte, and no temporary file is left."""
    folder, runs = job
    for rank, r in enumerate(runs):
        assert r["failed"] is not None and r["unchanged"], (rank, r["failed"])
    assert "No space left on device (rank 1, simulated)" in runs[1]["failed"]
    assert "another rank failed to write its rows" in runs[0]["failed"]
    assert not [p.name for p in (folder / "engram").iterdir() if p.name.startswith(".")]


def test_the_ranks_part_records_every_tensors_crc32_under_a_seal(job, tmp_path):
    """Every owner's rows' CRC32s, combined in row order by rank 0, are the CRC32 of the whole tensor
    as one process computes it; the metadata is sealed and records the base model (the folder's own:
    it loads without a BaseModelWarning); a byte flipped in a table is refused at load."""
    import warnings

    from transformers import AutoModelForCausalLM

    from engram.checkpoint.files import open_tensors
    from engram.checkpoint.v41.format import BASE_MODEL_KEY, file_crc32s
    from engram.hf import load_engram
    from engram.storage.integrity import tensor_crc32

    folder, _ = job
    f = open_tensors(folder / "engram" / "model-00001-of-00001.safetensors")
    crcs = file_crc32s(f.metadata, "part")
    assert crcs is not None and set(crcs) == set(f.keys())
    assert all(crcs[n] == tensor_crc32(f.tensor(n)) for n in f)
    assert BASE_MODEL_KEY in f.metadata
    from engram.hf.base import BaseModelWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseModelWarning)  # its own base: nothing to say of it
        load_engram(AutoModelForCausalLM.from_pretrained(folder), folder, tokenizer=S.tokenizer())
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / "engram" / "model-00001-of-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # the last tensor's bytes (after the header)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"its bytes do not match the CRC32 its file recorded"):
        load_engram(AutoModelForCausalLM.from_pretrained(copy), copy, tokenizer=S.tokenizer())


# ---------------------------------------------------------------------------- every row format
def _safetensors(path: Path) -> tuple[int, dict, bytes]:
    """(header length, header as JSON, the data after it) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _one_process(q: dict, width: int, folder: Path, fmt: str) -> Path:
    """`engram.hf.export_quantised` then `write_row_files` of the ranks' model in one process (its dense
    weights and whole tables) into `folder` (named as the ranks' part: a row file's label)."""
    from engram.checkpoint.convert import write_row_files
    from engram.hf import add_engram, export_quantised

    model = add_engram(S.llama(seed=3), _config(width), compression=S.compression())
    missing, unexpected = model.load_state_dict(q["dense"], strict=False)
    assert not unexpected and all(k.endswith("table.weight") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for lid in LAYERS:
            model.engram.module(lid).table.weight.copy_(q["full"][lid])
    part = export_quantised(model, folder, fmt)
    assert len(write_row_files(part)) == len(LAYERS)
    return part


@pytest.mark.parametrize(("width", "fmt"), PARTS, ids=[f"{fmt}-{w}" for w, fmt in PARTS])
def test_ranks_write_the_quantised_part_of_one_process(job, width, fmt, tmp_path):
    """The part and row files the ranks write in row format `fmt` are those of one process byte for byte:
    the same files, every tensor's bytes, the header (format, fingerprints, CRC32s, base model, seal; in
    any key order), each row file; one process loads the part memory-mapped (MmapQuantTable of `fmt`,
    int8 for int8-row rows one block wide, as the one-process part) and the vLLM plugin's row files, with
    the one-process table's rows."""
    from engram.checkpoint.convert import open_row_file
    from engram.checkpoint.mmap_table import MmapQuantTable
    from engram.hf import load_engram
    from engram.rowformat.formats import RowFormat

    folder, runs = job
    owners = folder.name.removeprefix("model")
    q = runs[0]["q"][width]
    part = Path(q["parts"][fmt])
    assert part.name == f"q{owners}-{width}-{fmt}"
    assert all(r["q"][width]["parts"][fmt] is None for r in runs[1:])
    ref = _one_process(q, width, tmp_path / part.name, fmt)
    assert sorted(p.name for p in part.iterdir()) == sorted(p.name for p in ref.iterdir())
    for f in ref.iterdir():
        if f.suffix == ".safetensors":
            got, want = _safetensors(part / f.name), _safetensors(f)
            assert got[0] == want[0] and got[1] == want[1], f.name  # the header (any key order)
            assert got[2] == want[2], f.name  # every tensor's bytes
        else:
            assert (part / f.name).read_bytes() == f.read_bytes(), f.name  # row files, config, map, options
    read_as = RowFormat.INT8_BLOCK32 if (width, fmt) == (32, "int8-row") else RowFormat(fmt)
    meta = _safetensors(part / "model-00001-of-00001.safetensors")[1]["__metadata__"]
    assert meta.get("engram_table_format.1") == (None if fmt == "fp8" else read_as.value)
    m = load_engram(S.llama(seed=3), part, tokenizer=S.tokenizer(), mmap=True)
    one = load_engram(S.llama(seed=3), ref, tokenizer=S.tokenizer(), mmap=True)
    for lid in LAYERS:
        table, want = m.engram.module(lid).table, one.engram.module(lid).table
        rows = torch.arange(len(q["full"][lid])).reshape(1, -1, 1)  # every row
        assert isinstance(table, MmapQuantTable) and table.row_format is read_as
        assert torch.equal(table.gather(rows, torch.float32), want.gather(rows, torch.float32))
        f = open_row_file(part, lid, verify=True)
        assert f.header.fmt is read_as and f.header.dim == width
        v, s = f.gather_bytes(rows.reshape(-1))
        assert torch.equal(v.view(torch.uint8), table.weight.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), table.scale.view(torch.uint8))
    assert not [p.name for p in part.iterdir() if p.name.startswith(".")]


def test_rows_of_no_row_format_are_refused_on_every_rank(job):
    """16-wide rows (no row format's: a multiple of 32): every rank refuses, naming the layer and
    width, before any file is made."""
    folder, runs = job
    for r in runs:
        assert "layer 1's rows are 16 wide: int4 rows need a positive multiple of 32" in r["q"]["narrow"]
    assert not (folder.parent / f"narrow{folder.name.removeprefix('model')}").exists()
