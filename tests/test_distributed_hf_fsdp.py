"""engram.hf under FSDP2 (`torch.distributed.fsdp.fully_shard`) on 2 gloo ranks against one process:
the tiny float64 Llama with Engram of tests/test_distributed_hf.py, its backbone sharded by
`engram.distributed.hf.fsdp.fully_shard_backbone` (each decoder layer, then the root, the Engram
tables as `ignored_params`), a global batch of 6 as 2 x 3 against 1 x 6, 3 steps of `build_optimizer`.
Every parameter, gathered (`DTensor.full_tensor()`), and the tables equal the one-process run
(fp64: 1e-9; reached: ~1e-13), for both table modes (replicated, row-sharded) and the adam and
sinkhorn table optimizers: Engram's layer hooks run inside FSDP's units, its dense weights shard with
the root, AdamW steps DTensor shards, and the tables stay plain parameters that Engram keeps one
table. Without a table mode (a plain fully_shard) the EngramOptimizer refuses; a torch without
FSDP2's ignored_params is refused with an error naming DDP. The four runs are jobs of the suite's
2-rank launch (tests/dist_launch.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import dist_launch as L
import test_distributed_hf as D
from engram.distributed.hf.fsdp import fully_shard_backbone
from engram.hf import build_optimizer

WORLD = 2
TABLE = "engram.layers.1.table.weight"
WKV = "engram.layers.1.wkv.weight"


def _job(ctx, mode: str, table_optimizer: str, extra: bool) -> dict:
    """One run on both ranks of the suite's 2-rank launch (tests/dist_launch.py): 3 FSDP2 steps, then
    (`extra`) the refusals that need a process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engram.distributed import prepare_data_parallel

    LlamaRMSNorm.forward = D._rms_norm_in_its_dtype  # this process only
    rank = dist.get_rank()
    model = fully_shard_backbone(D._model(), mode=mode)
    opt = build_optimizer(model, lr=1e-2, table_lr=5e-2, table_optimizer=table_optimizer)
    local = D.BATCH // WORLD
    for batch in D._batches(model):
        part = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
        D._step_loss(model, part).backward()
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    sync = model.engram.table_sync
    if mode == "sharded":  # the whole table, gathered on rank 0 (a collective)
        full = sync.tables[0].full_weight(0)
        if full is not None:
            state[TABLE] = full
    res: dict = {
        "mode": sync.mode.value,
        "state": state,
        "plain": sorted(n for n, p in params.items() if not isinstance(p, DTensor)),
        "table_rows": params[TABLE].shape[0],
        "wkv_local_rows": params[WKV].to_local().shape[0],
    }
    if extra:
        try:
            fully_shard_backbone(model)
        except ValueError as e:
            res["again"] = str(e)
        other = D._model()
        prepare_data_parallel(other, "sharded")
        try:
            fully_shard_backbone(other, mode="replicated")
        except ValueError as e:
            res["other_mode"] = str(e)
        bare = D._model()  # sharded by hand, tables ignored, but no table mode
        for layer in bare.model.layers:
            fully_shard(layer)
        fully_shard(bare, ignored_params=set(bare.engram.tables()))
        opt = build_optimizer(bare, lr=1e-2, table_lr=5e-2)
        batch = D._batches(bare)[0]
        D._step_loss(bare, {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}).backward()
        try:
            opt.step()
        except RuntimeError as e:
            res["unsynced"] = str(e)
    return res


MODES = ("replicated", "sharded")
for _mode in MODES:
    for _opt in D.OPTIMIZERS:
        L.register(
            __name__, WORLD, f"fsdp-{_mode}-{_opt}", "test_distributed_hf_fsdp:_job",
            mode=_mode, table_optimizer=_opt, extra=(_mode, _opt) == ("replicated", "adam"),
        )  # fmt: skip


@pytest.mark.parametrize("table_optimizer", D.OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_loop_equals_one_process(dist_launch, mode, table_optimizer):
    """2 FSDP2 ranks (backbone sharded, tables in Engram's mode) train exactly like one process: every
    gathered dense parameter and the table within 1e-9 in float64, the table being the only parameter
    left a plain tensor (whole, or its rows split over the ranks), the Engram dense weights really
    sharded. With the first run, the refusals that need a process group: sharding twice, a mode other
    than the one the model was prepared with, a hand-made fully_shard without a table mode."""
    assert D.BATCH % WORLD == 0
    want = D._single(table_optimizer)
    extra = (mode, table_optimizer) == ("replicated", "adam")
    ranks = L.results(dist_launch(WORLD), f"fsdp-{mode}-{table_optimizer}")
    rows = want[TABLE].shape[0]
    for rank, res in enumerate(ranks):
        assert res["mode"] == mode
        assert res["plain"] == [TABLE]  # everything else is a DTensor shard; the table is Engram's
        keys = want.keys() if mode == "replicated" or rank == 0 else want.keys() - {TABLE}
        assert res["state"].keys() == keys
        for k in keys:
            torch.testing.assert_close(
                res["state"][k], want[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}"
            )
        if extra:
            assert "sharded with fully_shard already" in res["again"]
            assert "prepared with mode 'sharded' already, not 'replicated'" in res["other_mode"]
            assert "prepare_data_parallel" in res["unsynced"]
            assert "each rank would train its own table" in res["unsynced"]
    table_rows = [r["table_rows"] for r in ranks]
    assert table_rows == ([rows] * WORLD if mode == "replicated" else [rows // 2, rows - rows // 2])
    assert sum(r["wkv_local_rows"] for r in ranks) == want[WKV].shape[0] > ranks[0]["wkv_local_rows"]
    fresh = D._model().state_dict()
    assert not torch.equal(want[TABLE], fresh[TABLE])  # the table did train
    assert not torch.equal(want[WKV], fresh[WKV])  # so did Engram's dense weights


def _fully_shard_without_ignored_params(module, *, mesh=None, reshard_after_forward=None):
    raise AssertionError("must not be called")


@pytest.mark.parametrize("fsdp2", ["missing", "no ignored_params"])
def test_torch_without_fsdp2_ignored_params_is_refused_naming_ddp(monkeypatch, fsdp2):
    """Where this torch's FSDP2 cannot keep the tables out (no fully_shard, or one without
    ignored_params) the call refuses, before touching the model, and names DDP as what works."""
    from torch.distributed import fsdp

    if fsdp2 == "missing":
        monkeypatch.delattr(fsdp, "fully_shard")
    else:
        monkeypatch.setattr(fsdp, "fully_shard", _fully_shard_without_ignored_params)
        assert "ignored_params" not in inspect.signature(fsdp.fully_shard).parameters
    model = D._model()
    with pytest.raises(RuntimeError) as e:
        fully_shard_backbone(model)
    msg = str(e.value)
    assert "prepare_data_parallel(model)" in msg and "DistributedDataParallel" in msg and "Trainer" in msg
    assert ("no FSDP2" if fsdp2 == "missing" else "has no ignored_params") in msg
    assert model.engram.table_sync is None


def test_needs_a_process_group():
    """Without torch.distributed initialised, fully_shard_backbone says to launch with torchrun."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        fully_shard_backbone(D._model())
