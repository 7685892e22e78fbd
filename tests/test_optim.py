"""Tests for engram.model.optim: SparseRowAdam / SparseRowAdagrad against plain per-row references.

The references below are written from the docstrings' update rules: a Python loop over the rows a
step touches (repeated ids summed first), float64 throughout, one step count per row (lazy: an
untouched row's state is left as it is). fp64 tables must match them to 1e-12, fp32 tables to
float32 rounding (rtol 1e-5), bf16 tables to one bf16 rounding of the weights.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engram.model.optim import SparseRowAdagrad, SparseRowAdam, split_param_groups
from engram.model.table import TrainableTable

# ------------------------------------------------------------------------------------------- reference


def summed_rows(rows: list[int], values: torch.Tensor) -> dict[int, torch.Tensor]:
    """{row: sum of its gradient rows} in float64 (what coalescing a sparse gradient gives)."""
    out: dict[int, torch.Tensor] = {}
    for i, r in enumerate(rows):
        out[r] = out.get(r, 0) + values[i].double()
    return out


def ref_adam(w0: torch.Tensor, steps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, round_to=None):
    """Per-row loop over each step's touched rows; `round_to` rounds the written rows (bf16 tables)."""
    w = w0.double().clone()
    num_rows, dim = w.shape
    b1, b2 = betas
    m = torch.zeros(num_rows, dim, dtype=torch.float64)
    v = [0.0] * num_rows
    t = [0] * num_rows
    for rows, values in steps:
        for r, g in summed_rows(rows, values).items():
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * float((g * g).mean())
            t[r] += 1
            m_hat = m[r] / (1 - b1 ** t[r])
            v_hat = v[r] / (1 - b2 ** t[r])
            w[r] = w[r] - lr * (m_hat / (math.sqrt(v_hat) + eps) + weight_decay * w[r])
            if round_to is not None:
                w[r] = w[r].to(round_to).double()
    return w, m, torch.tensor(v, dtype=torch.float64), torch.tensor(t, dtype=torch.int32)


def ref_adagrad(w0: torch.Tensor, steps, lr=1e-2, eps=1e-10, initial_accumulator_value=0.0):
    w = w0.double().clone()
    acc = [float(initial_accumulator_value)] * w.shape[0]
    for rows, values in steps:
        for r, g in summed_rows(rows, values).items():
            acc[r] += float((g * g).mean())
            w[r] = w[r] - lr * g / (math.sqrt(acc[r]) + eps)
    return w, torch.tensor(acc, dtype=torch.float64)


# --------------------------------------------------------------------------------------------- helpers


def sparse_grad(rows: list[int], values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """An uncoalesced sparse COO gradient: one entry per listed row, repeats kept."""
    idx = torch.tensor(rows, dtype=torch.int64).reshape(1, -1)
    return torch.sparse_coo_tensor(idx, values, shape, check_invariants=True)


def run_steps(opt: torch.optim.Optimizer, p: torch.Tensor, steps) -> None:
    for rows, values in steps:
        p.grad = sparse_grad(rows, values.to(p.dtype), tuple(p.shape))
        opt.step()


def make_steps(dim: int, touched: list[list[int]], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(rows, torch.randn(len(rows), dim, generator=gen, dtype=torch.float64)) for rows in touched]


# Row 2 is touched at steps 1 and 3 but not 2 (lazy semantics); row 4 is repeated within step 2;
# rows 1, 6, 7 are never touched.
TOUCHED = [[2, 0, 5], [4, 3, 4, 0], [2, 3], [5, 0, 4, 4, 4]]
NUM_ROWS, DIM = 8, 6
HP = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}


def table(dtype: torch.dtype = torch.float64, num_rows: int = NUM_ROWS, dim: int = DIM) -> nn.Parameter:
    gen = torch.Generator().manual_seed(1)
    return nn.Parameter(torch.randn(num_rows, dim, generator=gen, dtype=torch.float64).to(dtype))


