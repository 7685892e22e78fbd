"""A cap too small for even one rank's shard, said before allocating (issue 29, bad input;
engram.distributed.memory_budget): the limits read from /proc and cgroup v2 files, the arithmetic of a
rank's need against them (injected), the hooks of prepare_data_parallel, build_optimizer and
`engram train --distributed` in a 1-rank group with injected limits, and 2 spawned gloo ranks whose
rank 1 really runs under RLIMIT_DATA: just below its shard both ranks get the same clear error (no
allocator's MemoryError, no hang), just above it the rows are drawn."""

from __future__ import annotations

import json
import math
import re
import resource
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engram.distributed.memory_budget as M
import gloo_ranks
from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.table_init import INIT_CHUNK_ROWS

MIB = 1 << 20
STATUS = "Name:\tpython\nVmSize:\t  4000000 kB\nVmData:\t   300000 kB\nVmRSS:\t100 kB\n"


def _rlimits(data: int | None = None, address: int | None = None):
    inf = resource.RLIM_INFINITY
    values = {resource.RLIMIT_DATA: data, resource.RLIMIT_AS: address}
    return lambda key: (inf if values.get(key) is None else values[key], inf)


def _limit(free: int, name: str = "RLIMIT_DATA", shared: str | None = None) -> M.MemoryLimit:
    return M.MemoryLimit(name, 100 * MIB + free, 100 * MIB, "the data segment (VmData)", "ulimit -d", shared)


