"""engram.hf under the HF `Trainer` and `accelerate` across processes (torchrun, 2 and 3 gloo ranks)
against one process: a float64 tiny Llama with Engram, `prepare_data_parallel` on the bare model, then
`build_optimizer`, then the wrapper (the jobs: tests/hf_dist_job.py).

W ranks with micro-batches of B/W give every parameter, the tables included, the one-process run's
values with batch B (fp64: 1e-9): the Trainer with Adam or Sinkhorn tables, row-sharded or
replicated, gradient accumulation with a frozen backbone, peft LoRA; a manual `accelerate` loop with
`Accelerator(cpu=True)`. The ranks' micro-batches of a step are the one-process step's batch, DDP
ignores the tables, and accelerate sees the torchrun launch (MULTI_CPU, W processes).
The suite's torchrun launch of each world size runs these jobs with the other files' (tests/dist_launch.py:
a launch costs ~15 s of start-up here); every launch has a timeout, so a rank that hangs fails the test
instead of blocking the suite."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from unittest import mock

import pytest
import torch

import dist_launch as L
import hf_dist_job as J

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

TABLE = "engram.layers.1.table.weight"

# name -> (world size, the run); the runs of one world size share its launch. B = Run.batch.
RUNS: dict[str, tuple[int, J.Run]] = {
    "trainer-adam": (2, J.Run("trainer-adam")),  # default mode: row-sharded tables
    "trainer-sinkhorn-replicated": (2, J.Run("trainer-sinkhorn-replicated", table_optimizer="sinkhorn", mode="replicated")),
    "trainer-accum-frozen": (2, J.Run("trainer-accum-frozen", accum=2, freeze_backbone=True)),
    "trainer-lora-sinkhorn": (2, J.Run("trainer-lora-sinkhorn", lora=True, table_optimizer="sinkhorn")),
    "accelerate-sinkhorn": (2, J.Run("accelerate-sinkhorn", kind="accelerate", table_optimizer="sinkhorn")),
    "accelerate-accum-replicated": (2, J.Run("accelerate-accum-replicated", kind="accelerate", accum=2, mode="replicated")),
    "trainer-w3-sinkhorn": (3, J.Run("trainer-w3-sinkhorn", batch=6, table_optimizer="sinkhorn")),
    "accelerate-w3-replicated": (3, J.Run("accelerate-w3-replicated", kind="accelerate", batch=6, mode="replicated")),
}  # fmt: skip
# The Trainer's checkpoints with row-sharded tables (EngramShardsCallback): written by a 2-rank run,
# resumed on 2 ranks, on 3 and on 1 (torchrun, default mode: replicated) and in one plain process (the
# other launches run after the 2-rank one, in the same folder); resumed from a copy whose rank-1 file
# was damaged, removed, taken from another run or from a later step (its step edited).
CHECKPOINT_RUNS: dict[str, tuple[int, J.Run]] = {
    "trainer-ckpt": (2, J.Run("trainer-ckpt", table_optimizer="sinkhorn", batch=6, save_steps=1)),
    "trainer-ckpt-other": (2, J.Run("trainer-ckpt-other", table_optimizer="sinkhorn", batch=6, save_steps=1)),
    "trainer-resume-w2": (2, J.Run("trainer-resume-w2", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt")),
    "trainer-resume-nocb": (2, J.Run("trainer-resume-nocb", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt", callback=False)),
    "trainer-resume-w3": (3, J.Run("trainer-resume-w3", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt")),
    "trainer-resume-w1": (1, J.Run("trainer-resume-w1", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt")),
}  # fmt: skip
# damage -> what every rank's error must say (besides the file's name)
DAMAGED_RUNS: dict[str, tuple[int, J.Run]] = {
    d: (2, J.Run(f"trainer-resume-{d.split(':')[0]}", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt", damage=d))
    for d in ("flip", "missing", "foreign:trainer-ckpt-other", "later")
}  # fmt: skip


for _name, (_world, _run) in {**RUNS, **CHECKPOINT_RUNS, **DAMAGED_RUNS}.items():
    L.register(__name__, _world, _run.name, "hf_dist_job:job", **dataclasses.asdict(_run))


@pytest.fixture(scope="module")
def launched(dist_launch):
    """world -> the folder of the suite's launch with that many ranks (tests/dist_launch.py: the 2-rank
    one runs first, and the 3- and 1-rank runs resume its checkpoint there)."""
    return dist_launch


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """run -> the one-process result of `run`'s global batch (cached)."""
    out = tmp_path_factory.mktemp("hf-trainer-single")
    cache: dict[J.Run, dict] = {}

    def get(run: J.Run) -> dict:
        if run not in cache:
            cache[run] = _single(run, out)
        return cache[run]

    return get