# ------------------------------------------------------------------------------------------ update rule


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_adam_matches_reference(dtype, tol):
    p = table(dtype)
    w0 = p.detach().clone()
    steps = make_steps(DIM, TOUCHED)
    opt = SparseRowAdam([p], **HP)
    run_steps(opt, p, steps)
    w, m, v, t = ref_adam(w0, steps, **HP)
    torch.testing.assert_close(p.detach().double(), w, rtol=tol, atol=tol)
    state = opt.state[p]
    torch.testing.assert_close(state["exp_avg"].double(), m, rtol=tol, atol=tol)
    torch.testing.assert_close(state["exp_avg_sq_row"].double(), v, rtol=tol, atol=tol)
    assert torch.equal(state["step"], t)
    assert state["step"].tolist() == [3, 0, 2, 2, 2, 2, 0, 0]


@pytest.mark.parametrize("initial_accumulator_value", [0.0, 0.5])
def test_adagrad_matches_reference(initial_accumulator_value):
    p = table()
    w0 = p.detach().clone()
    steps = make_steps(DIM, TOUCHED)
    hp = {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": initial_accumulator_value}
    opt = SparseRowAdagrad([p], **hp)
    run_steps(opt, p, steps)
    w, acc = ref_adagrad(w0, steps, **hp)
    torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.state[p]["sum_row"], acc, rtol=1e-12, atol=1e-12)


def test_adam_is_lazy():
    """A row skipped by a step keeps its weight and its state bit for bit (nothing decays)."""
    p = table(torch.float32)
    steps = make_steps(DIM, TOUCHED)
    opt = SparseRowAdam([p], **HP)
    run_steps(opt, p, steps[:1])
    before = {k: v[2].clone() for k, v in opt.state[p].items()}
    w_before = p.detach()[2].clone()
    run_steps(opt, p, steps[1:2])  # step 2 does not touch row 2
    for k, v in opt.state[p].items():
        assert torch.equal(v[2], before[k]), k
    assert torch.equal(p.detach()[2], w_before)
    run_steps(opt, p, steps[2:3])  # step 3 does: its bias correction uses t = 2, not 3
    assert int(opt.state[p]["step"][2]) == 2


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untouched_rows_bit_identical(opt_cls, dtype):
    p = table(dtype, num_rows=64)
    w0 = p.detach().clone()
    hp = {"weight_decay": 0.5} if opt_cls is SparseRowAdam else {}
    opt = opt_cls([p], lr=0.1, **hp)
    steps = make_steps(DIM, TOUCHED)
    run_steps(opt, p, steps)
    touched = sorted({r for rows in TOUCHED for r in rows})
    untouched = [r for r in range(64) if r not in touched]
    assert torch.equal(p.detach()[untouched], w0[untouched])
    assert not torch.equal(p.detach()[touched], w0[touched])


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize(
    "rows",
    [
        [3, 1, 3, 3, 0, 1],  # unsorted with repeats
        [0, 1, 1, 4],  # sorted with a repeat: not the sorted-distinct fast path
        [5, 2, 0],  # distinct but descending
        [0, 2, 5],  # sorted distinct (what TrainableTable.gather gives): no coalesce needed
    ],
)
def test_repeated_indices_are_summed(opt_cls, rows):
    vals = torch.randn(len(rows), DIM, generator=torch.Generator().manual_seed(5))
    summed = summed_rows(rows, vals)
    uniq = sorted(summed)
    p1, p2 = table(torch.float32), table(torch.float32)
    o1, o2 = opt_cls([p1], lr=0.1), opt_cls([p2], lr=0.1)
    p1.grad = sparse_grad(rows, vals, (NUM_ROWS, DIM))  # not flagged coalesced
    assert not p1.grad.is_coalesced()
    p2.grad = sparse_grad(uniq, torch.stack([summed[r] for r in uniq]).float(), (NUM_ROWS, DIM)).coalesce()
    o1.step()
    o2.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-6, atol=1e-7)


def test_fully_sparse_gradient_matches_hybrid():
    """A sparse_dim=2 gradient (indices (2, nnz), scalar values) gives the same step."""
    steps = make_steps(DIM, TOUCHED)
    p1, p2 = table(), table()
    o1, o2 = SparseRowAdam([p1], **HP), SparseRowAdam([p2], **HP)
    run_steps(o1, p1, steps)
    for rows, values in steps:
        p2.grad = sparse_grad(rows, values, (NUM_ROWS, DIM)).to_dense().to_sparse(2)
        o2.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-12, atol=1e-12)


