"""Tables born sharded, ranks that agree on them without the table, and the Engram part saved without
a gather (issue 29, items 1-3).

Row r of layer l's table depends on (seed, l, r) only (`engram.model.table_init`), so one process
(`engram.hf.add_engram`, `engram.apps.lm.train.build_model`) draws the very table N ranks hold between
them. Under a process group `add_engram`'s tables are lazy and `prepare_data_parallel` draws only the
rank's rows: 1, 2 and 3 ranks gathered equal the one-process table bit for bit, a rank's peak memory
grows by its shard and a chunk, not by the table, and the ranks agree on the tables' recipes (a few
bytes) without a digest; a table some rank holds in memory is digested chunk by chunk on every rank.
`engram.distributed.save_engram` / `export_fp8`: each rank writes its own rows into the one part
every reader reads; a rank failing mid-write publishes nothing.
One job of the suite's 3-rank launch (tests/dist_launch.py; the rows of 1 and 2 ranks are those of
table_ranks 1 and 2 there) runs every multi-process check.
"""

from __future__ import annotations

import gc
import itertools
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import dist_launch as L
import hf_setup as S
from engram.distributed.guard import chunks_digest, tensor_digest
from engram.hf import add_engram
from engram.model.table import TrainableTable
from engram.model.table_init import INIT_CHUNK_ROWS, RowInit, chunked_normal, table_seed

WORLD = 3
BIG_VOCAB = (500_000, 500_009)  # layer 1's table: 2,000,136 rows x 32 fp32 = 244 MiB whole
TABLE = "engram.layers.1.table.weight"
MB = 1 << 20  # (MiB, as /proc/self/status counts)


def _model(seed: int | None = None, lazy: bool | None = None, big: bool = False) -> torch.nn.Module:
    """A tiny Llama (seeded) with Engram at layer 1: the same call in every process."""
    cfg = S.engram_config()
    if big:
        cfg = cfg.replace(engram_vocab_size=BIG_VOCAB)
    return add_engram(S.llama(seed=3), cfg, compression=S.compression(), seed=seed, lazy_tables=lazy)


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_mb(field: str) -> float:
    """VmRSS / VmHWM of this process, MB (Linux)."""
    found = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found.group(1)) / 1024


# ---------------------------------------------------------------------------- one process
def test_table_rows_depend_on_seed_and_row_only():
    """A seeded table is chunked_normal's, whatever the split of its rows; a lazy one holds nothing
    until first used (then the same rows, in the dtype a parent's .double() asked for); a state_dict
    draws it, a loaded state is not drawn."""
    n = 2 * INIT_CHUNK_ROWS + 100
    t = TrainableTable(n, 4, seed=11)
    want = t.weight.detach()
    assert torch.equal(want, chunked_normal(0, n, 4, seed=11))
    recipe = RowInit(n, 4, 0.02, 11)
    parts = [recipe.rows(a, b) for a, b in ((0, 5), (5, INIT_CHUNK_ROWS + 3), (INIT_CHUNK_ROWS + 3, n))]
    assert torch.equal(torch.cat(parts), want)
    assert not torch.equal(TrainableTable(n, 4, seed=12).weight.detach(), want)

    lazy = TrainableTable(n, 4, seed=11, lazy=True).double()
    assert lazy.is_lazy and list(lazy.parameters()) == [] and "lazy (seed 11)" in repr(lazy)
    assert lazy.recipe is not None and lazy.recipe.dtype == torch.float64
    assert torch.equal(lazy.weight.detach(), want.double())  # first use
    assert not lazy.is_lazy and [p.shape for p in lazy.parameters()] == [(n, 4)]
    assert torch.equal(TrainableTable(n, 4, seed=11, lazy=True).state_dict()["weight"], want)
    loaded = TrainableTable(n, 4, seed=11, lazy=True)
    loaded.load_state_dict({"weight": torch.ones(n, 4)})
    assert torch.equal(loaded.weight.detach(), torch.ones(n, 4))
    with pytest.raises(ValueError, match="seed="):
        TrainableTable(10, 4, lazy=True)
    with pytest.raises(ValueError, match="magnitude below 2\\*\\*40"):
        RowInit(10, 4, 0.02, 1 << 41)


