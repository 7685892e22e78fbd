"""engram.distributed against single-process references: 2 and 3 gloo ranks (3: uneven shards).

Each world size runs once, a job of the suite's launch of that size (tests/dist_launch.py, module
fixture `runs`); the job (tests/dist_worker.py) returns what it saw and the tests compare it with
TrainableTable / Trainer runs made here. The table checks run for every owner set of
dist_worker.OWNERS (every rank, or dedicated table ranks) in that one job: `TABLE_CASES`
parametrises them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import dist_launch as L
from cli_setup import CPU
from dist_worker import (
    ADAM_LR,
    ADAM_STEPS,
    CHUNKED_ROWS,
    OWNERS,
    SHARDED_OWNERS,
    SINKHORN_LR,
    SINKHORN_STEPS,
    SIZES,
    folder,
    sinkhorn_step_inputs,
    step_inputs,
    table_inputs,
)
from engram.apps.lm.train import TrainConfig, Trainer, build_model, evaluate, load_trained_model, prepare_data
from engram.checkpoint.shard_format import HEADER_KEY, SHARDS_FOLDER, shard_file
from engram.checkpoint.shards import SHARDS_KEY
from engram.distributed import chunked_normal, shard_bounds
from engram.model.optim import SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn
from engram.model.table import TrainableTable
from training_setup import dist_cfg

WORLDS = (2, 3)
TABLE_CASES = [(w, o) for w in WORLDS for o in OWNERS[w]]  # (world, owners): None = every rank


@pytest.fixture(scope="module")
def cfg(corpus) -> TrainConfig:
    return dist_cfg(corpus)


@pytest.fixture(scope="module")
def data(cfg):
    return prepare_data(cfg)


@pytest.fixture(scope="module")
def single(cfg, data):
    """The single-process run the distributed ones must reproduce."""
    t = Trainer(cfg, data, build_model(cfg, data))
    initial = t.evaluate(1024)
    t.run()
    return {"history": t.history, "initial_eval": initial, "final_eval": t.evaluate(1024), "model": t.model}


@pytest.fixture(scope="module")
def single64(cfg, data):
    """The single-process run in float64."""
    t = Trainer(cfg, data, build_model(cfg, data).double())
    t.run()
    return {"history": t.history, "model": t.model}


for _world in WORLDS:  # W=3 resumes W=2's sharded checkpoint
    L.register(__name__, _world, folder(_world), "dist_worker:job", prev=folder(2) if _world == 3 else None)


@pytest.fixture(scope="module")
def runs(dist_launch) -> dict[int, dict]:
    """world -> the job's folder ("dir") and every rank's results ("ranks")."""
    root = dist_launch(WORLDS[-1])
    return {w: {"dir": root / folder(w), "ranks": L.results(root, folder(w))} for w in WORLDS}


def _table_ranks(runs: dict[int, dict], world: int, owners: tuple[int, ...] | None) -> list[dict]:
    """Each rank's table-check results for one owner set."""
    return [r["tables"][owners] for r in runs[world]["ranks"]]


# ------------------------------------------------------------------------------------ no processes
@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_gather_matches_unsharded(runs, world, owners):
    full = table_inputs(torch.float32)
    refs = [TrainableTable(n, 8) for n in SIZES]
    for ref, w in zip(refs, full, strict=True):
        ref.weight.data.copy_(w)
    rows = [r for r, _ in step_inputs(0)]
    b = len(rows[0]) // world
    ranks = _table_ranks(runs, world, owners)
    for rank, res in enumerate(ranks):
        for t, ref in enumerate(refs):
            local = rows[t][rank * b : (rank + 1) * b]
            assert torch.equal(res["gathered"][t].detach(), ref.gather(local).detach()), (rank, t)
            assert res["bounds"][t] == shard_bounds(SIZES[t], world, owners)
            n_owners = world if owners is None else len(owners)
            if owners is None or rank in owners:  # num_rows / N rows each (+ at most one)
                assert SIZES[t] // n_owners <= res["shard_rows"][t] <= SIZES[t] // n_owners + 1, (rank, t)
            else:
                assert res["shard_rows"][t] == 0, (rank, t)  # a non-owner holds no row
        assert torch.equal(res["gathered_self"], refs[1].gather(rows[1][rank * b : (rank + 1) * b][:, :2]))
    assert all(torch.equal(f, w) for f, w in zip(ranks[0]["full"], full, strict=True))
    assert all(f is None for r in ranks[1:] for f in r["full"])  # rank 0 only