def test_bf16_table():
    p = table(torch.bfloat16)
    w0 = p.detach().clone()
    steps = make_steps(DIM, TOUCHED)
    opt = SparseRowAdam([p], **HP)
    run_steps(opt, p, steps)
    assert p.dtype == torch.bfloat16
    assert {k: v.dtype for k, v in opt.state[p].items()} == {
        "exp_avg": torch.float32,
        "exp_avg_sq_row": torch.float32,
        "step": torch.int32,
    }
    # The reference sees the same bf16 gradients and rounds each written row to bf16.
    steps_bf16 = [(rows, values.bfloat16().double()) for rows, values in steps]
    w, m, _v, _t = ref_adam(w0, steps_bf16, **HP, round_to=torch.bfloat16)
    # fp32 vs fp64 math can land on either side of a bf16 rounding boundary: one bf16 ulp.
    torch.testing.assert_close(p.detach().double(), w, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-2, atol=1e-3)


def test_empty_gradient_changes_nothing():
    p = table(torch.float32)
    w0 = p.detach().clone()
    opt = SparseRowAdam([p])
    p.grad = sparse_grad([], torch.zeros(0, DIM), (NUM_ROWS, DIM))
    opt.step()
    assert torch.equal(p.detach(), w0)
    assert int(opt.state[p]["step"].sum()) == 0


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
def test_a_refused_gradient_changes_no_table(opt_cls):
    """Every gradient is read and checked before any table or state changes: a dense gradient on the
    second table is refused with the first table (and its state) as they were."""
    a, b = table(torch.float32), table(torch.float32)
    opt = opt_cls([a, b], lr=0.05)
    a.grad = sparse_grad([1, 2], torch.ones(2, DIM), (NUM_ROWS, DIM))
    b.grad = torch.ones(NUM_ROWS, DIM)
    w0 = a.detach().clone()
    with pytest.raises(TypeError, match="needs a sparse COO gradient"):
        opt.step()
    assert torch.equal(a.detach(), w0) and not opt.state[a]


def test_closure_loss_is_returned():
    p = table(torch.float32)
    opt = SparseRowAdagrad([p])

    def closure():
        opt.zero_grad()
        loss = F.embedding(torch.tensor([1, 2]), p, sparse=True).sum()
        loss.backward()
        return loss

    expected = float(p.detach()[[1, 2]].sum())  # the loss before the step updates rows 1 and 2
    assert float(opt.step(closure).detach()) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------- memory


def test_adam_state_is_one_full_size_tensor_per_table():
    tables = [table(torch.float32, 100, 16), table(torch.bfloat16, 50, 8)]
    opt = SparseRowAdam(tables)
    for p in tables:
        p.grad = sparse_grad([0, 3], torch.ones(2, p.shape[1], dtype=p.dtype), tuple(p.shape))
    opt.step()
    assert len(opt.state) == 2
    for p in tables:
        state = opt.state[p]
        full = [k for k, v in state.items() if v.shape == p.shape]
        assert full == ["exp_avg"]
        assert {k: tuple(v.shape) for k, v in state.items()} == {
            "exp_avg": tuple(p.shape),
            "exp_avg_sq_row": (p.shape[0],),
            "step": (p.shape[0],),
        }
        num_rows, dim = p.shape
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        assert nbytes == 4 * num_rows * dim + 8 * num_rows  # 4 + 8 / dim bytes per parameter


def test_adagrad_state_is_one_scalar_per_row():
    p = table(torch.float32, 100, 16)
    opt = SparseRowAdagrad([p])
    p.grad = sparse_grad([7], torch.ones(1, 16), (100, 16))
    opt.step()
    assert {k: (tuple(v.shape), v.dtype) for k, v in opt.state[p].items()} == {
        "sum_row": ((100,), torch.float32)
    }