def test_add_engram_in_one_process_draws_the_row_addressed_table():
    """One process: the table is drawn at add_engram (among the parameters), row-addressed from
    (seed, layer); seed None takes one from torch's generator. lazy_tables=True draws it at the first
    forward, the same table and the same logits."""
    model = _model(seed=7)
    table = model.engram.module(1).table
    assert not table.is_lazy and any(p is table.weight for p in model.parameters())
    assert torch.equal(table.weight.detach(), chunked_normal(0, table.num_rows, 32, seed=table_seed(7, 1)))
    a, b = _model(), _model()  # S.llama seeds torch: the drawn seed is the same
    assert torch.equal(a.engram.module(1).table.weight, b.engram.module(1).table.weight)

    lazy = _model(seed=7, lazy=True)
    assert lazy.engram.module(1).table.is_lazy and not any(
        p.shape[0] == table.num_rows for p in lazy.parameters()
    )
    ids = S.batch(2, 10, seed=1)
    logits = []
    for m in (model, lazy):
        with torch.no_grad():
            m.engram.module(1).wkv.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
            logits.append(m(input_ids=ids).logits)
    assert not lazy.engram.module(1).table.is_lazy
    assert torch.equal(lazy.engram.module(1).table.weight, table.weight)
    assert torch.equal(logits[0], logits[1])

    for bad in (-1, 1 << 31, 1.5, True):
        with pytest.raises(ValueError, match=re.escape(f"seed={bad!r}")):
            _model(seed=bad)
    with pytest.raises(TypeError, match="lazy_tables='yes'"):
        _model(lazy="yes")


def test_digests_read_in_place_and_a_lazy_table_digests_as_drawn():
    """tensor_digest reads a CPU table in place (no copy, float64 or other: peak RSS grows by less
    than 8 MB for a 77 MB table); a lazy table's digest, drawn chunk by chunk, equals its drawn
    table's."""
    if not _can_reset_peak():
        pytest.skip("needs /proc/self/clear_refs (Linux) to measure the peak")
    t = TrainableTable(600_000, 32, seed=3)  # 73 MiB
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mb("VmRSS")
    want = tensor_digest(t.weight)
    grew = _status_mb("VmHWM") - before
    assert grew < 8, f"the digest grew the peak RSS by {grew:.1f} MB"
    r = t.recipe
    assert r is not None
    # a small piece, then pieces across the recipe's chunks (a piece draws each chunk it touches
    # whole: 1000-row pieces drew the table 66 times over, 30 s of a loaded machine)
    edges = [0, 1000, *range(70_001, r.num_rows, 70_001), r.num_rows]
    lazy = chunks_digest(r.dtype, (r.num_rows, r.dim), (r.rows(a, b) for a, b in itertools.pairwise(edges)))
    assert lazy == want


# ---------------------------------------------------------------------------- the spawned job
def _counted():
    """Patch the agreement check's digests to count them (they still run)."""
    import engram.distributed.hf.data_parallel as H

    return (
        mock.patch.object(H, "tensor_digest", wraps=H.tensor_digest),
        mock.patch.object(H, "chunks_digest", wraps=H.chunks_digest),
    )


def _prepare_counting(model, *args, **kw) -> tuple[str | None, int]:
    """prepare_data_parallel: (its error or None, how many tables this rank digested)."""
    from engram.distributed import prepare_data_parallel

    a, b = _counted()
    with a as td, b as cd:
        try:
            prepare_data_parallel(model, *args, **kw)
            err = None
        except ValueError as e:
            err = str(e)
    return err, td.call_count + cd.call_count


def _born_part(rank: int) -> dict:
    """The rows of 1, 2 and 3 owner ranks (table_ranks 1, 2 and None on the 3 ranks: the split of 1,
    2 and 3 ranks), born sharded, gathered whole on rank 0; and the dense weights."""
    out = {}
    for owners in (1, 2, 3):
        model = _model()
        lazy = model.engram.module(1).table.is_lazy
        err, digests = _prepare_counting(model, "sharded", table_ranks=owners if owners < WORLD else None)
        t = model.engram.table_sync.tables[0]
        full = t.full_weight(0)
        dense = model.state_dict() if rank == 0 else None  # (the sharded table is left out)
        out[owners] = {
            "lazy": lazy,
            "error": err,
            "digests": digests,
            "rows": (t.lo, t.hi),
            "full": full,
            "dense": dense,
        }
    return out