def _reference_tables() -> list[TrainableTable]:
    """The unsharded fp64 tables every rank's shards start from."""
    refs = [TrainableTable(n, 8, dtype=torch.float64) for n in SIZES]
    for ref, w in zip(refs, table_inputs(torch.float64), strict=True):
        ref.weight.data.copy_(w)
    return refs


def _reference_table_run(steps: int) -> tuple[list[torch.Tensor], list[TrainableTable]]:
    """Unsharded fp64 tables: the first step's coalesced gradients, and the tables after `steps`."""
    refs = _reference_tables()
    opt = SparseRowAdam([t.weight for t in refs], lr=ADAM_LR)
    grads = []
    for step in range(steps):
        loss = sum((t.gather(r) * c).sum() for t, (r, c) in zip(refs, step_inputs(step), strict=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = [t.weight.grad.coalesce().to_dense() for t in refs]
        opt.step()
    return grads, refs


@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_sync_grads_match_unsharded(runs, world, owners):
    grads, _ = _reference_table_run(1)
    ranks = _table_ranks(runs, world, owners)
    for rank, res in enumerate(ranks):
        for t, g in enumerate(grads):
            lo, hi = res["bounds"][t][rank], res["bounds"][t][rank + 1]
            torch.testing.assert_close(res["grads"][t], g[lo:hi], rtol=0, atol=1e-12)
            layout, idx = res["grad_layout"][t]
            assert layout == torch.sparse_coo and bool((idx[0, 1:] > idx[0, :-1]).all())  # sorted, distinct
        touched = sum(int((res["grads"][1].abs().sum(1) > 0).sum()) for res in ranks)
        assert touched == int((grads[1].abs().sum(1) > 0).sum())  # every touched row at its owner


@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_sparse_row_adam_steps_match_unsharded(runs, world, owners):
    _, refs = _reference_table_run(ADAM_STEPS)
    start = table_inputs(torch.float64)
    ranks = _table_ranks(runs, world, owners)
    for got, ref, w0 in zip(ranks[0]["adam"], refs, start, strict=True):
        assert not torch.equal(got, w0)  # the steps moved rows
        torch.testing.assert_close(got, ref.weight.detach(), rtol=0, atol=1e-12)
    for res in ranks:  # the optimizer state runs over the rank's own rows only: none on a non-owner
        assert all(
            set(rows) == {n} for rows, n in zip(res["adam_state_rows"], res["shard_rows"], strict=True)
        )


@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_sharded_sinkhorn_equals_one_process(runs, world, owners):
    """ShardedSinkhorn on 2 and 3 ranks (uneven shards; a non-owner; a rank whose rows are never looked
    up) gives the single-process SparseSinkhorn's tables to fp64 rounding, with 6 all-reduces a table
    and step (the row-norm sum and 5 column steps)."""
    refs = _reference_tables()
    opt = SparseSinkhorn([t.weight for t in refs], lr=SINKHORN_LR)
    active = []
    for step in range(SINKHORN_STEPS):
        loss = sum(
            (t.gather(r) * c).sum() for t, (r, c) in zip(refs, sinkhorn_step_inputs(step), strict=True)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        active.append([opt.active_rows(t.weight) for t in refs])
    ranks = _table_ranks(runs, world, owners)
    for got, ref, w0 in zip(ranks[0]["sinkhorn"], refs, table_inputs(torch.float64), strict=True):
        assert not torch.equal(got, w0)
        torch.testing.assert_close(got, ref.weight.detach(), rtol=1e-9, atol=1e-12)
    # the active sets of the shards add up to the whole table's at every step
    for step in range(SINKHORN_STEPS):
        assert [sum(r["sinkhorn_active"][step][t] for r in ranks) for t in range(2)] == active[step]
    assert {r["sinkhorn_reduces"] for r in ranks} == {SINKHORN_STEPS * len(SIZES) * 6}


@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_bf16_tables(runs, world, owners):
    refs = [TrainableTable(n, 8, dtype=torch.bfloat16) for n in SIZES]
    for ref, w in zip(refs, table_inputs(torch.bfloat16), strict=True):
        ref.weight.data.copy_(w)
    inputs = step_inputs(0)
    outs = [t.gather(r, torch.float32) for t, (r, _) in zip(refs, inputs, strict=True)]
    sum((o * c.float()).sum() for o, (_, c) in zip(outs, inputs, strict=True)).backward()
    b = len(inputs[0][0]) // world
    for rank, res in enumerate(_table_ranks(runs, world, owners)):
        for t, ref in enumerate(refs):
            assert torch.equal(res["bf16_gathered"][t], outs[t][rank * b : (rank + 1) * b].detach())
            lo, hi = res["bounds"][t][rank], res["bounds"][t][rank + 1]
            got, want = res["bf16_grads"][t], ref.weight.grad.coalesce().to_dense()[lo:hi]
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)  # bf16 sums


@pytest.mark.parametrize(("world", "owners"), TABLE_CASES)
def test_bad_rows_raise_on_every_rank(runs, world, owners):
    ranks = _table_ranks(runs, world, owners)
    errors = [r["bad_row_error"] for r in ranks]
    assert all(e is not None for e in errors)
    assert f"row id {SIZES[1]}" in errors[-1] and "outside" in errors[-1]
    assert all(f"rank(s) [{world - 1}]" in e for e in errors[:-1])
    assert all("was not prefetched" in r["stale_error"] for r in ranks)


def test_chunked_init_is_world_size_independent(runs, cfg, data):
    expected = chunked_normal(0, CHUNKED_ROWS, 4, seed=3)
    for world, owners in TABLE_CASES:  # any world size, any owners
        ranks = _table_ranks(runs, world, owners)
        assert torch.equal(ranks[0]["chunked"], expected), (world, owners)
        assert all(r["chunked_local_ok"] for r in ranks)
    (t2, d2), (t3, d3) = (runs[w]["ranks"][0]["chunked_model"] for w in WORLDS)
    assert all(torch.equal(a, b) for a, b in zip(t2, t3, strict=True)) and len(t2) == 2
    assert d2.keys() == d3.keys() and all(torch.equal(d2[k], d3[k]) for k in d2)
    backbone = build_model(cfg, data, with_engram=False).state_dict()  # the same backbone draws
    assert all(torch.equal(d2[k], v) for k, v in backbone.items())


# ------------------------------------------------------------------------------------ training
def _check_history(got: list[dict], want: list[dict], tol: float) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for a, b in zip(got, want, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=tol), a["step"]
        assert ("held_out_loss" in a) == ("held_out_loss" in b)
        assert a.get("held_out_loss", 0.0) == pytest.approx(b.get("held_out_loss", 0.0), abs=tol), a["step"]


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_single_process_fp64(runs, single64, world):
    """Same model, same global batch: the same losses and parameters up to summation order."""
    res = runs[world]["ranks"][0]
    _check_history(res["history64"], single64["history"], 1e-10)
    want = single64["model"].state_dict()
    assert res["state64"].keys() == want.keys()
    for k, v in want.items():
        assert res["state64"][k].dtype == torch.float64
        torch.testing.assert_close(res["state64"][k], v, rtol=0, atol=1e-9, msg=k)


@pytest.fixture(scope="module")
def sinkhorn64(cfg, data, tmp_path_factory):
    """The single-process fp64 run of V4.1's recipe (Sinkhorn for the tables and the embedding)."""
    c = cfg.replace(table_optimizer="sinkhorn", embedding_optimizer="sinkhorn")
    t = Trainer(c, data, build_model(c, data).double(), out_dir=tmp_path_factory.mktemp("sinkhorn64"))
    t.run()
    return {"cfg": c, "history": t.history, "model": t.model}


@pytest.mark.parametrize("world", WORLDS)
def test_sinkhorn_training_matches_single_process_and_resumes(runs, sinkhorn64, data, world):
    """The distributed trainer with V4.1's recipe trains the one-process model (fp64: losses 1e-10,
    parameters 1e-9); its sharded step-3 checkpoint (per-row momentum, each owner's rows) resumes bit
    for bit in the same world, and in one process to the same run."""
    res = runs[world]["ranks"][0]
    assert res["sinkhorn_history64"] != res["history64"]  # another optimizer: another run
    _check_history(res["sinkhorn_history64"], sinkhorn64["history"], 1e-10)
    want = sinkhorn64["model"].state_dict()
    assert res["sinkhorn_state64"].keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(res["sinkhorn_state64"][k], v, rtol=0, atol=1e-9, msg=k)
    assert res["sinkhorn_resumed_history64"] == res["sinkhorn_history64"]
    c = sinkhorn64["cfg"]
    one = Trainer(c, data, build_model(c.replace(seed=99), data).double())
    one.resume_from(runs[world]["dir"] / "sinkhorn64" / f"checkpoints/step-{c.steps // 2:07d}")
    one.run()
    _check_history(one.history, sinkhorn64["history"], 1e-10)


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_single_process_fp32(runs, single, world):
    """The fp32 run (what the CLI trains): losses within 5e-5 of one process's (measured: <= 1e-5 on
    train losses, <= 9e-5 on the step-6 held-out loss of W=2); the checkpoint in the single-process format."""
    res = runs[world]["ranks"][0]
    _check_history(res["history"][:4], single["history"][:4], 5e-6)  # before drift compounds
    _check_history(res["history"], single["history"], 2e-4)
    assert all(r["history"] == res["history"] for r in runs[world]["ranks"])  # every rank logs the same
    for key in ("initial_eval", "final_eval"):
        assert res[key]["tokens"] == single[key]["tokens"]
        assert res[key]["loss"] == pytest.approx(single[key]["loss"], abs=2e-4)
    assert res["initial_eval"]["loss"] == pytest.approx(
        single["initial_eval"]["loss"], abs=1e-9
    )  # same model
    got = load_file(str(runs[world]["dir"] / "run" / "checkpoints" / "step-0000006" / "model.safetensors"))
    want = single["model"].state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-2, msg=k)  # Adam-amplified fp32 noise
    assert res["num_params"] == single["model"].num_params()


@pytest.mark.parametrize("world", WORLDS)
def test_distributed_resume_is_exact(runs, world):
    res = runs[world]["ranks"][0]
    assert res["resumed_step"] == 3
    assert res["resumed_history"] == res["history"]
    d = runs[world]["dir"]
    a = load_file(str(d / "run" / "checkpoints" / "step-0000006" / "model.safetensors"))
    b = load_file(str(d / "resumed" / "checkpoints" / "step-0000006" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(str(d / "run" / "checkpoints" / "step-0000006" / "optimizer.safetensors"))
    ob = load_file(str(d / "resumed" / "checkpoints" / "step-0000006" / "optimizer.safetensors"))
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)


def test_distributed_checkpoint_resumes_in_one_process(runs, cfg, data, single):
    """A 2-rank checkpoint at step 3 loads into a single-process Trainer (every optimizer state on
    its parameter, tables whole) and continues along the single run's trajectory."""
    path = runs[2]["dir"] / "run" / "checkpoints" / "step-0000003"
    saved = load_file(str(path / "optimizer.safetensors"))
    t = Trainer(cfg, data, build_model(cfg.replace(seed=5), data))
    t.resume_from(path)
    assert t.step == 3
    for name, opt in (("dense", t.opt), ("table", t.table_opt)):
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            assert opt.state[p]["exp_avg"].shape == p.shape, (name, i)
            assert torch.equal(opt.state[p]["exp_avg"], saved[f"{name}.{i}.exp_avg"]), (name, i)
    table = t.model.engrams["1"].table
    assert t.table_opt.state[table.weight]["exp_avg_sq_row"].shape == (table.num_rows,)
    t.run()
    _check_history(t.history, single["history"], 2e-4)
    for k, v in single["model"].state_dict().items():
        torch.testing.assert_close(t.model.state_dict()[k], v, rtol=0, atol=2e-2, msg=k)


def test_table_ranks_training_matches_single_process_fp64(runs, single64):
    """--table-ranks 1 at W=2: rank 0 holds every table row and its optimizer state, rank 1 none,
    and the run is the single-process one; its step-3 checkpoint resumed with the tables on rank 1
    only (rank 0 restoring an empty shard) continues along it too."""
    ranks = runs[2]["ranks"]
    sizes = [m.table.num_rows for m in single64["model"].engrams.values()]
    for r, owned in ((0, True), (1, False)):
        assert [o for o, _ in ranks[r]["owned_rows"]] == [(0,)] * len(sizes)
        rows = [n for _, n in ranks[r]["owned_rows"]]
        assert rows == (sizes if owned else [0] * len(sizes))  # a non-owner's shard is empty
        opt_rows = ranks[r]["owned_opt_rows"]  # per table: rows of each optimizer state tensor
        assert [set(s) for s in opt_rows] == [{n} for n in rows]
    assert ranks[0]["owned_resumed_rows"] == [0] * len(sizes) and ranks[1]["owned_resumed_rows"] == sizes
    res = ranks[0]
    _check_history(res["owned_history64"], single64["history"], 1e-10)
    assert ranks[1]["owned_history64"] == res["owned_history64"]
    want = single64["model"].state_dict()
    assert res["owned_state64"].keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(res["owned_state64"][k], v, rtol=0, atol=1e-9, msg=k)
    _check_history(res["owned_resumed_history64"], single64["history"], 1e-10)


def test_table_ranks_checkpoint_resumes_in_one_process(runs, cfg, data, single64):
    """The --table-ranks 1 checkpoints are in the single-process format: step 3 resumes in one
    process along the single run; step 6 loads with load_trained_model (what `engram eval` reads)."""
    run = runs[2]["dir"] / "owned64"
    t = Trainer(cfg, data, build_model(cfg.replace(seed=5), data).double())
    t.resume_from(run / "checkpoints" / "step-0000003")
    table = t.model.engrams["1"].table
    assert t.table_opt.state[table.weight]["exp_avg"].shape == table.weight.shape
    t.run()
    _check_history(t.history, single64["history"], 1e-10)
    _cfg, model, state = load_trained_model(run)
    assert state["step"] == 6
    got, want = model.state_dict(), single64["model"].state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=0, atol=1e-6, msg=k)  # loaded as fp32


def _sharded(runs: dict[int, dict], world: int, run: str = "sharded64", step: int = 6) -> Path:
    return runs[world]["dir"] / run / "checkpoints" / f"step-{step:07d}"


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_checkpoint_files_hold_only_their_ranks_rows(runs, world):
    """--sharded-checkpoints: one engram-shards/rank-R file per owner rank holding exactly that rank's
    rows of every table and of its optimizer state, its header their ranges (W=3: owners 0 and 2, none
    from rank 1); model and optimizer files without table rows; state.json naming the run."""
    ckpt = _sharded(runs, world)
    state = json.loads((ckpt / "state.json").read_text())
    ranks = runs[world]["ranks"]
    full = ranks[0]["state64"]  # the step-6 model, gathered whole
    owners = SHARDED_OWNERS[world]
    writers = sorted(range(world) if owners is None else owners)
    assert sorted(p.name for p in (ckpt / SHARDS_FOLDER).iterdir()) == [shard_file(r) for r in writers]
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step-0000003", "step-0000006"]  # no .tmp-*
    assert state[SHARDS_KEY]["world"] == world and state[SHARDS_KEY]["optimizer"] == "SparseRowAdam"
    headers = {}
    for r in writers:
        with safe_open(str(ckpt / SHARDS_FOLDER / shard_file(r)), "pt") as f:
            headers[r] = json.loads(f.metadata()[HEADER_KEY])
        assert (headers[r]["run"], headers[r]["step"], headers[r]["rank"]) == (state[SHARDS_KEY]["run"], 6, r)
    layout = {e["name"]: e for e in headers[writers[0]]["tables"]}
    assert sorted(layout) == sorted(ranks[0]["sharded_rows"]) and len(layout) == 2
    dense = load_file(str(ckpt / "model.safetensors"))
    assert not any(f"{n}.weight" in dense for n in layout) and len(dense) == len(full) - 2
    assert not any(k.startswith("table.") for k in load_file(str(ckpt / "optimizer.safetensors")))
    for entry in layout.values():
        bounds = shard_bounds(entry["num_rows"], world, owners)
        for r in writers:
            (mine,) = (t for t in headers[r]["tables"] if t["name"] == entry["name"])
            assert (mine["lo"], mine["hi"]) == (bounds[r], bounds[r + 1])
            assert mine["fields"] == ["exp_avg", "exp_avg_sq_row", "step"]
    for r in range(world):
        for name, (lo, hi) in ranks[r]["sharded_rows"].items():  # the rows rank r owned
            if r not in writers:
                assert lo == hi
                continue
            got = load_file(str(ckpt / SHARDS_FOLDER / shard_file(r)))
            fields = layout[name]["fields"]
            mine = {k for k in got if k.startswith(f"{name}.")}
            assert mine == {f"{name}.weight"} | {f"{name}.optimizer.{f}" for f in fields}
            assert torch.equal(got[f"{name}.weight"], full[f"{name}.weight"][lo:hi])
            assert all(got[f"{name}.optimizer.{f}"].shape[0] == hi - lo for f in fields)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_checkpoint_run_and_exact_resume(runs, single64, world):
    """The run writing sharded checkpoints trains the single-process run (fp64, up to summation
    order), and its step-3 checkpoint resumed in the same world continues it bit for bit (losses,
    and every file of the step-6 checkpoint, which the resumed run writes sharded again)."""
    res = runs[world]["ranks"][0]
    _check_history(res["history64"], single64["history"], 1e-10)
    assert res["sharded_resumed_history64"] == res["history64"]
    a, b = _sharded(runs, world), _sharded(runs, world, "sharded64_resumed")
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*.safetensors"))
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*.safetensors")) and len(names) > 2
    for name in names:
        fa, fb = load_file(str(a / name)), load_file(str(b / name))
        assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa), name
    sa, sb = (json.loads((c / "state.json").read_text()) for c in (a, b))
    assert sa[SHARDS_KEY] == sb[SHARDS_KEY]


