from __future__ import annotations

import math

import pytest
import torch

from engram import EngramConfig, Layout, NgramHasher
from engram.model.module import Engram
from engram.model.table import TrainableTable

TINY = EngramConfig.preset("tiny")  # V4.1 variant, 1 layer, orders 2-3, 4 heads: 8 rows of 32
DEMO = EngramConfig.preset("demo-v1").replace(
    layer_ids=(1,), engram_vocab_size=(1000, 1000), hidden_size=48, head_dim=16, name="demo-small"
)


def random_rows(config: EngramConfig, layer_id: int, b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    layer = Layout(config).layer(layer_id)
    cols = [
        torch.randint(int(o), int(o + p), (b, t), generator=gen)
        for o, p in zip(layer.offsets, layer.flat_primes, strict=True)
    ]
    return torch.stack(cols, dim=-1)


def randomized(module: Engram, gen: torch.Generator) -> Engram:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.3 if p.dim() > 1 else 1.0))
    return module


def plain_v41(module: Engram, h, rows, dead):
    """SPEC §6, line by line, one (b, t, m) at a time in float64."""
    c = module.config
    table = module.table.weight.double()
    wkv = module.wkv.weight.double()
    qw, kw = module.q_weight.double(), module.k_weight.double()
    dim, hc = c.hidden_size, c.hc_mult
    out = h.clone().double()
    gates = torch.zeros(h.shape[:3], dtype=torch.float64)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            e = torch.cat([table[int(r)] for r in rows[b, t]])
            kv = wkv @ e
            v = kv[hc * dim :]
            for m in range(hc):
                key = kv[m * dim : (m + 1) * dim]
                hm = h[b, t, m].double()
                w = qw[m] * kw[m]
                dot = (hm * w * key).sum()
                dot = dot / math.sqrt((hm**2).mean() + c.norm_eps) / math.sqrt((key**2).mean() + c.norm_eps)
                dot = dot * dim**-0.5
                s = math.copysign(math.sqrt(max(abs(float(dot)), 1e-6)), float(dot))
                g = 0.0 if dead is not None and dead[b, t] else 1 / (1 + math.exp(-s))
                gates[b, t, m] = g
                out[b, t, m] = hm + g * v
    return out, gates


def test_v41_matches_plain_spec():
    gen = torch.Generator().manual_seed(0)
    m = randomized(Engram(TINY, 1, dtype=torch.float64), gen)
    h = torch.randn(2, 6, TINY.hc_mult, TINY.hidden_size, generator=gen, dtype=torch.float64) * 3
    rows = random_rows(TINY, 1, 2, 6, gen)
    dead = torch.zeros(2, 6, dtype=torch.bool)
    dead[1, 2:4] = True
    out, gates = m(h, rows, dead, return_gates=True)
    with torch.no_grad():
        ref_out, ref_gates = plain_v41(m, h, rows, dead)
    err = (out - ref_out).abs().max().item()
    assert err < 1e-10, f"max abs error {err}"
    assert (gates - ref_gates).abs().max().item() < 1e-12
    assert torch.equal(out[1, 2:4], h[1, 2:4])  # dead positions pass through unchanged
    assert (gates[1, 2:4] == 0).all()


