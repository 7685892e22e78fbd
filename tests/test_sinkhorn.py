"""`SparseSinkhorn` (SPEC §7b) against a plain dense Algorithm 1 written here from the spec: sparse and
dense gradients, rows looked up, abandoned (momentum decaying until masked, then gone) and looked up
again; property tests (unit row RMS, masked rows unchanged, padding rows change nothing); the numba
passes against their torch twins; state round trips; bad input refused with the table unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.kernels import cpu_sinkhorn, reference
from engram.model.sinkhorn import SparseSinkhorn

V41 = {"beta": 0.95, "iterations": 11, "tau": 1e-3, "eps": 1e-20, "lr_correction": 0.18}


class DenseSinkhorn:
    """Algorithm 1 over the whole table, one step at a time, exactly as SPEC §7b writes it."""

    def __init__(self, w: torch.Tensor, lr: float, beta=0.95, iterations=11, tau=1e-3, eps=1e-20, gamma=0.18):
        self.w, self.lr, self.beta, self.k, self.tau, self.eps, self.gamma = (
            w,
            lr,
            beta,
            iterations,
            tau,
            eps,
            gamma,
        )
        self.m = torch.zeros_like(w)

    def step(self, g: torch.Tensor) -> torch.Tensor:
        """Apply one update for the dense gradient g; returns Delta (before gamma * lr)."""
        b = self.beta
        self.m = b * self.m + (1 - b) * g
        nest = b * self.m + (1 - b) * g
        rho = nest.norm(dim=1)
        rho_bar = rho.sum() / self.w.shape[0]
        u = torch.where((rho > self.tau * rho_bar)[:, None], nest, torch.zeros_like(nest))
        u = u / (rho[:, None] + self.eps)
        for _ in range((self.k - 1) // 2):
            u = u / (u.norm(dim=0, keepdim=True) + self.eps)
            u = u / (u.norm(dim=1, keepdim=True) + self.eps)
        delta = math.sqrt(self.w.shape[1]) * u
        self.w -= self.gamma * self.lr * delta
        return delta


def sparse_grad(rows: list[int], values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A hybrid COO gradient of distinct sorted rows, as TrainableTable.gather's backward makes it."""
    idx = torch.tensor(sorted(rows), dtype=torch.int64)
    return torch.sparse_coo_tensor(idx[None], values, shape, check_invariants=True)


def schedule(m: int, steps: int, seed: int) -> list[list[int]]:
    """Rows looked up per step: a hot set every step, a set abandoned after step 5 and looked up again at
    step `steps - 5`, and a few random rows."""
    g = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        rows = set(range(0, 8))
        if s < 5 or s >= steps - 5:
            rows |= set(range(20, 30))
        rows |= set(g.choice(m, size=6, replace=False).tolist())
        out.append(sorted(rows))
    return out


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_equals_dense_algorithm(dtype, rtol, threads):
    m, n, steps, lr = 300, 16, 40, 0.01
    torch.manual_seed(0)
    w0 = torch.randn(m, n, dtype=dtype)
    dense = DenseSinkhorn(w0.clone(), lr)
    p = torch.nn.Parameter(w0.clone())
    opt = SparseSinkhorn([p], lr=lr, threads=threads)
    g = torch.Generator().manual_seed(1)
    for s, rows in enumerate(schedule(m, steps, 2)):
        vals = torch.randn(len(rows), n, generator=g, dtype=dtype) * (1 + s % 3)
        full = torch.zeros(m, n, dtype=dtype)
        full[rows] = vals
        dense.step(full)
        p.grad = sparse_grad(rows, vals, (m, n))
        opt.step()
        torch.testing.assert_close(p.data, dense.w, rtol=rtol, atol=rtol * float(dense.w.abs().max()))
        # the state covers exactly the rows with nonzero momentum
        active = dense.m.ne(0).any(dim=1).nonzero()[:, 0]
        assert torch.equal(opt.state[p]["rows"], active)
        scale = float(dense.m.abs().max())
        torch.testing.assert_close(opt.state[p]["momentum"], dense.m[active], rtol=rtol, atol=rtol * scale)
    # the abandoned rows kept being updated for a while (decaying momentum above the mask)
    assert opt.active_rows(p) > 8 + 6