@pytest.mark.parametrize("world", WORLDS)
def test_damaged_shard_file_is_one_error_on_every_rank(runs, world):
    """A sharded checkpoint whose last shard file has a flipped data byte (read by its own rank only):
    resume_from raises the same ValueError on every rank, naming the file and its CRC32, instead of
    one rank failing and the others losing their peer in the next collective."""
    errors = [r["damaged_resume_error"] for r in runs[world]["ranks"]]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    last = (SHARDED_OWNERS[world] or range(world))[-1]
    assert (
        f"rank {last} of {world}: " in errors[0] and f"engram-shards/rank-{last:05d}.safetensors" in errors[0]
    )
    assert "has CRC32" in errors[0] and "was refused, on every rank" in errors[0]


def test_sharded_checkpoint_resumes_in_another_world(runs, single64):
    """W=2's step-3 sharded checkpoint (2 files) resumed by W=3 (every rank owning a third: ranges
    spanning the files' boundary) continues along the W=2 run; each rank reads its own rows only."""
    res = runs[3]["ranks"]
    sizes = {f"engrams.{i}.table": m.table.num_rows for i, m in single64["model"].engrams.items()}
    for r in range(3):
        own = {name: tuple(shard_bounds(n, 3)[r : r + 2]) for name, n in sizes.items()}
        assert res[r]["cross_rows"] == [hi - lo for lo, hi in own.values()]
        reads = res[r]["cross_reads"]  # weight and 3 optimizer states per table
        assert len(reads) == 4 * len(own) and all((lo, hi) == own[name] for name, lo, hi in reads), reads
    _check_history(res[0]["cross_history64"], runs[2]["ranks"][0]["history64"], 1e-10)
    _check_history(res[0]["cross_history64"], single64["history"], 1e-10)