def _single(run: J.Run, out: Path) -> dict:
    """`run`'s global batch in this process (no process group, no accumulation: one micro-batch of
    batch x accum a step): the Trainer's runs by the Trainer, accelerate's by a plain loop."""
    one = dataclasses.replace(
        run,
        name=run.name + "-single",
        kind="trainer" if run.kind == "trainer" else "loop",
        batch=run.batch * run.accum,
        accum=1,
        mode=None,
    )
    with mock.patch.object(LlamaRMSNorm, "forward", J.rms_norm_in_its_dtype):
        res = J.train(one, out)
    assert res["error"] is None
    return res


def _assert_states_equal(got: dict, want: dict, what: str, atol: float = 1e-9) -> None:
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{what}, {k}: {m}")


def _rows_by_step(seen: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for step, rows in seen:
        out.setdefault(step, []).extend(rows)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_one_process(launched, single, name):
    """Every rank's parameters (tables gathered whole on rank 0 when row-sharded; replicated tables
    on every rank) equal the one-process run's with the whole batch, to 1e-9 in float64; the tables
    trained; the ranks' micro-batches of each step are that step's batch; DDP ignored the table;
    accelerate (in the Trainer or by hand) saw the torchrun launch."""
    world, run = RUNS[name]
    out = launched(world)
    want = single(run)
    ranks = L.results(out, name)
    table = ("base_model.model." if run.lora else "") + TABLE
    mode = run.mode or "sharded"
    for rank, res in enumerate(ranks):
        assert res["error"] is None, res["error"]
        assert res["mode"] == mode
        launch = (res["distributed_type"], res["num_processes"], res["world_size"])
        assert launch == ("MULTI_CPU", world, world)
        assert res["wrapper"] == "DistributedDataParallel" and table in res["ignored"]
        assert [len(rows) for _, rows in res["seen"]] == [run.batch // world] * (J.STEPS * run.accum)
        keys = want["state"].keys() if rank == 0 or mode == "replicated" else want["state"].keys() - {table}
        assert res["state"].keys() == keys
        _assert_states_equal(res["state"], want["state"], f"rank {rank} of {world}")
    steps = [_rows_by_step(res["seen"]) for res in ranks]
    for step, rows in _rows_by_step(want["seen"]).items():  # the same sequences, split over the ranks
        assert sorted(r for by_step in steps for r in by_step[step]) == sorted(rows)
    assert not torch.equal(want["state"][table], J.build_model(run.lora).state_dict()[table])


@pytest.mark.parametrize("name", ["trainer-accum-frozen", "trainer-lora-sinkhorn"])
def test_frozen_backbone_moves_only_engram_and_adapters(launched, name):
    """freeze_backbone (and LoRA, which freezes it) across ranks: only Engram's parameters (and the
    adapters) moved, and each kind did: the table, Engram's projections, the LoRA weights."""
    world, run = RUNS[name]
    res = L.results(launched(world), name)[0]
    assert res["error"] is None, res["error"]
    before = J.build_model(run.lora).state_dict()
    moved = {k for k, v in res["state"].items() if not torch.equal(v, before[k])}
    assert all(".engram." in f".{k}" or "lora_" in k for k in moved), sorted(moved)
    assert any(k.endswith(TABLE) for k in moved) and any(k.endswith("wkv.weight") for k in moved)
    assert any("lora_" in k for k in moved) == run.lora


def test_one_process_trainer_is_the_plain_loop(single):
    """The references agree: the Trainer in one process with these arguments (constant LR, no
    clipping, our loss) takes the plain loop's steps, bit for bit."""
    trainer = single(RUNS["trainer-sinkhorn-replicated"][1])
    loop = single(RUNS["accelerate-sinkhorn"][1])
    assert trainer["seen"] == loop["seen"]
    _assert_states_equal(
        trainer["state"], loop["state"], "one-process Trainer against the plain loop", atol=0
    )


def test_trainer_checkpoints_resume_with_sharded_tables(launched, single):
    """A 2-rank Trainer run with row-sharded tables checkpoints every step (EngramShardsCallback: each
    rank's rows and their optimizer state in checkpoint-N/engram-shards/, no table in HF's
    model.safetensors); resumed from checkpoint-1 on 2 ranks it ends bit-exact where the uninterrupted
    run ends, on 3 ranks (rows redistributed, the same global batch) where one process ends (1e-9).
    Resumed without the callback, the first step refuses on every rank, naming it."""
    from safetensors import safe_open

    out = launched(3)
    ckpt = out / "trainer-ckpt-trainer" / "checkpoint-1"
    assert sorted(p.name for p in (ckpt / "engram-shards").iterdir()) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert TABLE not in names and any(k.startswith("engram.") for k in names)
    want = single(CHECKPOINT_RUNS["trainer-ckpt"][1])["state"]
    res = {
        n: L.results(out, n)
        for n, (w, _) in CHECKPOINT_RUNS.items()
        if w > 1  # the 1-rank launch: test_two_rank_checkpoint_resumes_on_one_process
    }
    for name in ("trainer-ckpt", "trainer-resume-w2", "trainer-resume-w3"):
        for rank, r in enumerate(res[name]):
            assert r["error"] is None, r["error"]
            _assert_states_equal(r["state"], want, f"{name}, rank {rank}")
        assert TABLE in res[name][0]["state"]
    assert torch.equal(res["trainer-resume-w2"][0]["state"][TABLE], res["trainer-ckpt"][0]["state"][TABLE])
    assert [s for s, _ in res["trainer-resume-w3"][0]["seen"]] == [1, 2]  # it did resume after step 1
    for r in res["trainer-resume-nocb"]:
        assert "were not read back" in r["error"] and "EngramShardsCallback" in r["error"]


def test_one_process_trainer_checkpoint_resumes_bit_exact(tmp_path):
    """One process (no process group): the Trainer's checkpoint holds the whole table and its
    optimizer state, and resume_from_checkpoint ends bit-exact where the uninterrupted run ends."""
    whole = J.Run("one-ckpt", table_optimizer="sinkhorn", batch=6, save_steps=1)
    resumed = J.Run("one-resume", table_optimizer="sinkhorn", batch=6, resume="one-ckpt")
    with mock.patch.object(LlamaRMSNorm, "forward", J.rms_norm_in_its_dtype):
        a = J.train(whole, tmp_path)
        b = J.train(resumed, tmp_path)
    assert a["error"] is None and b["error"] is None
    assert [s for s, _ in b["seen"]] == [1, 2]
    _assert_states_equal(b["state"], a["state"], "resumed in one process", atol=0)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("flip", "rank 1 of 2: .*/rank-00001.safetensors: tensor .* has CRC32 [0-9a-f]{8}, its header records"),
        ("missing", "rows \\[\\d+, \\d+\\) of table 'layers.1.table' are in no shard file .*a rank's file is missing"),
        ("foreign:trainer-ckpt-other", "/rank-00001.safetensors does not belong to this checkpoint: its run is '[0-9a-f]+', the checkpoint's is '[0-9a-f]+' \\(a file copied from another run\\)"),
        ("later", "/rank-00001.safetensors: its shard header does not match its seal"),
    ],
)  # fmt: skip
def test_damaged_or_foreign_rank_file_refused_on_every_rank(launched, damage, says):
    """Resumed on 2 ranks from a copy of a 2-rank checkpoint whose rank-1 shard file had a data byte
    flipped (read, so seen, by rank 1 only), was removed, was copied from another run at the same step,
    or was the same run's next step's with its step edited: every rank raises the same ValueError, naming
    the file (and the run ids), before any step and before any collective a peer could have left."""
    out = launched(2)
    _, run = DAMAGED_RUNS[damage]
    errors = [r["error"] for r in L.results(out, run.name)]
    last = [e.strip().splitlines()[-1] for e in errors]
    assert last[0] == last[1], last
    assert (
        last[0].startswith("ValueError: resuming the Engram tables from ")
        and "refused, on every rank" in last[0]
    )
    assert re.search(says, last[0]), last[0]
    assert not any("Connection closed" in e or "RankError" in e for e in errors)


