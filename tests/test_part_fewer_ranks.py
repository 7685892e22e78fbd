"""The Engram part written by fewer ranks than hold the table (issue 29, bad input): 3 gloo ranks
save a born-sharded model's part (`engram.distributed.save_engram`: rank 0 lays out one file, every
rank pwrites its rows, rank 0 renames it into place), then
- a rank raises before writing any row: every rank raises;
- a rank never calls save_engram (the others do): they fail within the collective timeout;
- a rank is killed (os._exit) while writing its rows: the others fail within the collective timeout;
and each time nothing is published: the folder keeps the earlier part byte for byte, and no
temporary file is left behind. Own processes (not the suite's launch): a rank dies in them."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3
TIMEOUT = 20.0  # the tables' collectives (prepare_data_parallel(timeout=...)): how long a rank waits


def _model():
    import hf_setup as S
    from engram.hf import add_engram

    return add_engram(S.llama(seed=3), S.engram_config(), compression=S.compression(), seed=1)


def _prepared(rank: int, scale: float):
    """A born-sharded model whose rows were changed (so a published part would differ)."""
    from engram.distributed import prepare_data_parallel

    model = _model()
    prepare_data_parallel(model, "sharded", timeout=TIMEOUT)
    with torch.no_grad():
        model.engram.table_sync.tables[0].weight.mul_(scale).add_(rank)
    return model


def _folder(part: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(part.iterdir())}


def _attempt(fn) -> tuple[str | None, float]:
    t0 = time.perf_counter()
    try:
        fn()
        return None, time.perf_counter() - t0
    except Exception as e:  # what each rank raised, whatever it is
        return f"{type(e).__name__}: {e}", time.perf_counter() - t0


def _worker(rank: int, root: str) -> None:
    import engram.distributed.hf.part as hf_part
    from engram.distributed import save_engram

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/init", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    part = Path(root) / "part"
    res: dict = {}
    try:
        model = _prepared(rank, 1.0)
        where = save_engram(
            model, part
        )  # the part every later attempt must leave as it is (rank 0: its folder)
        dist.barrier()
        res["where"] = where
        res["before"] = _folder(where) if rank == 0 else None
        t = model.engram.table_sync.tables[0]
        res["rows"] = (t.lo, t.hi)
        with torch.no_grad():
            t.weight.mul_(2)

        # a rank writing elsewhere (another folder, or one its machine does not share)
        res["elsewhere"] = _attempt(
            lambda: save_engram(model, Path(root) / f"part-{rank}" if rank == 1 else part)
        )
        dist.barrier()
        res["after_elsewhere"] = _folder(where) if rank == 0 else None

        # a rank raising before it writes a row
        def before_writing(*a, **k):
            raise ValueError("rank 2 could not quantise its rows (simulated)")

        with mock.patch.object(
            hf_part, "_write_own_rows", before_writing if rank == 2 else hf_part._write_own_rows
        ):
            res["raised"] = _attempt(lambda: save_engram(model, part))
        dist.barrier()
        res["after_raised"] = _folder(where) if rank == 0 else None

        # a rank that does not come: ranks 0 and 1 save, rank 2 does not
        if rank < 2:
            res["absent"] = _attempt(lambda: save_engram(model, part))
        dist.barrier()  # (the default group: rank 2 waits here)
        res["after_absent"] = _folder(where) if rank == 0 else None

        # a rank killed while it writes its rows (a fresh group for the tables: the last one is stale)
        model = _prepared(rank, 3.0)
        write_rows = hf_part.write_rows

        def dies(path, laid, name, first_row, rows):
            if name.endswith("embed.weight"):
                write_rows(path, laid, name, first_row, rows[: len(rows) // 2])  # half its rows, then gone
                os._exit(17)
            return write_rows(path, laid, name, first_row, rows)

        torch.save(res, f"{root}/rank-{rank}.pt")  # (rank 1 dies below)
        with mock.patch.object(hf_part, "write_rows", dies if rank == 1 else write_rows):
            res["killed"] = _attempt(lambda: save_engram(model, part))
        res["after_killed"] = _folder(where) if rank == 0 else None
    except Exception:
        res["job_failed"] = traceback.format_exc()
    torch.save(res, f"{root}/rank-{rank}.pt")
    os._exit(0)  # a peer is dead: no destroy_process_group (it would wait for it)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("part-fewer")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(root))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks still running after 300 s (hung): {alive}"
    out = [torch.load(root / f"rank-{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(out):
        assert "job_failed" not in res, f"rank {r}:\n{res['job_failed']}"
    out[0]["exitcodes"] = [p.exitcode for p in procs]
    out[0]["root"] = root
    return out


def _no_temporaries(where: Path) -> None:
    left = [p.name for p in where.iterdir() if ".tmp-" in p.name]
    assert not left, left


@pytest.mark.slow  # the module's runs: ranks writing one part, ~30 s
def test_a_rank_writing_to_another_folder_publishes_nothing(runs):
    """Rank 1 given another folder (as a folder its machine does not share would be): it says so, the
    others name it as failed; the part is unchanged and rank 1's folder holds nothing."""
    errors = [r["elsewhere"][0] for r in runs]
    assert errors[1].startswith("ValueError: rank 1 does not see ") and "laid out by rank 0" in errors[1]
    assert "every rank must pass the same folder" in errors[1], errors[1]
    for e in (errors[0], errors[2]):
        assert e is not None and "another rank failed to write its rows of the Engram part" in e, e
    assert runs[0]["after_elsewhere"] == runs[0]["before"]
    assert not (runs[0]["where"].parent / "part-1").exists()
    _no_temporaries(runs[0]["where"])