class _RecordShapes(TorchDispatchMode):
    """Records the numel of every dense tensor an op creates (in-place ops return their input)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if not name.endswith("_"):
            for o in out if isinstance(out, tuple | list) else (out,):
                if isinstance(o, torch.Tensor) and o.layout == torch.strided:
                    self.created.append((str(func), o.numel()))
        return out


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_makes_no_table_sized_temporaries(opt_cls, dtype):
    """After the first step (state allocation) a step creates only (touched rows)-sized tensors."""
    num_rows, dim, touched = 4096, 4, 16
    p = table(dtype, num_rows, dim)
    opt = opt_cls([p])
    steps = make_steps(dim, [list(range(0, 4 * touched, 4)), list(range(1, 3 * touched, 3)) * 2])
    run_steps(opt, p, steps[:1])
    p.grad = sparse_grad(steps[1][0], steps[1][1].to(dtype), (num_rows, dim))
    with _RecordShapes() as rec:
        opt.step()
    assert rec.created, "the dispatch mode saw no ops"
    biggest = max(rec.created, key=lambda x: x[1])
    assert biggest[1] <= 2 * touched * dim, biggest


# ---------------------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(opt_cls, dtype):
    steps = make_steps(DIM, TOUCHED)
    p1 = table(dtype)
    o1 = opt_cls([p1], lr=0.05)
    run_steps(o1, p1, steps[:2])
    buf = io.BytesIO()
    torch.save({"param": p1.detach().clone(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)

    p2 = nn.Parameter(saved["param"])
    o2 = opt_cls([p2])  # default lr: the loaded param group brings lr=0.05 back
    o2.load_state_dict(saved["opt"])
    assert o2.param_groups[0]["lr"] == 0.05
    for k, v in o1.state[p1].items():
        assert o2.state[p2][k].dtype == v.dtype, k  # fp32 state of a bf16 table stays fp32
        assert torch.equal(o2.state[p2][k], v), k
    run_steps(o1, p1, steps[2:])
    run_steps(o2, p2, steps[2:])
    assert torch.equal(p1.detach(), p2.detach())
    for k, v in o1.state[p1].items():
        assert torch.equal(o2.state[p2][k], v), k


def test_loaded_state_is_a_copy():
    p1 = table(torch.float32)
    o1 = SparseRowAdam([p1])
    run_steps(o1, p1, make_steps(DIM, TOUCHED[:1]))
    sd = o1.state_dict()
    p2 = nn.Parameter(p1.detach().clone())
    o2 = SparseRowAdam([p2])
    o2.load_state_dict(sd)
    for k in o1.state[p1]:
        assert o2.state[p2][k].data_ptr() != o1.state[p1][k].data_ptr(), k


def test_load_state_dict_rejects_a_different_table_size():
    p1 = table(torch.float32)
    o1 = SparseRowAdam([p1])
    run_steps(o1, p1, make_steps(DIM, TOUCHED[:1]))
    o2 = SparseRowAdam([table(torch.float32, NUM_ROWS + 1)])
    with pytest.raises(ValueError, match="table size"):
        o2.load_state_dict(o1.state_dict())


def test_load_state_dict_rejects_state_of_another_dtype_kind():
    """An int32 momentum (or a float step count) would load cast, as other numbers: refused."""
    p1 = table(torch.float32)
    o1 = SparseRowAdam([p1])
    run_steps(o1, p1, make_steps(DIM, TOUCHED[:1]))
    for key, dtype in (("exp_avg", torch.int32), ("step", torch.float32)):
        sd = o1.state_dict()
        sd["state"] = {0: sd["state"][0] | {key: sd["state"][0][key].to(dtype)}}  # o1's own dict untouched
        with pytest.raises(ValueError, match=rf"saved state '{key}' of parameter 0 has dtype {dtype}"):
            SparseRowAdam([table(torch.float32)]).load_state_dict(sd)
    assert set(o1.expected_state(p1)) == {"exp_avg", "exp_avg_sq_row", "step"}


def test_load_state_dict_rejects_another_optimizers_state():
    p1 = table(torch.float32)
    o1 = SparseRowAdagrad([p1])
    run_steps(o1, p1, make_steps(DIM, TOUCHED[:1]))
    sd = o1.state_dict()
    sd["param_groups"][0].update(betas=(0.9, 0.95), weight_decay=0.0)
    with pytest.raises(ValueError, match="another optimizer"):
        SparseRowAdam([table(torch.float32)]).load_state_dict(sd)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr .* got -1.0"),
        ({"lr": float("nan")}, "lr .* got nan"),
        ({"betas": (1.0, 0.9)}, r"param group 0: betas\[0\] must be .* < 1.0, got 1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] .* got -0.1"),
        ({"betas": (0.9, 1.5)}, r"betas\[1\] .* got 1.5"),
        ({"betas": 0.9}, "pair .* got 0.9"),
        ({"eps": 0.0}, "eps .* > 0.0, got 0.0"),
        ({"weight_decay": -0.1}, "weight_decay .* got -0.1"),
    ],
)
def test_adam_hyperparameter_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseRowAdam([table()], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.5}, "lr .* got -0.5"),
        ({"eps": -1e-3}, "eps .* got -0.001"),
        ({"initial_accumulator_value": -1.0}, "initial_accumulator_value .* got -1.0"),
        ({"eps": 0.0, "initial_accumulator_value": 0.0}, "both 0"),
    ],
)
def test_adagrad_hyperparameter_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseRowAdagrad([table()], **kwargs)


def test_param_group_hyperparameters_are_checked():
    opt = SparseRowAdam([table()])
    with pytest.raises(ValueError, match=r"lr .* got -2"):
        opt.add_param_group({"params": [table()], "lr": -2})


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
def test_parameter_errors(opt_cls):
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        opt_cls([nn.Parameter(torch.zeros(5))])
    with pytest.raises(TypeError, match=r"torch\.int64"):
        opt_cls([torch.zeros(5, 2, dtype=torch.int64)])
    p = table(torch.float32)
    opt = opt_cls([p])
    p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match=r"sparse COO gradient.*TrainableTable\.gather"):
        opt.step()


# ----------------------------------------------------------------------------------------- hypothesis


@st.composite
def problems(draw):
    num_rows = draw(st.integers(1, 40))
    dim = draw(st.integers(1, 9))
    touched = draw(
        st.lists(st.lists(st.integers(0, num_rows - 1), min_size=0, max_size=12), min_size=1, max_size=5)
    )
    seed = draw(st.integers(0, 2**16))
    return num_rows, dim, touched, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from([0.0, 0.3]))
def test_random_problems_match_references(problem, weight_decay):
    num_rows, dim, touched, seed = problem
    steps = make_steps(dim, touched, seed)
    hp = {"lr": 0.02, "betas": (0.85, 0.97), "eps": 1e-7, "weight_decay": weight_decay}
    p = table(torch.float64, num_rows, dim)
    w0 = p.detach().clone()
    opt = SparseRowAdam([p], **hp)
    run_steps(opt, p, steps)
    w, _m, _v, t = ref_adam(w0, steps, **hp)
    torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
    assert torch.equal(opt.state[p]["step"], t)

    q = table(torch.float64, num_rows, dim)
    opt = SparseRowAdagrad([q], lr=0.05, initial_accumulator_value=0.1)
    run_steps(opt, q, steps)
    w, _acc = ref_adagrad(w0, steps, lr=0.05, initial_accumulator_value=0.1)
    torch.testing.assert_close(q.detach(), w, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ end to end


class _TinyModel(nn.Module):
    """Sum of 3 gathered table rows per example, then a small dense head: y = head(sum_k T[rows_k])."""

    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.table = TrainableTable(num_rows, dim, init_std=0.1)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head(self.table.gather(rows).sum(-2)).squeeze(-1)  # (B, 3, dim) -> (B,)


def _regression(seed: int = 0, num_rows: int = 64, n: int = 512):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, num_rows, (n, 3), generator=gen)
    y = torch.randn(num_rows, generator=gen)[rows].sum(-1)  # additive in rows: learnable
    return rows, y


@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
def test_training_a_table_reduces_the_loss(opt_cls):
    """Only the table trains (fixed random linear read-out): the sparse optimizer alone fits it."""
    torch.manual_seed(0)
    num_rows, dim = 64, 8
    rows, y = _regression(num_rows=num_rows)
    tab = TrainableTable(num_rows, dim, init_std=0.1)
    readout = torch.randn(dim) / math.sqrt(dim)
    opt = opt_cls([tab.weight], lr=0.05)

    def loss_fn(r, target):
        return F.mse_loss(tab.gather(r).sum(-2) @ readout, target)

    with torch.no_grad():
        before = float(loss_fn(rows, y))
    for i in range(300):
        batch = slice((i * 32) % 512, (i * 32) % 512 + 32)
        opt.zero_grad()
        loss_fn(rows[batch], y[batch]).backward()
        assert tab.weight.grad.is_sparse
        opt.step()
    with torch.no_grad():
        after = float(loss_fn(rows, y))
    assert after < 0.05 * before, (before, after)


def test_split_param_groups_and_joint_training():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": _TinyModel(64, 8), "b": TrainableTable(10, 4)})
    dense, tables = split_param_groups(model)
    assert [id(p) for p in tables] == [id(model["a"].table.weight), id(model["b"].weight)]
    assert {id(p) for p in dense} == {id(p) for p in model["a"].head.parameters()}
    assert len(dense) + len(tables) == len(list(model.parameters()))

    net = model["a"]
    rows, y = _regression()
    dense_opt = torch.optim.AdamW(dense, lr=1e-2)
    table_opt = SparseRowAdam(tables, lr=2e-2)
    with torch.no_grad():
        before = float(F.mse_loss(net(rows), y))
    for i in range(300):
        batch = slice((i * 32) % 512, (i * 32) % 512 + 32)
        dense_opt.zero_grad()
        table_opt.zero_grad()
        F.mse_loss(net(rows[batch]), y[batch]).backward()
        dense_opt.step()
        table_opt.step()  # model["b"] has no grad: skipped
    with torch.no_grad():
        after = float(F.mse_loss(net(rows), y))
    assert after < 0.1 * before, (before, after)


def test_split_param_groups_needs_a_module():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        split_param_groups([torch.zeros(2)])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.parametrize("opt_cls", [SparseRowAdam, SparseRowAdagrad])
def test_cuda_matches_cpu(opt_cls):
    steps = make_steps(DIM, TOUCHED)
    p_cpu = table(torch.float32)
    p_gpu = nn.Parameter(p_cpu.detach().cuda())
    o_cpu, o_gpu = opt_cls([p_cpu], lr=0.05), opt_cls([p_gpu], lr=0.05)
    for rows, values in steps:
        p_cpu.grad = sparse_grad(rows, values.float(), (NUM_ROWS, DIM))
        p_gpu.grad = p_cpu.grad.cuda()
        o_cpu.step()
        o_gpu.step()
    torch.testing.assert_close(p_gpu.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-6)
    for k, v in o_cpu.state[p_cpu].items():
        assert o_gpu.state[p_gpu][k].device.type == "cuda"
        torch.testing.assert_close(o_gpu.state[p_gpu][k].cpu(), v, rtol=1e-5, atol=1e-6)


def test_dense_table_adam_is_torch_adam_on_the_dense_gradient():
    """DenseTableAdam (the paper's table optimizer, for comparisons) moves every row each step, as
    torch's Adam given the same gradient made dense."""
    from engram.model.optim import DenseTableAdam

    torch.manual_seed(0)
    w0 = torch.randn(50, 4)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a, opt_b = DenseTableAdam([a], lr=0.01), torch.optim.Adam([b], lr=0.01)
    for step in range(3):
        rows = torch.tensor([1, 7, 30 + step])
        vals = torch.randn(3, 4)
        a.grad = torch.sparse_coo_tensor(rows[None], vals, (50, 4), check_invariants=True)
        b.grad = a.grad.to_dense()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a.data, b.data)
    assert (a.data != w0).all(dim=1).sum() > 3  # rows not looked up since step 0 keep moving (momentum)


def test_cli_optimizer_choices_are_the_config_enums():
    from engram.apps.lm.train_config import EmbeddingOptimizer, TableOptimizer
    from engram.cli.train import EMBEDDING_OPTIMIZERS, TABLE_OPTIMIZERS

    assert tuple(o.value for o in TableOptimizer) == TABLE_OPTIMIZERS
    assert tuple(o.value for o in EmbeddingOptimizer) == EMBEDDING_OPTIMIZERS