def _memory_part() -> dict:
    """Peak RSS growth over add_engram + prepare_data_parallel of a 244 MiB table: born sharded (the
    default under a process group), then drawn whole first (lazy_tables=False: the earlier way)."""
    if not _can_reset_peak():
        return {}
    from engram.distributed import prepare_data_parallel

    res = {}
    for name, lazy in (("born", None), ("whole", False)):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_mb("VmRSS")
        model = _model(big=True, lazy=lazy)
        prepare_data_parallel(model, "sharded", timeout=None)  # (no process group made: its buffers)
        grew = _status_mb("VmHWM") - before
        t = model.engram.table_sync.tables[0]
        res[name] = {"grew": grew, "shard": t.weight.numel() * 4 / MB, "whole": t.num_rows * t.dim * 4 / MB}
        del model, t
    res["chunk"] = INIT_CHUNK_ROWS * 32 * 4 / MB
    return res


def _agreement_part(rank: int) -> dict:
    """prepare_data_parallel on 3 ranks whose tables differ in seed (all lazy), are lazy on some and
    drawn on rank 0 (equal), drawn and changed on rank 1, drawn on every rank."""
    res = {}
    res["seed"] = _prepare_counting(_model(seed=8 if rank == 2 else 7), "sharded")
    model = _model(seed=7)
    if rank == 0:
        model.engram.tables()  # a use: rank 0 draws its whole table
    res["mixed-equal"] = _prepare_counting(model, "sharded")
    model = _model(seed=7)
    if rank == 1:
        with torch.no_grad():
            model.engram.tables()[0][5] += 1
    res["mixed-differ"] = _prepare_counting(model, "sharded")
    res["held"] = _prepare_counting(_model(seed=7, lazy=False), "sharded")
    return res