@pytest.mark.slow  # the module's runs: ranks writing one part, ~30 s
def test_a_rank_raising_before_it_writes_publishes_nothing(runs):
    errors = [r["raised"][0] for r in runs]
    assert errors[2] == "ValueError: rank 2 could not quantise its rows (simulated)"
    for e in errors[:2]:
        assert e is not None and "another rank failed to write its rows of the Engram part" in e, e
        assert "nothing was published" in e
    assert runs[0]["after_raised"] == runs[0]["before"]
    _no_temporaries(runs[0]["where"])


@pytest.mark.slow  # the module's runs: ranks writing one part, ~30 s
def test_a_rank_that_does_not_come_publishes_nothing_within_the_timeout(runs):
    for r in runs[:2]:
        error, seconds = r["absent"]
        print(f"absent rank 2: refused after {seconds:.1f} s (timeout {TIMEOUT:g} s)")
        assert error is not None, r
        assert seconds < TIMEOUT + 15, seconds  # the tables' collective timeout, not the group's 120 s
        assert (
            error.startswith("RankError: rank ")
            and "save_engram / export_fp8 / export_quantised is a collective" in error
        ), error
        assert "nothing was published: the folder keeps what it held" in error, error
    assert runs[0]["after_absent"] == runs[0]["before"]
    _no_temporaries(runs[0]["where"])


@pytest.mark.slow  # the module's runs: ranks writing one part, ~30 s
def test_a_rank_killed_while_writing_publishes_nothing_and_nobody_hangs(runs):
    assert runs[0]["exitcodes"] == [0, 17, 0]
    for r in (runs[0], runs[2]):
        error, seconds = r["killed"]
        print(f"rank 1 killed: refused after {seconds:.1f} s (timeout {TIMEOUT:g} s)")
        assert error is not None and seconds < TIMEOUT + 15, r["killed"]
        assert (
            error.startswith("RankError: rank ")
            and "lost the other ranks after it tried to write its rows" in error
        )
        assert "nothing was published: the folder keeps what it held" in error, error
    assert runs[0]["after_killed"] == runs[0]["before"]
    _no_temporaries(runs[0]["where"])