def test_sharded_checkpoint_resumes_in_one_process(runs, cfg, data, single64, capsys):
    """A sharded checkpoint (W=3, owners 0 and 2) resumes in one Trainer with whole tables and
    optimizer state, along the single run; load_trained_model and `engram eval` read one too."""
    from engram.cli import main

    path = _sharded(runs, 3, step=3)
    t = Trainer(cfg, data, build_model(cfg.replace(seed=5), data).double())
    t.resume_from(path)
    assert t.step == 3
    for m in t.model.engrams.values():
        st = t.table_opt.state[m.table.weight]
        assert st["exp_avg"].shape == m.table.weight.shape and st["step"].shape == (m.table.num_rows,)
        assert int(st["step"].max()) >= 1
    t.run()
    _check_history(t.history, single64["history"], 1e-10)
    run = runs[2]["dir"] / "sharded64"
    _cfg, model, state = load_trained_model(run)
    assert state["step"] == 6 and SHARDS_KEY in state
    got, want = model.state_dict(), single64["model"].state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=0, atol=1e-6, msg=k)  # loaded as fp32
    assert main(["eval", "--checkpoint", str(run), "--json", *CPU]) == 0
    res = json.loads(capsys.readouterr().out)["results"]["model"]
    assert res["loss"] == pytest.approx(
        evaluate(model, data.held_out, data.held_rows, cfg.seq_len)["loss"], abs=1e-9
    )