def test_gate_initial_and_streams_share_value():
    gen = torch.Generator().manual_seed(1)
    m = Engram(TINY, 1, dtype=torch.float64)
    h = torch.randn(1, 4, TINY.hc_mult, TINY.hidden_size, generator=gen, dtype=torch.float64)
    rows = random_rows(TINY, 1, 1, 4, gen)
    out, gates = m(h, rows, return_gates=True)
    assert ((gates > 0) & (gates < 1)).all()
    delta = (out - h) / gates[..., None]
    assert torch.allclose(delta[:, :, 0], delta[:, :, 1])  # one shared value for every stream


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_gradcheck_tiny_double():
    gen = torch.Generator().manual_seed(2)
    cfg = TINY.replace(hidden_size=8, head_dim=4, hc_mult=2, engram_vocab_size=(7, 7), n_heads=2)
    m = randomized(Engram(cfg, 1, dtype=torch.float64), gen)
    h = torch.randn(1, 3, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = random_rows(cfg, 1, 1, 3, gen)
    frozen_table = m.table.weight.detach().clone()

    def f(h, wkv, qw, kw):
        params = {"wkv.weight": wkv, "q_weight": qw, "k_weight": kw, "table.weight": frozen_table}
        return torch.func.functional_call(m, params, (h, rows))

    args = [h] + [p.detach().clone().requires_grad_() for p in (m.wkv.weight, m.q_weight, m.k_weight)]
    assert torch.autograd.gradcheck(f, tuple(args))


def test_table_gradient_touches_exactly_looked_up_rows():
    gen = torch.Generator().manual_seed(3)
    m = randomized(Engram(TINY, 1), gen)
    h = torch.randn(2, 5, TINY.hc_mult, TINY.hidden_size, generator=gen)
    rows = random_rows(TINY, 1, 2, 5, gen)
    rows[1, 4] = rows[0, 0]  # a repeated row is gathered once and gets one gradient entry
    m(h, rows).square().sum().backward()
    grad = m.table.weight.grad
    assert grad.is_sparse
    grad = grad.coalesce()
    touched = set(grad.indices()[0].tolist())
    assert touched == set(rows.flatten().tolist())
    assert grad.indices().shape[1] == len(touched)
    # the sparse gradient equals the dense gradient of a plain indexing lookup
    m2 = randomized(Engram(TINY, 1), torch.Generator().manual_seed(3))
    m2.table.gather = lambda r, dtype=None: m2.table.weight[r]  # dense-gradient twin
    m2(h, rows).square().sum().backward()
    assert torch.allclose(grad.to_dense(), m2.table.weight.grad, atol=1e-6)
    untouched = torch.ones(m2.table.num_rows, dtype=torch.bool)
    untouched[rows.flatten()] = False
    assert (m2.table.weight.grad[untouched] == 0).all()


def plain_demo(module: Engram, h, rows):
    """The paper's demo, step by step (float64)."""
    c = module.config
    e = module.table.weight.double()[rows].flatten(-2)
    hc, dim = c.hc_mult, c.hidden_size

    def rms(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    gates = []
    for m in range(hc):
        kp = module.key_projs[m]
        key = rms(
            e @ kp.weight.double().T + kp.bias.double(),
            module.key_norms[m].weight.double(),
            torch.finfo(torch.float64).eps,
        )
        q = rms(h[:, :, m].double(), module.query_norms[m].weight.double(), torch.finfo(torch.float64).eps)
        s = (key * q).sum(-1) / math.sqrt(dim)
        gates.append(torch.sigmoid(s.abs().clamp_min(1e-6).sqrt() * s.sign()))
    g = torch.stack(gates, 2)
    vp = module.value_proj
    value = g[..., None] * (e @ vp.weight.double().T + vp.bias.double())[:, :, None, :]
    conv = module.short_conv
    normed = torch.stack([rms(value[:, :, m], conv.norms[m].weight.double(), 1e-5) for m in range(hc)], 2)
    k, dil, t = c.kernel_size, c.max_ngram_size, h.shape[1]
    w = conv.conv.weight.double().view(hc, dim, k)  # channel (m, d) has taps w[m, d, :]
    y = torch.zeros_like(normed)
    for tt in range(t):
        for j in range(k):
            src = tt - (k - 1 - j) * dil
            if src >= 0:
                y[:, tt] += w[:, :, j] * normed[:, src]
    return h.double() + value + torch.nn.functional.silu(y), g


def test_demo_v1_matches_plain_demo():
    gen = torch.Generator().manual_seed(4)
    m = randomized(Engram(DEMO, 1, dtype=torch.float64), gen)
    h = torch.randn(2, 9, DEMO.hc_mult, DEMO.hidden_size, generator=gen, dtype=torch.float64)
    rows = random_rows(DEMO, 1, 2, 9, gen)
    out, gates = m(h, rows, return_gates=True)
    with torch.no_grad():
        ref_out, ref_gates = plain_demo(m, h, rows)
    assert (out - ref_out).abs().max().item() < 1e-10
    assert (gates - ref_gates).abs().max().item() < 1e-12


def test_demo_conv_is_causal():
    gen = torch.Generator().manual_seed(5)
    m = randomized(Engram(DEMO, 1, dtype=torch.float64), gen)
    h = torch.randn(1, 10, DEMO.hc_mult, DEMO.hidden_size, generator=gen, dtype=torch.float64)
    rows = random_rows(DEMO, 1, 1, 10, gen)
    a = m(h, rows)
    h2, rows2 = h.clone(), rows.clone()
    h2[:, 7:] += 1.0
    rows2[:, 7:] = rows[:, 0:1]
    b = m(h2, rows2)
    assert torch.equal(a[:, :7], b[:, :7])


@pytest.mark.parametrize("config", [TINY, DEMO], ids=["v4.1", "demo-v1"])
def test_bf16_close_to_fp32(config):
    gen = torch.Generator().manual_seed(6)
    m = randomized(Engram(config, 1), gen)
    h = torch.randn(2, 5, config.hc_mult, config.hidden_size, generator=gen)
    rows = random_rows(config, 1, 2, 5, gen)
    out32 = m(h, rows)
    m16 = m.to(torch.bfloat16)
    out16 = m16(h.bfloat16(), rows)
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - out32).abs().max().item() < 0.1 * out32.abs().max().item()


@pytest.mark.gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(7)
    m = randomized(Engram(TINY, 1), gen)
    h = torch.randn(2, 5, TINY.hc_mult, TINY.hidden_size, generator=gen)
    rows = random_rows(TINY, 1, 2, 5, gen)
    ref = m(h, rows)
    out = m.cuda()(h.cuda(), rows.cuda())
    assert torch.allclose(out.cpu(), ref, atol=1e-5)


def test_token_ids_with_hasher(ds_compression):
    hasher = NgramHasher(TINY, ds_compression)
    m = Engram(TINY, 1, hasher=hasher)
    ids = torch.randint(0, 129280, (2, 7))
    h = torch.randn(2, 7, TINY.hc_mult, TINY.hidden_size)
    rows = torch.from_numpy(hasher.hash(ids.numpy())[:, :, 0])
    assert torch.equal(m(h, token_ids=ids), m(h, rows))


def test_bad_inputs():
    m = Engram(TINY, 1)
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(2, 5, TINY.hc_mult, TINY.hidden_size)
    rows = random_rows(TINY, 1, 2, 5, gen)
    with pytest.raises(ValueError, match=r"hc=2, dim=64"):
        m(h[:, :, :1], rows)
    with pytest.raises(ValueError, match=r"unsqueeze"):
        m(h[:, :, 0], rows)
    with pytest.raises(ValueError, match=r"rows must have shape \[B, T, 8\]"):
        m(h, rows[..., :4])
    with pytest.raises(ValueError, match="layer_index"):
        m(h, rows[:, :, None])
    with pytest.raises(ValueError, match=r"row id 33048 .* \[0, 33048\)"):
        m(h, torch.full_like(rows, 33048))
    with pytest.raises(TypeError, match="int64 or int32"):
        m(h, rows.float())
    with pytest.raises(TypeError, match="floating point"):
        m(h.long(), rows)
    with pytest.raises(ValueError, match="dead_mask"):
        m(h, rows, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="exactly one"):
        m(h)
    with pytest.raises(ValueError, match="no hasher"):
        m(h, token_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="layer 2 has no Engram"):
        Engram(TINY, 2)
    with pytest.raises(ValueError, match="addresses 33048"):
        Engram(TINY, 1, table=TrainableTable(100, 32))
    with pytest.raises(ValueError, match="head_dim=32"):
        Engram(TINY, 1, table=TrainableTable(33048, 16))
