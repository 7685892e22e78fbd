"""The Triton passes of the Sinkhorn-balanced update (engram.kernels.triton_sinkhorn) against their torch
twins (engram.kernels.reference.sinkhorn_*, and the index_add_ of SparseSinkhorn for the apply).

On a CUDA machine the kernels run compiled; elsewhere under triton's interpreter (tests/conftest.py
switches it on before collection) on small CPU shapes: n not a power of two, A not a multiple of the
row block, programs that take several row blocks, masked rows and rows without a gradient. fp32 agrees
to a few ulps (the sums of squares are fp64 in both, in another order), fp64 to 1e-12; the apply is
bit-exact to its rounding model (`apply_rounded`) in every table layout and dtype (bf16 to one ulp
interpreted: the interpreter's cast truncates).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from engram.kernels import reference

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's numpy overflow warnings
]

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_MODULE = "engram.kernels.triton_sinkhorn"
TOL = {torch.float32: {"rtol": 2e-6, "atol": 1e-7}, torch.float64: {"rtol": 1e-12, "atol": 1e-14}}


@pytest.fixture(scope="module")
def ts() -> ModuleType:
    """The kernel module: compiled on CUDA, interpreted elsewhere (imported again if it was imported
    compiled, i.e. before the interpreter was switched on)."""
    pytest.importorskip("triton.language")
    mod = sys.modules.get(_MODULE) or importlib.import_module(_MODULE)
    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod._blend_kernel, InterpretedFunction):
            import triton.language as tl

            if not isinstance(tl.zeros, InterpretedFunction):
                pytest.skip(
                    "triton was imported before TRITON_INTERPRET=1 was set: set it in the environment"
                )
            mod = importlib.reload(mod)
    return mod


def make_state(a: int, n: int, r: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A active rows of n features: momentum with some all-zero rows and some tiny ones (masked), a
    gradient of r rows, gidx with -1 for rows not in it; table rows for the apply."""
    gen = torch.Generator().manual_seed(seed)
    mom = torch.randn(a, n, generator=gen, dtype=torch.float64)
    mom[::7] = 0.0  # fresh rows (zero momentum)
    mom[3::11] *= 1e-9  # decayed rows: under the mask
    gidx = torch.full((a,), -1, dtype=torch.int64)
    with_grad = torch.randperm(a, generator=gen)[:r].sort().values
    gidx[with_grad] = torch.randperm(r, generator=gen)
    gidx[0] = -1  # a zero-momentum row without a gradient: its momentum stays zero
    grad = torch.randn(r, n, generator=gen, dtype=torch.float64)
    rows = torch.randperm(3 * a, generator=gen)[:a].sort().values
    out = {"mom": mom.to(dtype), "gidx": gidx, "grad": grad.to(dtype), "rows": rows}
    return {k: v.to(DEVICE) for k, v in out.items()}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[dtype])


