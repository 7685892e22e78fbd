"""Loading a table optimizer's saved state (SparseRowAdam, SparseRowAdagrad, SparseSinkhorn): the saved
hyperparameters are checked exactly as constructor arguments are (the same check, the same message
but for the group's name), and a state of unknown parameter ids, a tensor where a dict belongs or
state of the wrong dtype, shape or values is refused by name; a refused load changes nothing."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn

NAN = float("nan")
ROWS, DIM = 20, 8


def _stepped(cls: type) -> tuple[torch.optim.Optimizer, nn.Parameter]:
    """An optimizer of `cls` over one table, after one step on rows 3 and 11."""
    p = nn.Parameter(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    opt = cls([p], lr=0.01)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[3, 11]]), torch.ones(2, DIM), (ROWS, DIM))
    opt.step()
    p.grad = None
    return opt, p


def _snapshot(opt: torch.optim.Optimizer) -> tuple[list[dict], dict]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return groups, state


def _assert_unchanged(opt: torch.optim.Optimizer, before: tuple[list[dict], dict]) -> None:
    groups, state = _snapshot(opt)
    assert repr(groups) == repr(before[0])  # repr: NaN != NaN
    assert state.keys() == before[1].keys()
    for pid, st in state.items():
        assert st.keys() == before[1][pid].keys()
        for k, v in st.items():
            assert torch.equal(v, before[1][pid][k]), k


def _with_group(sd: dict, **changes) -> dict:
    sd = copy.deepcopy(sd)
    sd["param_groups"][0].update(changes)
    return sd


# ------------------------------------------------------------------------------ item 6: hyperparameters

BAD_HYPERPARAMETERS = [
    (SparseSinkhorn, "lr", NAN),
    (SparseSinkhorn, "beta", NAN),
    (SparseSinkhorn, "lr_correction", NAN),
    (SparseSinkhorn, "lr", -1.0),
    (SparseSinkhorn, "beta", 1.5),
    (SparseSinkhorn, "iterations", 0),
    (SparseSinkhorn, "iterations", 4),
    (SparseSinkhorn, "tau", -1.0),
    (SparseSinkhorn, "eps", 0.0),
    (SparseSinkhorn, "lr", "x"),
    (SparseRowAdam, "lr", NAN),
    (SparseRowAdam, "lr", -1.0),
    (SparseRowAdam, "lr", "x"),
    (SparseRowAdam, "betas", (0.9, 1.5)),
    (SparseRowAdam, "betas", (NAN, 0.9)),
    (SparseRowAdam, "betas", "x"),
    (SparseRowAdam, "eps", 0.0),
    (SparseRowAdam, "weight_decay", -1.0),
    (SparseRowAdagrad, "lr", NAN),
    (SparseRowAdagrad, "lr", "x"),
    (SparseRowAdagrad, "eps", -1.0),
    (SparseRowAdagrad, "initial_accumulator_value", NAN),
]


@pytest.mark.parametrize(("cls", "key", "value"), BAD_HYPERPARAMETERS, ids=lambda x: repr(x))
def test_saved_hyperparameters_checked_as_constructor_arguments(cls, key, value):
    """The load refuses what the constructor refuses, with the constructor's message naming the saved
    group (the key, the value and the allowed range); the optimizer is left as it was."""
    with pytest.raises(ValueError) as made:
        cls([nn.Parameter(torch.zeros(ROWS, DIM))], **{key: value})
    opt, _ = _stepped(cls)
    before = _snapshot(opt)
    with pytest.raises(ValueError) as loaded:
        opt.load_state_dict(_with_group(opt.state_dict(), **{key: value}))
    assert str(made.value).startswith("param group 0: ")
    assert str(loaded.value) == "saved " + str(made.value)
    assert key in str(loaded.value) and (repr(value) in str(loaded.value) or key == "betas")
    _assert_unchanged(opt, before)
    with pytest.raises(ValueError, match=re.escape(str(loaded.value))):  # checked without loading too
        opt.check_state_dict(_with_group(opt.state_dict(), **{key: value}))


def test_adagrad_eps_and_accumulator_both_zero_refused_at_load():
    opt, _ = _stepped(SparseRowAdagrad)
    with pytest.raises(ValueError, match="saved param group 0: eps and initial_accumulator_value are both 0"):
        opt.load_state_dict(_with_group(opt.state_dict(), eps=0.0, initial_accumulator_value=0.0))


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
def test_a_saved_group_without_a_hyperparameter_refused(cls):
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    del sd["param_groups"][0]["lr"]
    with pytest.raises(
        ValueError, match=rf"saved param group 0 has no lr: .*another optimizer, not {cls.__name__}"
    ):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
def test_nan_lr_would_have_turned_the_table_nan(cls):
    """What the check prevents: a NaN lr loaded, the table NaN after one step (the old behaviour)."""
    opt, p = _stepped(cls)
    opt.load_state_dict(opt.state_dict())  # a good state loads and steps
    p.grad = torch.sparse_coo_tensor(torch.tensor([[3]]), torch.ones(1, DIM), (ROWS, DIM))
    opt.step()
    assert torch.isfinite(p.detach()).all()
    with pytest.raises(ValueError, match="lr must be a finite number"):
        opt.load_state_dict(_with_group(opt.state_dict(), lr=NAN))


# ------------------------------------------------------------------------------ item 7: the state itself


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize("key", [5, "0", 0.0, True])
def test_state_of_an_unknown_parameter_id_refused(cls, key):
    """{5: ...} or {'0': ...} used to load and drop every active row; refused, naming the key."""
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    sd["state"] = {key: sd["state"][0]}
    before = _snapshot(opt)
    with pytest.raises(
        ValueError,
        match=rf"holds parameter {re.escape(repr(key))} \({type(key).__name__}\), which no saved param group lists \(they list \[0\]\)",
    ):
        opt.load_state_dict(sd)
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
def test_an_intact_state_loads_equal(cls):
    opt, p = _stepped(cls)
    fresh = cls([nn.Parameter(p.detach().clone())], lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    q = fresh.param_groups[0]["params"][0]
    for k, v in opt.state[p].items():
        assert torch.equal(fresh.state[q][k], v)


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
def test_a_tensor_where_the_state_dict_belongs_refused(cls):
    """Used to fail inside our own check ("Boolean value of Tensor ... is ambiguous")."""
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    sd["state"][0] = torch.zeros(2, DIM)
    with pytest.raises(
        ValueError, match=rf"saved state of parameter 0 is a Tensor, {cls.__name__} keeps a dict of"
    ):
        opt.load_state_dict(sd)


@pytest.mark.parametrize(
    ("cls", "key"),
    [(SparseSinkhorn, "momentum"), (SparseRowAdam, "exp_avg"), (SparseRowAdagrad, "sum_row")],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.bool])
def test_momentum_of_another_dtype_reported_as_a_dtype_problem(cls, key, dtype):
    """Not as a shape mismatch ("has shape (2, 8) ... needs (2, 8)"): the dtype found and the one kept."""
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    sd["state"][0] = dict(sd["state"][0]) | {key: sd["state"][0][key].to(dtype)}
    with pytest.raises(
        ValueError,
        match=rf"saved state '{key}' of parameter 0 has dtype {dtype}, {cls.__name__} keeps it as torch.float32",
    ):
        opt.load_state_dict(sd)


@pytest.mark.parametrize(
    ("cls", "key", "bad", "what"),
    [
        (SparseSinkhorn, "momentum", NAN, "NaN or Inf at its entry 1 \\(row 11\\)"),
        (SparseRowAdam, "exp_avg", float("inf"), "NaN or Inf at row 11"),
        (SparseRowAdam, "exp_avg_sq_row", -1.0, "NaN, Inf or a negative value at row 11"),
        (SparseRowAdam, "step", -1, "NaN, Inf or a negative value at row 11"),
        (SparseRowAdagrad, "sum_row", NAN, "NaN, Inf or a negative value at row 11"),
    ],
)
def test_state_values_that_would_poison_the_table_refused(cls, key, bad, what):
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    value = sd["state"][0][key].clone()
    value[-1 if cls is SparseSinkhorn else 11] = bad
    sd["state"][0] = dict(sd["state"][0]) | {key: value}
    before = _snapshot(opt)
    with pytest.raises(
        ValueError, match=rf"saved state '{key}' of parameter 0 holds {what}: a damaged state"
    ):
        opt.load_state_dict(sd)
    _assert_unchanged(opt, before)


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
def test_a_state_entry_that_is_not_a_tensor_refused(cls):
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    key = next(iter(sd["state"][0]))
    sd["state"][0] = dict(sd["state"][0]) | {key: [1, 2]}
    with pytest.raises(ValueError, match=rf"saved state '{key}' of parameter 0 is a list, not a tensor"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("cls", [SparseSinkhorn, SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "has 2 param groups, this .* 1"),
        (lambda sd: sd["param_groups"][0].update(params=[0, 1]), "saved param group 0 has 2 parameters"),
        (
            lambda sd: sd["param_groups"][0].update(params=["0"]),
            "lists parameter id '0' \\(str\\), not an int",
        ),
        (lambda sd: sd.update(state=[]), "not an optimizer state_dict"),
    ],
)
def test_damaged_param_groups_refused(cls, change, match):
    opt, _ = _stepped(cls)
    sd = opt.state_dict()
    change(sd)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)


def test_sinkhorn_row_state_of_another_table_size_refused():
    """The per-row form (training checkpoints) used to load a momentum of fewer rows as if it fitted."""
    opt, p = _stepped(SparseSinkhorn)
    rsd = opt.row_state_dict()
    rsd["state"][0] = {"momentum": rsd["state"][0]["momentum"][:15]}
    with pytest.raises(
        ValueError, match=r"per-row state 'momentum' of parameter 0 has shape \(15, 8\), the table \(20, 8\)"
    ):
        opt.load_row_state_dict(rsd)
    rsd = opt.row_state_dict()
    rsd["param_groups"][0]["beta"] = 1.5
    with pytest.raises(ValueError, match=r"saved param group 0: beta must be .* < 1.0, got 1.5"):
        opt.load_row_state_dict(rsd)
    opt.load_row_state_dict(opt.row_state_dict())  # the intact one loads
    assert torch.equal(opt.state[p]["rows"], torch.tensor([3, 11]))