def test_table_owners_must_agree(runs):
    for r in runs[2]["ranks"]:
        assert "sharded unlike another rank's" in r["owners_error"] and "--table-ranks" in r["owners_error"]


def test_ranks_must_agree_on_config_and_step(runs):
    for r in runs[2]["ranks"]:
        assert "training config differs from another rank's" in r["config_error"]
        assert "every rank must resume from the same checkpoint" in r["step_error"]


def test_ranks_must_agree_on_until_and_initial_model(runs):
    """Ranks given another `until` or initial model are refused on every rank before the first step
    (they would call different collectives and hang), naming what differs; ranks given another
    table init are not (a row is born from (seed, layer, row) either way: the same model)."""
    for r in runs[2]["ranks"]:
        assert "until (rank 0: 2, rank 1: 3)" in r["until_error"] and "same --until" in r["until_error"]
        assert r["until_steps"] == 0
        assert "initial model" in r["init_error"] and "--table-init" in r["init_error"], r["init_error"]
        assert r["mixed_init_error"] is None


def test_collective_timeout_names_rank_and_step(runs):
    """Rank 1 leaves step 2 before the gradient exchange: rank 0's collective times out (5 s group)
    into a RankError naming rank 0 and step 2, instead of waiting forever."""
    rank0, rank1 = runs[2]["ranks"]
    assert rank1["timeout_error"][0] == "_Stalled"
    kind, msg = rank0["timeout_error"]
    assert kind == "RankError" and msg.startswith("rank 0 failed in step 2 of 6: "), msg
    assert "Timed out" in msg and "--collective-timeout" in msg, msg
    assert rank0["timeout_seconds"] < 30