def _save_part(rank: int, out: str) -> dict:
    """engram.distributed.save_engram / export_fp8 of a born-sharded model whose shards were changed
    (each rank wrote its own rows); then a save into the float part's folder that fails on rank 1
    while writing its rows."""
    import engram.distributed.hf.part as hf_part
    from engram.distributed import export_fp8, prepare_data_parallel, save_engram

    model = _model()
    prepare_data_parallel(model, "sharded")
    t = model.engram.table_sync.tables[0]
    with torch.no_grad():
        t.weight.mul_(1 + rank).add_(0.25 * rank)  # values no rank drew: what a trained table holds
        model.engram.module(1).wkv.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(5))
    res = {"full": t.full_weight(0), "dense": model.state_dict() if rank == 0 else None}
    res["part"] = save_engram(model, f"{out}/part")
    res["fp8"] = export_fp8(model, f"{out}/part-fp8")
    before = {f.name: f.read_bytes() for f in Path(f"{out}/part").iterdir()}
    write_rows = hf_part.write_rows

    def disk_full(path, laid, name, first_row, rows):
        if rank == 1 and name.endswith("embed.weight"):
            raise OSError(28, "No space left on device (rank 1, simulated)")
        return write_rows(path, laid, name, first_row, rows)

    with mock.patch.object(hf_part, "write_rows", disk_full):
        try:
            save_engram(model, f"{out}/part")
            res["failed"] = None
        except (OSError, RuntimeError) as e:
            res["failed"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    after = {f.name: f.read_bytes() for f in Path(f"{out}/part").iterdir()}
    res["unchanged"] = after == before
    return res


def _train_part(corpus: str) -> dict:
    """engram train --distributed's model born sharded (--table-init chunked: build_sharded_model), gathered."""
    from engram.apps.lm.train import prepare_data
    from engram.apps.lm.train_distributed import build_distributed_model
    from engram.distributed import TableInit, sharded_tables
    from training_setup import dist_cfg

    cfg = dist_cfg(corpus)
    model = build_distributed_model(cfg, prepare_data(cfg), init=TableInit.CHUNKED)
    tables = [t.full_weight(0) for t in sharded_tables(model)]
    dense = {k: v for k, v in model.state_dict().items() if not k.endswith("table.weight")}
    return {"tables": tables, "dense": dense}


def _job(ctx) -> dict:
    """Every multi-process check on this rank of the suite's 3-rank launch (tests/dist_launch.py)."""
    import time

    assert dist.get_world_size() == WORLD
    rank, out = dist.get_rank(), Path(ctx.root) / "born"
    out.mkdir(exist_ok=True)
    res, t0 = {}, time.perf_counter()
    for name, part in (
        ("born", lambda: _born_part(rank)),
        ("agree", lambda: _agreement_part(rank)),
        ("train", lambda: _train_part(ctx.corpus)),
        ("save", lambda: _save_part(rank, str(out))),
        ("memory", _memory_part),
    ):
        res[name] = part()
        res.setdefault("seconds", {})[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
    return res


L.register(__name__, WORLD, "born-sharded", "test_distributed_born:_job")


@pytest.fixture(scope="module")
def train_setup(corpus):
    from engram.apps.lm.train import build_model, prepare_data
    from training_setup import dist_cfg

    cfg = dist_cfg(corpus)
    data = prepare_data(cfg)
    return cfg, build_model(cfg, data)


@pytest.fixture(scope="module")
def runs(dist_launch) -> list[dict]:
    return L.results(dist_launch(WORLD), "born-sharded")


def test_hf_tables_born_sharded_equal_one_process(runs):
    """Rows on 1, 2 and 3 ranks: the tables are lazy at add_engram, each rank draws only its rows (no
    digest in the agreement: the recipes agree), and the gathered table and rank 0's dense weights
    equal one process's, bit for bit."""
    one = _model().state_dict()
    n = len(one[TABLE])
    for w in (1, 2, 3):
        parts = [runs[r]["born"][w] for r in range(WORLD)]
        assert [p["rows"] for p in parts[:w]] == [(r * n // w, (r + 1) * n // w) for r in range(w)]
        assert all(p["rows"][0] == p["rows"][1] for p in parts[w:])  # ranks past the owners: no row
        for p in parts:
            assert p["lazy"] and p["error"] is None and p["digests"] == 0
        assert torch.equal(parts[0]["full"], one[TABLE])
        dense = parts[0]["dense"]
        assert TABLE not in dense and set(dense) == set(one) - {TABLE}
        for k, v in dense.items():
            assert torch.equal(v, one[k]), k


def test_engram_train_born_sharded_equals_build_model(runs, train_setup):
    """`engram train`'s one-process model (build_model) is the born-sharded model N ranks build
    (build_sharded_model), tables and dense weights, bit for bit."""
    _, model = train_setup
    one = model.state_dict()
    got = runs[0]["train"]
    keys = sorted(k for k in one if k.endswith("table.weight"))
    assert len(keys) == len(got["tables"]) == 2
    for k, full in zip(keys, got["tables"], strict=True):
        assert torch.equal(full, one[k]), k
    assert set(got["dense"]) == set(one) - set(keys)
    for k, v in got["dense"].items():
        assert torch.equal(v, one[k]), k


def test_ranks_agree_on_recipes_and_digest_only_held_tables(runs):
    """Lazy tables of different seeds: refused on every rank naming both seeds, nothing digested.
    A table drawn on rank 0 only, equal: accepted after one digest per rank (a lazy one as drawn).
    Drawn and changed on rank 1: refused by digest. Drawn everywhere: accepted, digested."""
    for rank, res in enumerate(runs):
        err, n = res["agree"]["seed"]
        assert err is not None and n == 0
        assert "layer 1's initial table" in err and "seed 10014" in err and "seed 10015" in err, err
        assert "add_engram(..., seed=N)" in err
        assert res["agree"]["mixed-equal"] == (None, 1), rank
        err, n = res["agree"]["mixed-differ"]
        assert n == 1 and err is not None and "crc32" in err and "layer 1's initial table" in err
        assert res["agree"]["held"] == (None, 1)


def test_peak_memory_per_rank_is_its_shard_and_a_chunk(runs):
    """3 ranks, a 244 MiB table: add_engram + prepare_data_parallel grow a rank's peak RSS by its shard
    and a chunk (+ up to 64 MiB of the rest), where drawing it whole first grows it by more than the table."""
    if not runs[0]["memory"]:
        pytest.skip("needs /proc/self/clear_refs (Linux) to measure the peak")
    for rank, res in enumerate(runs):
        mem, secs = res["memory"], ", ".join(f"{k} {v:.1f} s" for k, v in res["seconds"].items())
        born, whole = mem["born"], mem["whole"]
        print(f"rank {rank}: born sharded +{born['grew']:.0f} MiB, drawn whole +{whole['grew']:.0f} MiB "
              f"(shard {born['shard']:.0f}, table {born['whole']:.0f}, chunk {mem['chunk']:.0f} MiB); {secs}")  # fmt: skip
    for res in runs:
        mem = res["memory"]
        born, whole = mem["born"], mem["whole"]
        assert born["whole"] > 240 and born["shard"] < 90  # MiB
        # + 64 MiB of the rest (gloo buffers, allocator arenas: 24 on a quiet machine, 48 seen under
        # load), still far below the whole table (244) that the code before drew on every rank (+333)
        assert born["grew"] < born["shard"] + 2 * mem["chunk"] + 64, born
        assert whole["grew"] > whole["whole"], whole


def test_sharded_save_writes_one_part_without_a_gather(runs):
    """save_engram / export_fp8 on 3 ranks, each writing its own rows into one file: one process loads
    the float part equal to the gathered table and dense weights; the FP8 part equals V4.1's FP8 of the
    whole table bit for bit, records its fingerprint, loads memory-mapped, passes the vLLM plugin's
    folder check and makes a row file. A rank failing mid-write fails every rank and publishes nothing:
    the folder keeps its earlier part, byte for byte, with no temporary file left."""
    from engram.checkpoint.convert import open_row_file, write_row_files
    from engram.checkpoint.files import open_tensors
    from engram.checkpoint.mmap_table import MmapFP8Table
    from engram.hf import load_engram
    from engram.hf.io import check_part
    from engram.storage.integrity import table_fingerprint
    from engram.storage.quant import quantize_rows

    got = [r["save"] for r in runs]
    part, fp8 = Path(got[0]["part"]), Path(got[0]["fp8"])
    assert all(g["part"] is None and g["fp8"] is None for g in got[1:])
    full, dense = got[0]["full"], got[0]["dense"]
    loaded = load_engram(S.llama(seed=3), part, tokenizer=S.tokenizer(), mmap=False).state_dict()
    assert torch.equal(loaded[TABLE], full)
    for k, v in dense.items():
        assert torch.equal(loaded[k], v), k

    values, scales = quantize_rows(full)
    f = open_tensors(fp8 / "model-00001-of-00001.safetensors")
    assert torch.equal(f.tensor("layers.1.engram.embed.weight").view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(f.tensor("layers.1.engram.embed.scale").view(torch.uint8), scales.view(torch.uint8))
    assert f.metadata["engram_table_fingerprint.1"] == table_fingerprint(values, scales)
    m = load_engram(S.llama(seed=3), fp8, tokenizer=S.tokenizer(), mmap=True)
    table = m.engram.module(1).table
    assert isinstance(table, MmapFP8Table) and table.num_rows == len(full)
    check_part(fp8, backbone="llama", hidden_size=S.HIDDEN, num_layers=3, vocab_size=S.vocab())
    assert len(write_row_files(fp8)) == 1
    rows = torch.tensor([0, 7, len(full) - 1])
    v, sc = open_row_file(fp8, 1).gather_bytes(rows)
    assert torch.equal(v.view(torch.uint8), values[rows].view(torch.uint8))
    assert torch.equal(sc.view(torch.uint8), scales[rows].view(torch.uint8))

    for rank, g in enumerate(got):
        assert g["failed"] is not None and g["unchanged"], (rank, g["failed"])
    assert "No space left on device (rank 1, simulated)" in got[1]["failed"]
    assert "another rank failed to write its rows" in got[0]["failed"]
    assert not [p.name for p in part.iterdir() if p.name.startswith(".")]