def test_abandoned_rows_are_masked_then_leave_the_state_and_return():
    """With a fast decay (beta 0.5) and a high mask (tau 0.05): rows looked up only at first are updated
    while their momentum clears the mask, then masked (unchanged) while it decays, then gone from the
    state once it underflows to zero, and start afresh when looked up again; always equal to dense."""
    m, n, lr, hp = 120, 4, 0.01, {"beta": 0.5, "tau": 0.05}
    torch.manual_seed(8)
    w0 = torch.randn(m, n)
    dense = DenseSinkhorn(w0.clone(), lr, **hp)
    p = torch.nn.Parameter(w0.clone())
    opt = SparseSinkhorn([p], lr=lr, **hp)
    g = torch.Generator().manual_seed(9)
    seen = {"updated_after_abandon": False, "masked": False, "gone": False}
    for s in range(260):
        rows = list(range(10)) + (list(range(50, 60)) if s < 3 or s >= 250 else [])
        vals = torch.randn(len(rows), n, generator=g)
        full = torch.zeros(m, n)
        full[rows] = vals
        before = p.data[50:60].clone()
        dense.step(full)
        p.grad = sparse_grad(rows, vals, (m, n))
        opt.step()
        torch.testing.assert_close(p.data, dense.w, rtol=1e-5, atol=1e-5)
        assert torch.equal(opt.state[p]["rows"], dense.m.ne(0).any(dim=1).nonzero()[:, 0])
        if 3 <= s < 250:
            moved = not torch.equal(p.data[50:60], before)
            held = bool(opt.state[p]["rows"].ge(50).any())
            seen["updated_after_abandon"] |= moved
            seen["masked"] |= held and not moved
            seen["gone"] |= not held
    assert all(seen.values()), seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_gradients_equal_dense_algorithm(dtype):
    """A dense gradient (token embedding, LM head): all-zero rows are rows not looked up."""
    m, n, lr = 64, 8, 0.02
    torch.manual_seed(3)
    w0 = torch.randn(m, n, dtype=dtype)
    dense = DenseSinkhorn(w0.clone(), lr)
    p = torch.nn.Parameter(w0.clone())
    opt = SparseSinkhorn([p], lr=lr)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for s in range(20):
        g = torch.randn(m, n, dtype=dtype)
        g[torch.rand(m) < 0.5] = 0  # half the rows not looked up
        if s == 7:
            g.zero_()  # a step with no lookups at all still decays and applies
        dense.step(g)
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.data, dense.w, rtol=tol, atol=tol)


def test_bf16_table_keeps_fp32_state_and_follows_the_dense_update():
    m, n, lr = 128, 16, 0.01
    torch.manual_seed(4)
    w0 = torch.randn(m, n)
    p = torch.nn.Parameter(w0.to(torch.bfloat16))
    opt = SparseSinkhorn([p], lr=lr)
    dense = DenseSinkhorn(w0.clone(), lr)
    rows = list(range(0, 40, 3))
    vals = torch.randn(len(rows), n)
    full = torch.zeros(m, n)
    full[rows] = vals
    before = p.data.clone()
    delta = dense.step(full)
    p.grad = sparse_grad(rows, vals.to(torch.bfloat16), (m, n))
    opt.step()
    assert opt.state[p]["momentum"].dtype == torch.float32
    want = (before.float() - 0.18 * lr * delta).to(torch.bfloat16)
    assert (p.data.float() - want.float()).abs().max() <= 0.02 * float(w0.abs().max())