def _specs(rank: int, world: int, rows: int = 3_000_000, dim: int = 32, source=M.Source.DRAWN):
    bounds = [rows * r // world for r in range(world + 1)]
    return [M.TableSpec(rows, dim, 4, bounds[rank], bounds[rank + 1], source)]


# ---------------------------------------------------------------------------------- the limits
def test_rlimits_count_against_the_data_segment_and_address_space():
    got = M.process_limits(status=STATUS, cgroup="", getrlimit=_rlimits(data=400_000 * 1024))
    assert [(x.name, x.free) for x in got] == [("RLIMIT_DATA", 100_000 * 1024)]
    got = M.process_limits(status=STATUS, cgroup="", getrlimit=_rlimits(address=5_000_000 * 1024))
    assert [(x.name, x.used, x.free) for x in got] == [("RLIMIT_AS", 4_000_000 * 1024, 1_000_000 * 1024)]
    assert M.process_limits(status=STATUS, cgroup="", getrlimit=_rlimits()) == []  # nothing set
    over = M.process_limits(status=STATUS, cgroup="", getrlimit=_rlimits(data=1024))
    assert over[0].free == 0  # a limit already passed leaves nothing


def test_cgroup_v2_limits_of_the_cgroup_and_its_ancestors(tmp_path):
    """memory.max less memory.current less the page cache (active_file + inactive_file), for each
    level that sets one ("max" and the namespace root without files left out); shared by the machine's
    processes in that cgroup (boot id and the cgroup's inode)."""
    leaf = tmp_path / "jobs" / "rank1"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text("5\n")
    job = tmp_path / "jobs"
    (job / "memory.max").write_text(f"{512 * MIB}\n")
    (job / "memory.current").write_text(f"{300 * MIB}\n")
    (job / "memory.stat").write_text(f"anon 1\nactive_file {40 * MIB}\ninactive_file {60 * MIB}\nfile 7\n")
    mounts = f"tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup2 {tmp_path} cgroup2 rw 0 0\n"
    got = M.process_limits(status=STATUS, cgroup="4:memory:/x\n0::/jobs/rank1\n", mounts=mounts,
                           getrlimit=_rlimits())  # fmt: skip
    assert len(got) == 1
    (lim,) = got
    assert (lim.name, lim.limit, lim.used, lim.free) == ("cgroup memory.max", 512 * MIB, 200 * MIB, 312 * MIB)
    boot = Path("/proc/sys/kernel/random/boot_id")
    machine = boot.read_text().strip() if boot.exists() else socket.gethostname()
    assert lim.shared == f"{machine}:{job.stat().st_ino}" and str(job / "memory.max") in lim.fix
    assert M.process_limits(status=STATUS, cgroup="4:memory:/x\n", getrlimit=_rlimits()) == []  # v1 only


# ------------------------------------------------------------------------------ the arithmetic
def test_row_state_bytes_is_what_the_optimizers_allocate():
    """The per-row state of each known optimizer equals its own expected_state (fp32 and fp64)."""
    for dtype in (torch.float32, torch.float64):
        p = torch.zeros(10, 24, dtype=dtype)
        for cls in (SparseRowAdam, SparseRowAdagrad):
            want = sum(math.prod(shape) * dt.itemsize for shape, dt in cls([p]).expected_state(p).values())
            assert M.row_state_bytes(cls.__name__, 24, dtype.itemsize) * 10 == want, (cls, dtype)
    assert M.row_state_bytes("adam", 24, 4) == M.row_state_bytes("SparseRowAdam", 24, 4) == 4 * 24 + 8
    assert M.row_state_bytes("ShardedSinkhorn", 24, 4) is None  # grows with the rows trained: not known
    assert M.row_state_bytes(None, 24, 4) is None


def test_need_of_a_rank_drawn_copied_and_with_state():
    need = M.shard_need(_specs(1, 3), rank=1, world=3, owners=3)
    rows = 1_000_000
    assert (need.rows, need.rows_bytes, need.state_bytes) == (rows, rows * 128, None)
    assert need.work_bytes == INIT_CHUNK_ROWS * 32 * 4 and need.total_bytes == 3 * rows * 128
    adam = M.shard_need(_specs(1, 3), rank=1, world=3, owners=3, optimizer="adam")
    assert adam.state_bytes == rows * 136 and adam.total_bytes == 3 * rows * (128 + 136)
    assert adam.bytes == rows * 128 + rows * 136 + INIT_CHUNK_ROWS * 128
    whole = M.shard_need(_specs(1, 3, source=M.Source.WHOLE), rank=1, world=3, owners=3, optimizer="adam")
    # the whole table first (then freed), the state after: rows + max(whole, state)
    assert whole.bytes == rows * 128 + 3 * rows * 128
    held = M.shard_need(_specs(1, 3), rank=1, world=3, owners=3, optimizer="adam", held=True)
    assert (held.bytes, held.held_bytes) == (rows * 136, rows * 128)


def test_verdict_names_the_rank_its_bytes_the_limit_and_the_ranks_that_fit():
    needs = [M.shard_need(_specs(r, 3), rank=r, world=3, owners=3) for r in range(3)]
    shard = needs[1].bytes  # 1,000,000 rows x 128 B + one chunk
    ok = [(n, [_limit(shard + 1)]) for n in needs]
    assert M.verdict(ok) is None
    short = [(n, [_limit(shard + 1 if n.rank != 1 else shard - 1)]) for n in needs]
    msg = M.verdict(short)
    room = shard - 1 - INIT_CHUNK_ROWS * 128
    ranks = math.ceil(3_000_000 * 128 / room)
    assert ranks == 4
    assert msg.startswith("rank 1 of 3 cannot hold its shard of the Engram tables (1,000,000 rows of 3 owner")
    assert f"needs {shard:,} bytes" in msg and f"RLIMIT_DATA leaves it {shard - 1:,} bytes" in msg
    assert "Nothing was allocated" in msg and f"shard them over at least {ranks} ranks" in msg
    assert "ulimit -d" in msg and "more rank" not in msg
    all_short = [(n, [_limit(10 * MIB)]) for n in needs]
    assert M.verdict(all_short).startswith("rank 0 of 3") and "(and 2 more rank(s))" in M.verdict(all_short)
    tiny = [(n, [_limit(MIB)]) for n in needs]  # not even the drawing chunk fits
    assert "not even what is allocated beside the rows while they are made fits" in M.verdict(tiny)


def test_a_shared_cgroup_must_hold_its_ranks_together():
    needs = [M.shard_need(_specs(r, 2), rank=r, world=2, owners=2) for r in range(2)]
    each = needs[0].bytes
    cg = [(n, [_limit(each + 10, "cgroup memory.max", shared="host:/job")]) for n in needs]
    msg = M.verdict(cg)  # each fits alone, not both
    assert msg is not None and "ranks 0, 1 share cgroup memory.max" in msg
    assert f"ulimit -d by at least {2 * each - each - 10:,} bytes" in msg
    apart = [(n, [_limit(each + 10, "cgroup memory.max", shared=f"host{n.rank}:/job")]) for n in needs]
    assert M.verdict(apart) is None  # one cgroup per machine


# ----------------------------------------------------------------------- the hooks, one rank
@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _patch_limits(monkeypatch, free: int) -> None:
    monkeypatch.setattr(M, "process_limits", lambda: [_limit(free)])


def _hf_model(lazy: bool = True):
    import hf_setup as S
    from engram.hf import add_engram

    cfg = S.engram_config().replace(engram_vocab_size=(100_003, 100_019))  # ~400K rows x 32: ~49 MiB
    return add_engram(S.llama(seed=3), cfg, compression=S.compression(), seed=1, lazy_tables=lazy)


def test_prepare_data_parallel_refuses_before_drawing(one_rank, monkeypatch):
    pytest.importorskip("transformers")
    from engram.distributed import prepare_data_parallel

    model = _hf_model()
    table = model.engram.module(1).table
    rows = table.recipe.num_rows
    _patch_limits(monkeypatch, rows * 128)  # the rows, not the chunk they are drawn in beside them
    with pytest.raises(M.ShardMemoryError, match=rf"rank 0 of 1 cannot hold its shard .*{rows:,} rows") as e:
        prepare_data_parallel(model, "sharded")
    assert "shard them over at least 2 ranks" in str(e.value)
    assert table.is_lazy and model.engram.table_sync is None  # nothing drawn, nothing changed
    _patch_limits(monkeypatch, rows * 128 + INIT_CHUNK_ROWS * 128)
    prepare_data_parallel(model, "sharded")
    assert model.engram.table_sync.tables[0].weight.shape == (rows, 32)


def test_build_optimizer_refuses_state_that_will_not_fit(one_rank, monkeypatch):
    pytest.importorskip("transformers")
    from engram.distributed import prepare_data_parallel
    from engram.hf import build_optimizer

    model = _hf_model()
    prepare_data_parallel(model, "sharded")
    rows = model.engram.table_sync.tables[0].num_rows
    _patch_limits(monkeypatch, rows * 136 - 1)
    with pytest.raises(M.ShardMemoryError, match=r"cannot hold the optimizer state of its shard") as e:
        build_optimizer(model, lr=1e-3, table_lr=1e-2, table_optimizer="adam")
    assert f"SparseRowAdam state {rows * 136 / MIB:,.1f} MiB" in str(e.value)
    assert "shard them over at least 2 ranks" in str(e.value)
    _patch_limits(monkeypatch, rows * 136)
    build_optimizer(model, lr=1e-3, table_lr=1e-2, table_optimizer="adam")


def test_engram_train_distributed_says_it_in_one_line(corpus, monkeypatch, capsys, tmp_path):
    """`engram train --distributed` (a 1-rank group in this process): refused before the model is
    built, one line naming the rank, rows, bytes, the limit and the ranks needed (exit 2)."""
    from cli_setup import CPU  # the limit is the host's (RLIMIT_DATA): the ranks' tensors on the CPU
    from engram.cli import main
    from training_setup import tiny_cfg

    gloo_ranks.one_rank_env(monkeypatch)
    _patch_limits(monkeypatch, 2_200_000)  # 2,056 rows x 8: 64 KiB, 80 KiB of state and a 2 MiB chunk
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(tiny_cfg(corpus).to_dict()))
    built = []
    monkeypatch.setattr("engram.apps.lm.train.prepare_data", lambda cfg: built.append(cfg) or _FakeData(cfg))
    monkeypatch.setattr(
        "engram.apps.lm.train_distributed.build_sharded_model", lambda *a, **k: built.append("model")
    )
    argv = ["train", "--config", str(conf), "--distributed", "--out", str(tmp_path / "run"), "--no-progress"]
    code = main([*argv, *CPU])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model" not in built, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "rank 0 of 1 cannot hold its shard of the Engram tables" in err
    assert "SparseRowAdam state" in err and "RLIMIT_DATA leaves it 2,200,000 bytes" in err
    assert "shard them over at least 2 ranks" in err


