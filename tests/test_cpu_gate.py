"""The numba V4.1 gate (`engram.kernels.cpu_gate`) against its eager twin, and where Engram uses it."""

from __future__ import annotations

import pytest
import torch

from engram.config import EngramConfig
from engram.kernels import cpu_gate, reference
from engram.model.module import Engram


def _inputs(b, t, hc, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, hc, dim, generator=g, dtype=dtype)
    kv = torch.randn(b, t, hc + 1, dim, generator=g, dtype=dtype)  # a wkv output: key and v are views
    w = 1 + 0.1 * torch.randn(hc, dim, generator=g, dtype=dtype)
    return h, kv[:, :, :hc], kv[:, :, hc], w


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("hc", [1, 4])
def test_matches_the_eager_twin(dtype, tol, hc):
    h, key, v, w = _inputs(3, 17, hc, 64, dtype)
    dead = torch.zeros(3, 17, dtype=torch.bool)
    dead[1, 5:9] = True
    for d in (None, dead):
        out, gates = cpu_gate.gate(h, key, v, w, d, 1e-6, 1e-6)
        ref_out, ref_gates = reference.gate(h, key, v, w, d, 1e-6, 1e-6)
        assert out.dtype == dtype and gates.dtype == dtype
        assert out.shape == h.shape and gates.shape == (3, 17, hc)
        torch.testing.assert_close(gates, ref_gates, rtol=tol, atol=tol)
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    out, gates = cpu_gate.gate(h, key, v, w, dead)
    assert torch.equal(gates[dead], torch.zeros_like(gates[dead]))  # dead positions pass through
    assert torch.equal(out[dead], h[dead])


def test_clamp_and_sign_near_zero():
    """A dot product of 0 or below the clamp: the gate is sigmoid(+-sqrt(clamp)), its sign the dot's."""
    h = torch.zeros(1, 3, 1, 8, dtype=torch.float64)
    h[0, :, 0, 0] = 1.0
    key = torch.zeros(1, 3, 1, 8, dtype=torch.float64)
    key[0, 0, 0, 0], key[0, 1, 0, 0], key[0, 2, 0, 1] = 1e-9, -1e-9, 1.0  # tiny +, tiny -, orthogonal
    v = torch.ones(1, 3, 8, dtype=torch.float64)
    w = torch.ones(1, 8, dtype=torch.float64)
    _, gates = cpu_gate.gate(h, key, v, w, None, 1e-6, 0.25)
    _, ref = reference.gate(h, key, v, w, None, 1e-6, 0.25)
    torch.testing.assert_close(gates, ref, rtol=0, atol=1e-15)
    assert gates[0, 1, 0] < 0.5 < gates[0, 0, 0]


def test_threads_do_not_change_results():
    h, key, v, w = _inputs(2, 3000, 2, 32, torch.float32, seed=1)
    one = cpu_gate.gate(h, key, v, w, threads=1)
    many = cpu_gate.gate(h, key, v, w, threads=3)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_empty_batch():
    h, key, v, w = _inputs(0, 4, 1, 16, torch.float32)
    out, gates = cpu_gate.gate(h, key, v, w)
    assert out.shape == (0, 4, 1, 16) and gates.shape == (0, 4, 1)


def test_refuses_what_it_cannot_serve():
    h, key, v, w = _inputs(1, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="without gradients"):
        cpu_gate.gate(h.requires_grad_(), key, v, w)
    h = h.detach()
    with pytest.raises(ValueError, match="float32/float64"):
        cpu_gate.gate(h.bfloat16(), key.bfloat16(), v.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="shapes do not fit"):
        cpu_gate.gate(h, key, v[:, :1], w)
    with pytest.raises(ValueError, match="dead must be bool"):
        cpu_gate.gate(h, key, v, w, torch.zeros(1, 2, dtype=torch.int64))
    assert not cpu_gate.applies(h.bfloat16(), key.bfloat16(), v.bfloat16(), w.bfloat16())
    with torch.no_grad():
        assert cpu_gate.applies(h.requires_grad_(), key, v, w)  # grad mode off: served


def _module():
    cfg = EngramConfig.preset("tiny")
    torch.manual_seed(0)
    m = Engram(cfg, cfg.layer_ids[0])
    with torch.no_grad():
        m.wkv.weight.normal_(std=0.05)
        m.q_weight.normal_(1.0, 0.1)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, cfg.hc_mult, cfg.hidden_size, generator=g)
    rows = torch.randint(0, m.table.num_rows, (2, 9, m.heads), generator=g)
    dead = torch.zeros(2, 9, dtype=torch.bool)
    dead[0, :2] = True
    return m, h, rows, dead


def test_module_uses_it_without_gradients_and_the_twin_for_training(monkeypatch):
    m, h, rows, dead = _module()
    calls = []
    real = cpu_gate.gate
    monkeypatch.setattr(cpu_gate, "gate", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fast, fast_gates = m(h, rows, dead, return_gates=True)
    assert calls == [1]
    train, train_gates = m(h, rows, dead, return_gates=True)  # parameters want gradients: the twin
    assert calls == [1] and train.requires_grad
    torch.testing.assert_close(fast, train.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fast_gates, train_gates.detach(), rtol=2e-6, atol=2e-6)
    m.use_kernels = False
    with torch.no_grad():
        eager = m(h, rows, dead)
    assert calls == [1]
    assert torch.equal(eager, train.detach())  # the eager path is the training path, bit for bit


def test_one_position_at_a_time_equals_the_whole_sequence():
    """Decoding sees the same gate as scoring a whole sequence: a position's result does not depend
    on the others (the kernel has no cross-position reduction)."""
    h, key, v, w = _inputs(2, 9, 2, 32, torch.float32, seed=4)
    dead = torch.zeros(2, 9, dtype=torch.bool)
    dead[1, 3] = True
    whole, whole_gates = cpu_gate.gate(h, key, v, w, dead)
    for i in range(9):
        s = slice(i, i + 1)
        out, gates = cpu_gate.gate(h[:, s], key[:, s], v[:, s], w, dead[:, s])
        assert torch.equal(out, whole[:, s]) and torch.equal(gates, whole_gates[:, s])