# ------------------------------------------------------------------ properties
@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(8, 80),
    n=st.integers(1, 8),
    frac=st.floats(0.05, 1.0),
    spread=st.floats(0.0, 8.0),
    seed=st.integers(0, 2**16),
)
def test_update_rows_have_unit_rms_and_masked_rows_stay(m, n, frac, spread, seed):
    if m < n:
        return
    g = torch.Generator().manual_seed(seed)
    k = max(1, int(m * frac))
    rows = sorted(torch.randperm(m, generator=g)[:k].tolist())
    # row magnitudes spread over 2^spread octaves, so some rows fall under tau * mean
    vals = torch.randn(k, n, generator=g, dtype=torch.float64) * torch.exp2(
        -spread * torch.rand(k, 1, generator=g, dtype=torch.float64) * 4
    )
    p = torch.nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
    lr = 0.5
    opt = SparseSinkhorn([p], lr=lr)
    p.grad = sparse_grad(rows, vals, (m, n))
    opt.step()
    delta = -p.data / (0.18 * lr)
    norms = (vals * 0.05 * 1.95).norm(dim=1)  # N = beta * M + (1 - beta) * G with M = (1 - beta) G
    masked = torch.zeros(m, dtype=torch.bool)
    masked[rows] = norms <= 1e-3 * norms.sum() / m
    untouched = torch.ones(m, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(p.data[masked | untouched], torch.zeros_like(p.data[masked | untouched]))
    live = ~(masked | untouched)
    rms = delta[live].pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-9, atol=0)


@settings(max_examples=15, deadline=None)
@given(pad=st.integers(1, 500), seed=st.integers(0, 2**16))
def test_padding_rows_never_looked_up_change_nothing_but_the_mean(pad, seed):
    """A table padded with rows never looked up gives the update of the dense version of the padded
    table on the other rows (the padding only enters rho_bar's count)."""
    m, n, lr = 40, 6, 0.01
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(m + pad, n, generator=g, dtype=torch.float64)
    dense = DenseSinkhorn(w0.clone(), lr)
    p = torch.nn.Parameter(w0.clone())
    opt = SparseSinkhorn([p], lr=lr)
    for _ in range(3):
        rows = sorted(torch.randperm(m, generator=g)[:15].tolist())
        vals = torch.randn(15, n, generator=g, dtype=torch.float64)
        full = torch.zeros(m + pad, n, dtype=torch.float64)
        full[rows] = vals
        dense.step(full)
        p.grad = sparse_grad(rows, vals, (m + pad, n))
        opt.step()
    torch.testing.assert_close(p.data, dense.w, rtol=1e-12, atol=1e-12)
    assert torch.equal(p.data[m:], w0[m:])


# ------------------------------------------------------------------ kernels against their twins
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_passes_equal_torch_twins(dtype):
    rng = np.random.default_rng(5)
    a, n, r = 500, 12, 200
    mom = rng.standard_normal((a, n)).astype(dtype)
    mom[rng.random(a) < 0.1] = 0
    gidx = np.full(a, -1, dtype=np.int64)
    gidx[rng.choice(a, r, replace=False)] = np.arange(r)
    grad = rng.standard_normal((r, n)).astype(dtype)
    u, rho = np.empty((a, n), dtype=dtype), np.empty(a)
    mom_t, u_t, rho_t = (
        torch.from_numpy(mom.copy()),
        torch.empty(a, n, dtype=torch.from_numpy(mom).dtype),
        torch.empty(a, dtype=torch.float64),
    )
    total, zeros = cpu_sinkhorn.blend(mom, gidx, grad, 0.9, u, rho, threads=2)
    total_t, zeros_t = reference.sinkhorn_blend(
        mom_t, torch.from_numpy(gidx), torch.from_numpy(grad), 0.9, u_t, rho_t
    )
    tol = 1e-6 if dtype == np.float32 else 1e-13
    assert zeros == zeros_t and math.isclose(total, total_t, rel_tol=tol)
    np.testing.assert_allclose(u, u_t.numpy(), rtol=tol, atol=tol * np.abs(u).max())
    thresh = 0.3 * total / a
    keep, keep_t = np.empty(a, dtype=bool), torch.empty(a, dtype=torch.bool)
    colsq = cpu_sinkhorn.rows(u, rho, thresh, 1e-20, keep, threads=2)
    colsq_t = reference.sinkhorn_rows(u_t, rho_t, thresh, 1e-20, keep_t)
    assert np.array_equal(keep, keep_t.numpy()) and (~keep).any()
    np.testing.assert_allclose(colsq, colsq_t.numpy(), rtol=tol)
    for want in (True, False):
        colinv = (1.0 / (np.sqrt(colsq) + 1e-20)).astype(dtype)
        colsq = cpu_sinkhorn.cols_rows(u, colinv, keep, 1e-20, want, threads=2)
        colsq_t = reference.sinkhorn_cols_rows(u_t, torch.from_numpy(colinv), keep_t, 1e-20, want)
        np.testing.assert_allclose(u, u_t.numpy(), rtol=10 * tol, atol=10 * tol * np.abs(u).max())
        np.testing.assert_allclose(colsq, colsq_t.numpy(), rtol=10 * tol)