class _FakeData:
    """What build_distributed_model reads of prepared data: the Engram config (no corpus read)."""

    def __init__(self, cfg) -> None:
        self.engram_config = cfg.engram


# -------------------------------------------------------------- two ranks under a real RLIMIT_DATA
def _status_bytes(field: str) -> int:
    return M._status_bytes(Path("/proc/self/status").read_text(), field)


def _capped_prepare(extra: int) -> str | None:
    """Rank 1 capped at its data segment now + `extra` bytes, then prepare_data_parallel on both ranks
    (the cap lifted after): None if it went through (rows drawn), else the error."""
    from engram.distributed import prepare_data_parallel

    model = _hf_model()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_DATA, (_status_bytes("VmData") + extra, hard))
    try:
        prepare_data_parallel(model, "sharded", timeout=None)  # (no bounded group made: no new threads)
        t = model.engram.table_sync.tables[0]
        assert t.weight.shape[0] == t.hi - t.lo and bool(torch.isfinite(t.weight[[0, -1]]).all())  # (no copy)
        return None
    except Exception as e:  # an allocator's MemoryError too: it must be seen, not pass
        return f"{type(e).__name__}: {e}" + ("" if isinstance(e, ValueError) else traceback.format_exc())
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def job(rank: int) -> dict:
    """Each of 2 ranks: rank 1 capped just below its shard, then just above its shard and the chunk it
    is drawn in beside it (+48 MiB of slack for what the process allocates besides). Spawned ranks of
    their own (tests/gloo_ranks), not the suite's shared launches: a rank under a real cap that failed an
    allocation would leave a launch's later jobs out of step."""
    n = _hf_model().engram.module(1).table.recipe.num_rows
    rows = n * (rank + 1) // 2 - n * rank // 2
    shard = rows * 128  # this rank's rows (~24 MiB); a chunk is 8 MiB
    return {
        "rows": rows,
        "below": _capped_prepare(shard - 2 * MIB),
        "above": _capped_prepare(shard + INIT_CHUNK_ROWS * 128 + 48 * MIB),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA, /proc (Linux)")
@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_two_ranks_under_a_real_cap(tmp_path):
    pytest.importorskip("transformers")
    runs = gloo_ranks.spawn(job, 2, tmp_path)
    below = [r["below"] for r in runs]
    assert below[0] == below[1], below  # the same error on the capped rank and the other one
    assert below[0].startswith("ShardMemoryError: rank 1 of 2 cannot hold its shard"), below[0]
    assert (
        f"({runs[1]['rows']:,} rows of 2 owner rank(s))" in below[0] and "RLIMIT_DATA leaves it" in below[0]
    )
    # ~24 MiB of rows against ~22 MiB left, less the 8 MiB chunk: 3 or more ranks of ~49 MiB of tables
    fit = re.search(
        r"the whole tables take ([\d,]+) bytes .* has room for ([\d.]+) MiB .* at least (\d+) ranks", below[0]
    )
    assert fit is not None, below[0]
    total, room, ranks = int(fit[1].replace(",", "")), float(fit[2]) * MIB, int(fit[3])
    assert ranks >= 3 and total / room - 0.01 <= ranks < total / room + 1  # the ceiling (room rounded)
    assert [r["above"] for r in runs] == [None, None]
