"""The table optimizers' `load_state_dict(..., copy=False)` (engram.model.optim, engram.model.sinkhorn):
a resuming rank's freshly read state is kept, not copied (the state held once), every check still runs
before anything changes, and a bf16 table's fp32 state stays fp32 (never cast, not even on the way)."""

from __future__ import annotations

import pytest
import torch

from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn


def _table(dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(12, 4, generator=torch.Generator().manual_seed(0)).to(dtype))


def _stepped(cls, p: torch.nn.Parameter):
    opt = cls([p], lr=1e-2)
    p.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 5]]), torch.ones(2, p.shape[1], dtype=p.dtype), p.shape
    )
    opt.step()
    return opt


@pytest.mark.parametrize("cls", [SparseRowAdam, SparseRowAdagrad])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_false_keeps_the_given_tensors(cls, dtype):
    sd = _stepped(cls, _table(dtype)).state_dict()
    fresh = {k: v.clone() for k, v in sd["state"][0].items()}
    p = _table(dtype)
    taken = cls([p], lr=1e-2)
    taken.load_state_dict({"state": {0: fresh}, "param_groups": sd["param_groups"]}, copy=False)
    for key, value in fresh.items():
        assert taken.state[p][key].data_ptr() == value.data_ptr()  # kept, not copied
        assert taken.state[p][key].dtype == value.dtype  # fp32 state of a bf16 table stays fp32
    copied = cls([p], lr=1e-2)
    copied.load_state_dict({"state": {0: fresh}, "param_groups": sd["param_groups"]})
    assert all(copied.state[p][k].data_ptr() != v.data_ptr() for k, v in fresh.items())
    assert all(torch.equal(copied.state[p][k], v) for k, v in fresh.items())


def test_copy_false_still_checks_first():
    """A damaged state (NaN momentum) is refused with copy=False as with copy=True, the state unchanged."""
    p = _table()
    opt = _stepped(SparseRowAdam, p)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    sd = opt.state_dict()
    bad = {k: v.clone() for k, v in sd["state"][0].items()}
    bad["exp_avg"][3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"saved state 'exp_avg' of parameter 0 holds NaN or Inf at row 3"):
        opt.load_state_dict({"state": {0: bad}, "param_groups": sd["param_groups"]}, copy=False)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())


def test_sinkhorn_row_state_loads_what_it_made():
    """SparseSinkhorn's per-row state (a checkpoint's form) loads back equal; the active rows' momentum
    it selects is taken as made (copy=False inside load_row_state_dict)."""
    p = _table()
    opt = _stepped(SparseSinkhorn, p)
    rows = opt.row_state_dict()
    q = _table()
    other = SparseSinkhorn([q], lr=1e-2)
    other.load_row_state_dict(rows)
    assert torch.equal(other.state[q]["rows"], opt.state[p]["rows"])
    assert torch.equal(other.state[q]["momentum"], opt.state[p]["momentum"])
    fresh = {"rows": opt.state[p]["rows"].clone(), "momentum": opt.state[p]["momentum"].clone()}
    other.load_state_dict({"state": {0: fresh}, "param_groups": opt.state_dict()["param_groups"]}, copy=False)
    assert other.state[q]["momentum"].data_ptr() == fresh["momentum"].data_ptr()