def test_two_rank_checkpoint_resumes_on_one_process(launched, single, tmp_path):
    """Item 5: the 2-rank checkpoint-1 resumed by one process, with no process group (the Trainer alone)
    and under torchrun --nproc_per_node 1 in the default mode (replicated tables): each reads every row
    of both rank files (the table optimizer a plain SparseSinkhorn) and ends where the uninterrupted run
    ends (fp64, 1e-9)."""
    out = launched(1)
    want = single(CHECKPOINT_RUNS["trainer-ckpt"][1])["state"]
    (w1,) = L.results(out, "trainer-resume-w1")
    assert w1["error"] is None, w1["error"]
    assert w1["mode"] == "replicated" and w1["world_size"] == 1
    assert [s for s, _ in w1["seen"]] == [1, 2]
    _assert_states_equal(w1["state"], want, "resumed under torchrun --nproc_per_node 1")
    plain = J.Run("trainer-resume-plain", table_optimizer="sinkhorn", batch=6, resume="trainer-ckpt")
    with mock.patch.object(LlamaRMSNorm, "forward", J.rms_norm_in_its_dtype):
        res = J.train(plain, out)
    assert res["error"] is None and [s for s, _ in res["seen"]] == [1, 2]
    assert res["state"].keys() == want.keys()
    _assert_states_equal(res["state"], want, "resumed in one plain process")