def test_torch_path_equals_numba_path():
    """The torch twins drive the optimizer off the CPU; forced here on the CPU, the same result."""
    torch.manual_seed(6)
    w0 = torch.randn(200, 8)
    ps = [torch.nn.Parameter(w0.clone()) for _ in range(2)]
    opts = [SparseSinkhorn([ps[0]], lr=0.01), SparseSinkhorn([ps[1]], lr=0.01, backend="torch")]
    for _ in range(6):
        rows = sorted(set(torch.randint(0, 200, (30,)).tolist()))
        vals = torch.randn(len(rows), 8)
        for p, opt in zip(ps, opts, strict=True):
            p.grad = sparse_grad(rows, vals.clone(), (200, 8))
            opt.step()
    torch.testing.assert_close(ps[0].data, ps[1].data, rtol=1e-6, atol=1e-7)
    assert torch.equal(opts[0].state[ps[0]]["rows"], opts[1].state[ps[1]]["rows"])


# ------------------------------------------------------------------ state
def test_state_dict_round_trip_resumes_bit_exact(tmp_path):
    torch.manual_seed(7)
    w0 = torch.randn(100, 8)
    grads = []
    for _ in range(10):
        rows = sorted(set(torch.randint(0, 100, (12,)).tolist()))
        grads.append((rows, torch.randn(len(rows), 8)))
    p = torch.nn.Parameter(w0.clone())
    opt = SparseSinkhorn([p], lr=0.01)
    for i, (rows, vals) in enumerate(grads):
        if i == 5:
            torch.save({"w": p.data.clone(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
        p.grad = sparse_grad(rows, vals, (100, 8))
        opt.step()
    saved = torch.load(tmp_path / "ck.pt")
    q = torch.nn.Parameter(saved["w"])
    opt2 = SparseSinkhorn([q], lr=0.01)
    opt2.load_state_dict(saved["opt"])
    for rows, vals in grads[5:]:
        q.grad = sparse_grad(rows, vals, (100, 8))
        opt2.step()
    assert torch.equal(p.data, q.data)
    assert torch.equal(opt.state[p]["momentum"], opt2.state[q]["momentum"])


def test_state_memory_follows_the_active_rows():
    p = torch.nn.Parameter(torch.zeros(1_000_000, 4))
    opt = SparseSinkhorn([p], lr=0.01)
    p.grad = sparse_grad([3, 5, 999_999], torch.ones(3, 4), tuple(p.shape))
    opt.step()
    st = opt.state[p]
    assert st["momentum"].shape == (3, 4) and st["rows"].tolist() == [3, 5, 999_999]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"iterations": 10}, "iterations must be an odd"),
        ({"iterations": 0}, "iterations must be an odd"),
        ({"tau": -1e-3}, "tau"),
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"beta": 1.0}, "beta"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_hyperparameters_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseSinkhorn([torch.nn.Parameter(torch.zeros(10, 4))], **kwargs)