SHAPES = [(150, 12), (37, 130), (5, 3)]  # (A, n): blocks of 64 rows at n = 12, of 16 at n = 130


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("a", "n"), SHAPES)
def test_blend(ts, dtype: torch.dtype, a: int, n: int) -> None:
    s = make_state(a, n, max(1, a // 2), dtype, seed=a + n)
    outs = []
    for fn in (ts.sinkhorn_blend, reference.sinkhorn_blend):
        mom = s["mom"].clone()
        u = torch.full_like(mom, float("nan"))  # every entry must be written
        rho = torch.full((a,), float("nan"), dtype=torch.float64, device=DEVICE)
        total, zero_rows = fn(mom, s["gidx"], s["grad"], 0.95, u, rho)
        outs.append((mom, u, rho, total, zero_rows))
    (m1, u1, r1, t1, z1), (m2, u2, r2, t2, z2) = outs
    close(m1, m2, dtype)
    close(u1, u2, dtype)
    close(r1, r2, dtype)
    assert math.isclose(t1, t2, rel_tol=TOL[dtype]["rtol"])
    assert z1 == z2 >= 1  # row 0: zero momentum, no gradient
    assert isinstance(t1, float) and isinstance(z1, int)


def test_blend_without_gradient(ts) -> None:
    """A step without lookups (gidx all -1, an empty gradient): the momentum decays."""
    s = make_state(40, 12, 1, torch.float32, seed=1)
    gidx = torch.full((40,), -1, dtype=torch.int64, device=DEVICE)
    grad = torch.zeros(0, 12, device=DEVICE)
    outs = []
    for fn in (ts.sinkhorn_blend, reference.sinkhorn_blend):
        mom, u = s["mom"].clone(), torch.empty_like(s["mom"])
        rho = torch.empty(40, dtype=torch.float64, device=DEVICE)
        outs.append((mom, u, rho, *fn(mom, gidx, grad, 0.9, u, rho)))
    for got, want in zip(outs[0][:3], outs[1][:3], strict=True):
        close(got, want, torch.float32)
    assert outs[0][4] == outs[1][4] == 6  # rows 0, 7, ..., 35: zero momentum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("a", "n"), SHAPES)
def test_rows(ts, dtype: torch.dtype, a: int, n: int) -> None:
    s = make_state(a, n, a, dtype, seed=2 * a + n)
    u0, rho = s["mom"], torch.linalg.vector_norm(s["mom"].double(), dim=1)
    thresh = 1e-3 * float(rho.mean())
    outs = []
    for fn in (ts.sinkhorn_rows, reference.sinkhorn_rows):
        u, keep = u0.clone(), torch.ones(a, dtype=torch.bool, device=DEVICE)
        colsq = fn(u, rho, thresh, 1e-20, keep)
        outs.append((u, keep, colsq))
    (u1, k1, c1), (u2, k2, c2) = outs
    assert torch.equal(k1, k2) and not bool(k1.all()) and bool(k1.any())  # masked and kept rows
    assert not bool(u1[~k1].any())
    close(u1, u2, dtype)
    assert c1.dtype == torch.float64 and c1.shape == (n,)
    close(c1, c2, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("want", [True, False])
@pytest.mark.parametrize(("a", "n"), SHAPES)
def test_cols_rows(ts, dtype: torch.dtype, want: bool, a: int, n: int) -> None:
    s = make_state(a, n, a, dtype, seed=3 * a + n)
    gen = torch.Generator().manual_seed(a)
    u0 = s["mom"]
    keep = (torch.rand(a, generator=gen) < 0.8).to(DEVICE)
    colinv = (0.5 + torch.rand(n, generator=gen, dtype=torch.float64)).to(DEVICE)
    outs = []
    for fn in (ts.sinkhorn_cols_rows, reference.sinkhorn_cols_rows):
        u = u0.clone()
        outs.append((u, fn(u, colinv, keep, 1e-20, want)))
    (u1, c1), (u2, c2) = outs
    close(u1, u2, dtype)
    assert not bool(u1[~keep].any())
    assert c1.dtype == torch.float64 and c1.shape == (n,)
    close(c1, c2, dtype)
    if not want:
        assert not bool(c1.any())


def apply_reference(
    w: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, keep: torch.Tensor, step: float
) -> None:
    """The torch path of SparseSinkhorn._update."""
    kept = keep.nonzero()[:, 0]
    w.index_add_(0, rows[kept], u[kept].to(w.dtype), alpha=-step)


def apply_rounded(
    w0: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, keep: torch.Tensor, step: float
) -> torch.Tensor:
    """What sinkhorn_apply must give, bit for bit: in the compute dtype (fp64 if w or u is, else fp32)
    step * u rounded, then w - that rounded (no FMA), then rounded once to w's dtype."""
    ct = torch.float64 if torch.float64 in (w0.dtype, u.dtype) else torch.float32
    kept = keep.nonzero()[:, 0]
    r = rows[kept]
    product = u[kept].to(ct) * torch.tensor(step, dtype=torch.float64).to(u.device, ct)
    want = w0.clone()
    want[r] = (w0[r].to(ct) - product).to(w0.dtype)
    return want


def table_layouts(w0: torch.Tensor) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """w0's values in tables of other strides: name -> (the storage, the table as a view of it). The
    storage around a view holds 7.0, which the apply must leave alone."""
    m, n = w0.shape
    padded = torch.full((m, 2 * n + 3), 7.0, dtype=w0.dtype, device=w0.device)
    padded[:, 1 : n + 1] = w0
    spaced = torch.full((m, 2 * n), 7.0, dtype=w0.dtype, device=w0.device)
    spaced[:, ::2] = w0
    return {
        "row-major": (w0.clone(), lambda t: t),
        "column-major": (w0.t().contiguous(), lambda t: t.t()),
        "rows padded, offset": (padded, lambda t: t[:, 1 : n + 1]),
        "every other column": (spaced, lambda t: t[:, ::2]),
    }


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("a", "n"), SHAPES)
def test_apply(ts, wdtype: torch.dtype, a: int, n: int) -> None:
    """The same bits for every layout of the table (compiled, FMA contraction had made the row-major
    apply one rounding and the column-major one two), and those of `apply_rounded`; near the torch
    path of SparseSinkhorn."""
    sd = torch.float64 if wdtype == torch.float64 else torch.float32
    s = make_state(a, n, a, sd, seed=4 * a + n)
    gen = torch.Generator().manual_seed(n)
    w0 = torch.randn(3 * a, n, generator=gen).to(DEVICE, wdtype)
    keep = (torch.rand(a, generator=gen) < 0.7).to(DEVICE)
    u, step = s["mom"], 0.37
    want = apply_rounded(w0, s["rows"], u, keep, step)
    untouched = torch.ones(3 * a, dtype=torch.bool, device=DEVICE)
    untouched[s["rows"][keep]] = False
    assert torch.equal(want[untouched], w0[untouched]) and not torch.equal(want, w0)
    got = {}
    for name, (storage, table) in table_layouts(w0).items():
        around = storage.clone()
        ts.sinkhorn_apply(table(storage), s["rows"], u, keep, step)
        table(around).copy_(table(storage))  # what the apply wrote, nothing else may differ
        assert torch.equal(storage, around), name
        got[name] = table(storage)
    for name, w in got.items():
        assert torch.equal(w, got["row-major"]), f"{name} != row-major"
    w = got["row-major"]
    if wdtype != torch.bfloat16 or CUDA:
        assert torch.equal(w, want)
    else:  # the interpreter's cast to bf16 truncates: one ulp either way
        ulp = want.double().abs() * 2**-7 + 1e-6
        assert bool(((w.double() - want.double()).abs() <= ulp).all())
    if wdtype in (torch.float32, torch.float64):
        near = w0.clone()
        apply_reference(near, s["rows"], u, keep, step)
        close(w, near, wdtype)


def test_several_blocks_per_program(ts, monkeypatch) -> None:
    """Two programs over three row blocks: the first takes two, the second one and a fully masked one."""
    monkeypatch.setattr(ts, "_MAX_PROGRAMS", 2)
    assert ts._grid(150, 12)[:3] == (2, 2, 64)
    test_blend(ts, torch.float32, 150, 12)
    test_rows(ts, torch.float64, 150, 12)
    test_cols_rows(ts, torch.float32, True, 150, 12)
    test_apply(ts, torch.float32, 150, 12)


def test_empty_and_bad_inputs(ts) -> None:
    u = torch.zeros(0, 12, device=DEVICE)
    rho = torch.zeros(0, dtype=torch.float64, device=DEVICE)
    keep = torch.zeros(0, dtype=torch.bool, device=DEVICE)
    gidx = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert ts.sinkhorn_blend(u, gidx, torch.zeros(0, 12, device=DEVICE), 0.9, u, rho) == (0.0, 0)
    assert torch.equal(ts.sinkhorn_rows(u, rho, 0.0, 1e-20, keep).cpu(), torch.zeros(12, dtype=torch.float64))
    colinv = torch.ones(12, dtype=torch.float64, device=DEVICE)
    assert not bool(ts.sinkhorn_cols_rows(u, colinv, keep, 1e-20, True).any())
    ts.sinkhorn_apply(torch.zeros(4, 12, device=DEVICE), gidx, u, keep, 1.0)
    u = torch.zeros(5, 12, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="float32 or float64"):
        ts.sinkhorn_rows(u, torch.zeros(5, dtype=torch.float64, device=DEVICE), 0.0, 1e-20, keep)
    with pytest.raises(ValueError, match=r"keep must be a contiguous \(5,\) torch.bool"):
        ts.sinkhorn_rows(u.float(), torch.zeros(5, dtype=torch.float64, device=DEVICE), 0.0, 1e-20, keep)
    with pytest.raises(ValueError, match=r"colinv must be a contiguous float \(12,\)"):
        ts.sinkhorn_cols_rows(
            u.float(), colinv[:5], torch.ones(5, dtype=torch.bool, device=DEVICE), 1e-20, True
        )


def run_update(
    passes: dict,
    rows: torch.Tensor,
    mom: torch.Tensor,
    gidx: torch.Tensor,
    grad: torch.Tensor,
    w: torch.Tensor,
) -> torch.Tensor:
    """One step of the update over the active rows, SparseSinkhorn._update's sequence of calls (V4.1's
    hyperparameters); the new keep mask. `passes`: blend, rows, cols_rows, apply."""
    beta, tau, eps, k, lr, gamma = 0.95, 1e-3, 1e-20, 11, 1e-2, 0.18
    a, n = mom.shape
    u = torch.empty_like(mom)
    rho = torch.empty(a, dtype=torch.float64, device=mom.device)
    keep = torch.empty(a, dtype=torch.bool, device=mom.device)
    total, _ = passes["blend"](mom, gidx, grad, beta, u, rho)
    colsq = passes["rows"](u, rho, tau * total / w.shape[0], eps, keep)
    pairs = (k - 1) // 2
    for i in range(pairs):
        colsq = passes["cols_rows"](u, 1.0 / (colsq.sqrt() + eps), keep, eps, i < pairs - 1)
    passes["apply"](w, rows, u, keep, gamma * lr * math.sqrt(n))
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_five_steps_of_the_update(ts, dtype: torch.dtype) -> None:
    """Five steps of the whole update (new gradients each step, rows without one) through the Triton
    passes and through the torch twins: the same table, momentum and masks."""
    a, n, table_rows = 90, 12, 270  # make_state: rows in [0, 3a)
    triton_passes = {
        "blend": ts.sinkhorn_blend,
        "rows": ts.sinkhorn_rows,
        "cols_rows": ts.sinkhorn_cols_rows,
        "apply": ts.sinkhorn_apply,
    }
    torch_passes = {
        "blend": reference.sinkhorn_blend,
        "rows": reference.sinkhorn_rows,
        "cols_rows": reference.sinkhorn_cols_rows,
        "apply": apply_reference,
    }
    s = make_state(a, n, 30, dtype, seed=11)
    w0 = torch.randn(table_rows, n, generator=torch.Generator().manual_seed(12), dtype=dtype).to(DEVICE)
    runs = [(w0.clone(), s["mom"].clone()) for _ in range(2)]
    gen = torch.Generator().manual_seed(13)
    for _ in range(5):
        gidx = torch.full((a,), -1, dtype=torch.int64)
        looked_up = torch.randperm(a, generator=gen)[:30].sort().values
        gidx[looked_up] = torch.arange(30)
        grad = torch.randn(30, n, generator=gen, dtype=dtype).to(DEVICE)
        keeps = [
            run_update(passes, s["rows"], mom, gidx.to(DEVICE), grad, w)
            for passes, (w, mom) in zip((triton_passes, torch_passes), runs, strict=True)
        ]
        assert torch.equal(keeps[0], keeps[1])
    (w1, m1), (w2, m2) = runs
    close(m1, m2, dtype)
    tol = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: TOL[torch.float64]}[dtype]
    torch.testing.assert_close(w1.cpu(), w2.cpu(), **tol)
    assert not torch.equal(w1, w0)


def test_lazy_entries() -> None:
    """The package's lazy names resolve to this module's functions."""
    pytest.importorskip("triton")
    import engram.kernels as k

    for name in ("sinkhorn_blend", "sinkhorn_rows", "sinkhorn_cols_rows", "sinkhorn_apply"):
        assert name in k.__all__
        assert getattr(k, name).__module__ == _MODULE