def test_eval_with_fewer_windows_than_ranks(runs, cfg, data):
    """2 held-out windows over 2 or 3 ranks: ranks without a window still join the exchange, and the
    result is one process's."""
    want = Trainer(cfg, data, build_model(cfg, data)).evaluate(max_tokens=2 * cfg.seq_len + 1)
    assert want["tokens"] == 2 * cfg.seq_len
    for world in WORLDS:
        got = runs[world]["ranks"][0]["few_windows_eval"]
        assert got["tokens"] == want["tokens"] and got["loss"] == pytest.approx(want["loss"], abs=1e-9)


def test_frozen_sharded_table_gets_no_gradient(runs):
    assert all(r["frozen_grad_is_none"] for r in runs[2]["ranks"])


def test_batch_size_must_split(runs):
    for world in WORLDS:
        err = runs[world]["ranks"][0]["batch_error"]
        assert f"batch_size=7 does not split evenly over {world} ranks" in err


def test_eval_reads_distributed_checkpoint(runs, capsys):
    from engram.cli import main

    run = runs[3]["dir"] / "run"
    _cfg, model, state = load_trained_model(run)
    assert (
        state["step"] == 6 and model.engrams["0"].table.weight.shape[0] == model.engrams["0"].table.num_rows
    )
    assert main(["eval", "--checkpoint", str(run), "--json", *CPU]) == 0
    res = json.loads(capsys.readouterr().out)["results"]["model"]
    assert res["loss"] == pytest.approx(runs[3]["ranks"][0]["history"][-1]["held_out_loss"], abs=0.2)


# ------------------------------------------------------------------------------------ torchrun