def test_a_table_with_fewer_rows_than_columns_refused():
    with pytest.raises(ValueError, match=r"num_rows >= dim.*\(4, 10\)"):
        SparseSinkhorn([torch.nn.Parameter(torch.zeros(4, 10))])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_gradient_refused_and_nothing_changes(bad):
    a, b = torch.nn.Parameter(torch.randn(20, 4)), torch.nn.Parameter(torch.randn(20, 4))
    opt = SparseSinkhorn([a, b], lr=0.01)
    a.grad = sparse_grad([1, 2], torch.ones(2, 4), (20, 4))
    b.grad = sparse_grad([1, 2], torch.ones(2, 4), (20, 4))
    opt.step()
    before = (a.data.clone(), b.data.clone(), opt.state_dict())
    vals = torch.ones(2, 4)
    vals[1, 2] = bad
    a.grad = sparse_grad([3, 7], torch.ones(2, 4), (20, 4))
    b.grad = sparse_grad([3, 7], vals, (20, 4))
    with pytest.raises(ValueError, match=r"NaN or Inf at row 7"):
        opt.step()
    assert torch.equal(a.data, before[0]) and torch.equal(b.data, before[1])  # neither table moved
    for key in ("rows", "momentum"):
        assert torch.equal(opt.state[a][key], before[2]["state"][0][key])


def test_state_dict_of_another_optimizer_or_shape_refused():
    p = torch.nn.Parameter(torch.randn(20, 2))
    opt = SparseSinkhorn([p], lr=0.01)
    p.grad = sparse_grad([1, 12], torch.ones(2, 2), (20, 2))
    opt.step()
    good = opt.state_dict()
    q = torch.nn.Parameter(torch.randn(20, 2))
    adam = torch.optim.Adam([q])
    q.grad = torch.ones(20, 2)
    adam.step()
    fresh = SparseSinkhorn([torch.nn.Parameter(torch.randn(20, 2))], lr=0.01)
    with pytest.raises(ValueError, match="another optimizer"):
        fresh.load_state_dict(adam.state_dict())
    other = SparseSinkhorn([torch.nn.Parameter(torch.randn(20, 6))], lr=0.01)
    with pytest.raises(ValueError, match=r"\(20, 6\).*needs \(2, 6\)"):
        other.load_state_dict(good)
    small = SparseSinkhorn([torch.nn.Parameter(torch.randn(10, 2))], lr=0.01)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        small.load_state_dict(good)
    assert not fresh.state and not other.state and not small.state


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tables_follow_the_cpu_update(dtype):
    """On CUDA (the Triton passes): the same tables and active sets as on the CPU (numba), to fp32
    rounding, over steps with rows looked up, abandoned and back."""
    torch.manual_seed(10)
    w0 = torch.randn(5000, 64).to(dtype)
    cpu, gpu = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone().cuda())
    opts = [SparseSinkhorn([cpu], lr=0.01), SparseSinkhorn([gpu], lr=0.01)]
    for rows in schedule(5000, 12, 11):
        vals = torch.randn(len(rows), 64).to(dtype)
        cpu.grad = sparse_grad(rows, vals, (5000, 64))
        gpu.grad = sparse_grad(rows, vals, (5000, 64)).cuda()
        for opt in opts:
            opt.step()
    assert torch.equal(opts[0].state[cpu]["rows"], opts[1].state[gpu]["rows"].cpu())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gpu.data.cpu().float(), cpu.data.float(), rtol=tol, atol=tol)


def test_state_dict_loads_again_after_a_load():
    """torch's load_state_dict adds keys of its own to `defaults` ('differentiable'): a second load
    (accelerate's AcceleratedOptimizer loads once when it wraps, the Trainer's resume again) works."""
    p = torch.nn.Parameter(torch.zeros(64, 8))
    opt = SparseSinkhorn([p], lr=0.1)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 5]]), torch.ones(2, 8), (64, 8))
    opt.step()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["rows"], torch.tensor([1, 5]))
