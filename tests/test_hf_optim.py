"""engram.hf.EngramOptimizer refuses before it changes anything: a load whose table part is bad leaves
the dense state as it was (every part checked before any is replaced), a refused step leaves every
parameter bit-identical (every refusal before the dense AdamW step), and after a load an LR scheduler
still reaches both optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_setup as S
from engram.hf import EngramCollator, add_engram, build_optimizer

transformers = pytest.importorskip("transformers")

NAN = float("nan")


@pytest.fixture(scope="module")
def batch():
    model = _model()
    return EngramCollator(model, pad_token_id=0)(
        [{"input_ids": S.batch(1, 12, seed=100 + i)[0].tolist()} for i in range(2)]
    )


def _model():
    return add_engram(S.llama(), S.engram_config((1,)), compression=S.compression())


def _trained(table_optimizer: str, batch, steps: int = 1):
    model = _model()
    opt = build_optimizer(model, lr=1e-3, table_lr=1e-2, table_optimizer=table_optimizer)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _tensors(sd) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path (plus the non-tensor leaves' reprs)."""
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, list | tuple) and not all(isinstance(v, int | float) for v in x):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        else:
            out[path] = x.clone() if isinstance(x, torch.Tensor) else repr(x)

    walk(sd, "")
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def _dense_step(opt) -> None:
    for p in opt.dense.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.dense.step()
    opt.dense.zero_grad()


def _bad_lr(sd):
    sd["tables"]["param_groups"][0]["lr"] = NAN


def _unknown_id(sd):
    sd["tables"]["state"] = {5: sd["tables"]["state"][0]}


def _misshaped(sd):  # refused by the old code too, but after the dense state was replaced
    entry = sd["tables"]["state"][0]
    key = next(k for k, v in entry.items() if v.dim() == 2)
    entry[key] = entry[key][:, :3]


def _tensor_entry(sd):
    sd["tables"]["state"][0] = torch.zeros(3)


@pytest.mark.parametrize("table_optimizer", ["adam", "sinkhorn"])
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_bad_lr, r"saved param group 0: lr must be a finite number .* got nan"),
        (_unknown_id, r"holds parameter 5 \(int\), which no saved param group lists"),
        (_tensor_entry, r"saved state of parameter 0 is a Tensor"),
        (_misshaped, r"has shape \(\d+, 3\).*does the table size match\?"),
    ],
)
def test_refused_load_leaves_the_dense_state_unchanged(batch, table_optimizer, damage, match):
    """The table part is checked before the dense state is replaced (it used to be replaced first)."""
    _, opt = _trained(table_optimizer, batch)
    saved = copy.deepcopy(opt.state_dict())  # after step 1
    bad = copy.deepcopy(saved)
    damage(bad)
    _dense_step(opt)  # the state now differs from the saved one, so a replaced dense part would show
    before = _tensors(opt.state_dict())
    assert not torch.equal(before["/dense/state/0/exp_avg"], _tensors(saved)["/dense/state/0/exp_avg"])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    _assert_same(_tensors(opt.state_dict()), before)
    opt.load_state_dict(saved)  # the intact one loads
    _assert_same(_tensors(opt.state_dict()), _tensors(saved))


@pytest.mark.parametrize("table_optimizer", ["adam", "adagrad", "sinkhorn"])
def test_unsynchronised_step_refused_before_any_parameter_moves(batch, table_optimizer, monkeypatch):
    """One of 2 processes without prepare_data_parallel: refused, and embed_tokens (the dense AdamW
    step's) and every other parameter bit-identical (the dense step used to run first: 3e-4 moved)."""
    import torch.distributed as dist

    model, opt = _trained(table_optimizer, batch)
    model(**batch).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _tensors(opt.state_dict())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(
        RuntimeError, match=r"tables are not synchronised .* Call engram\.distributed\.prepare_data_parallel"
    ):
        opt.step()
    monkeypatch.undo()
    assert "model.embed_tokens.weight" in before
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    _assert_same(_tensors(opt.state_dict()), state)
    assert not opt.pending


def test_refused_table_gradient_moves_no_dense_parameter(batch):
    """A NaN in the tables' gradient (SparseSinkhorn refuses it) is found before the dense step."""
    model, opt = _trained("sinkhorn", batch)
    model(**batch).loss.backward()
    ((table, g),) = opt.pending.items()
    g = g.coalesce()
    values = g.values().clone()
    values[0, 0] = NAN
    opt.pending[table] = torch.sparse_coo_tensor(g.indices(), values, g.shape)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("table_optimizer", ["adam", "sinkhorn"])
def test_lr_scheduler_reaches_both_optimizers_after_a_load(batch, table_optimizer):
    """A load replaces the inner optimizers' group dicts; EngramOptimizer's groups follow them (they
    used to keep the old dicts, so a scheduler built after a resume changed no learning rate)."""
    _, opt = _trained(table_optimizer, batch)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert opt.dense.param_groups[0]["lr"] == 0.5e-3
    assert opt.tables.param_groups[0]["lr"] == 0.5e-2
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5e-3, 0.5e-2]


def test_sharded_table_part_checked_before_the_dense_state_is_replaced(batch):
    """Across processes the table part is the sync's (its rows are in shard files): a whole-table part,
    or hyperparameters the constructor refuses, are refused before anything is replaced."""
    from engram.distributed import SHARDED_STATE_KEY
    from engram.distributed.hf.data_parallel import ShardedTableSync

    _, opt = _trained("adam", batch)
    whole = copy.deepcopy(opt.state_dict())
    sync = ShardedTableSync.__new__(ShardedTableSync)  # its state-dict half only: no process group here
    sync.optimizer, sync.run, sync.steps, sync.restore = opt.tables, "this-run", 1, None
    opt.attachment = type("Att", (), {"table_sync": sync})()
    sharded = copy.deepcopy(whole)
    sharded["tables"] = {
        SHARDED_STATE_KEY: {"world": 2, "num_rows": [1], "run": "another-run", "steps": 1},
        "param_groups": sharded["tables"]["param_groups"],
    }
    _dense_step(opt)
    before = _tensors(opt.dense.state_dict())
    with pytest.raises(ValueError, match="holds whole tables"):
        opt.load_state_dict(whole)
    bad = copy.deepcopy(sharded)
    bad["tables"]["param_groups"][0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"saved param group 0: betas\[1\] must be .* got 1.5"):
        opt.load_state_dict(bad)
    _assert_same(_tensors(opt.dense.state_dict()), before)
    assert sync.restore is None
    opt.load_state_dict(sharded)  # the intact one: a resume, its rows to come from the shard files
    assert sync.restore is sharded["tables"]


INF = float("inf")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": INF}, "lr"),
        ({"lr": NAN}, "lr"),
        ({"lr": 0.0}, "lr"),
        ({"table_lr": INF}, "table_lr"),
        ({"table_lr": -1.0}, "table_lr"),
        ({"weight_decay": INF}, "weight_decay"),
        ({"weight_decay": NAN}, "weight_decay"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"table_weight_decay": INF}, "table_weight_decay"),
        ({"betas": (0.9, INF)}, r"betas\[1\]"),
        ({"betas": (NAN, 0.999)}, r"betas\[0\]"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
    ],
)
def test_rates_and_decays_must_be_finite(kwargs, name):
    """lr=inf was accepted and one step left 276 parameters NaN/Inf: every rate and decay is refused
    unless finite (rates > 0, decays >= 0, betas in [0, 1)), before the model's parameters change."""
    model = _model()
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"build_optimizer: {name} must be a finite number"):
        build_optimizer(model, freeze_backbone=True, **kwargs)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
