"""The MoE feed-forward option (engram.model.ffn.MoE) against a plain per-token reference, its
load-balancing loss, parameter counts, and the dense default left bit-identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.model.ffn import MoE, SwiGLU, load_balancing_loss
from engram.model.lm import EngramLM, LMConfig


@torch.no_grad()
def reference_moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token from the definition: softmax router, k best experts, their SwiGLU outputs
    weighted by the renormalised top-k probabilities; aux = E * sum_i f_i * P_i."""
    flat = x.reshape(-1, x.shape[-1])
    e = moe.num_experts
    out = torch.zeros_like(flat)
    counts = torch.zeros(e, dtype=x.dtype)
    probs_sum = torch.zeros(e, dtype=x.dtype)
    for n in range(flat.shape[0]):
        p = torch.softmax(flat[n] @ moe.router.weight.T, dim=-1)
        probs_sum += p
        best = sorted(range(e), key=lambda i: (-float(p[i]), i))[: moe.top_k]
        total = sum(float(p[i]) for i in best)
        for i in best:
            ex = moe.experts[i]
            h = flat[n] @ ex.w13.weight.T
            a, g = h[: h.shape[0] // 2], h[h.shape[0] // 2 :]
            out[n] += (float(p[i]) / total) * ((F.silu(g) * a) @ ex.w2.weight.T)
            counts[i] += 1
    n_tok = flat.shape[0]
    aux = e * ((counts / (n_tok * moe.top_k)) * (probs_sum / n_tok)).sum()
    return out.reshape(x.shape), aux


@settings(max_examples=12, deadline=None)
@given(
    experts=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 1000),
)
def test_moe_matches_reference(experts, data, seed):
    top_k = data.draw(st.integers(1, experts))
    torch.manual_seed(seed)
    moe = MoE(dim=8, hidden=6, num_experts=experts, top_k=top_k).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    got = moe(x)
    want, aux = reference_moe(moe, x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(moe.aux_loss, aux, rtol=1e-9, atol=1e-9)


def test_routing_is_deterministic():
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2)
    x = torch.randn(3, 7, 16)
    a, b = moe(x), moe(x)
    assert torch.equal(a, b)


def test_aux_loss_hand_made_case():
    # 4 tokens, 2 experts, top-1. Tokens 0-2 go to expert 0, token 3 to expert 1: f = (3/4, 1/4).
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    chosen = probs.argmax(-1, keepdim=True)
    p_mean = torch.tensor([2.6 / 4, 1.4 / 4])
    want = 2 * (0.75 * p_mean[0] + 0.25 * p_mean[1])  # = 1.15
    assert float(load_balancing_loss(probs, chosen, 2)) == pytest.approx(float(want))
    assert float(want) == pytest.approx(1.15)
    uniform = torch.full((6, 3), 1 / 3)
    chosen = torch.tensor([[0], [1], [2], [0], [1], [2]])
    assert float(load_balancing_loss(uniform, chosen, 3)) == pytest.approx(1.0)  # balanced: 1


def test_gradients_reach_router_and_experts():
    torch.manual_seed(1)
    moe = MoE(8, 6, 4, 2)
    x = torch.randn(4, 6, 8, requires_grad=True)
    (moe(x).pow(2).sum() + moe.aux_loss).backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    used = [i for i, ex in enumerate(moe.experts) if ex.w13.weight.grad is not None]
    assert used and all(moe.experts[i].w2.weight.grad.abs().sum() > 0 for i in used)
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_lm_with_moe_params_and_aux():
    c = LMConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, mlp_hidden=24, max_seq_len=16, moe_experts=4)
    model = EngramLM(c)
    assert c.expert_hidden == 12
    p = model.num_params()
    per_expert = 3 * 16 * 12
    assert p["moe_idle_experts"] == 2 * (4 - 2) * per_expert
    assert p["activated"] == p["total"] - p["moe_idle_experts"]
    dense = EngramLM(LMConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, mlp_hidden=24, max_seq_len=16))
    routers = 2 * 16 * 4
    assert p["activated"] == dense.num_params()["activated"] + routers  # top-2 of 12 = one dense MLP of 24
    assert model.aux_loss() is None
    logits = model(torch.randint(0, 50, (2, 9)))
    assert logits.shape == (2, 9, 50)
    aux = model.aux_loss()
    assert aux is not None and aux.shape == () and float(aux.detach()) > 0
    assert dense.aux_loss() is None


def test_dense_default_is_unchanged():
    """moe_experts=0 builds the same SwiGLU modules and draws the same initial weights as before."""
    c = LMConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, mlp_hidden=24, max_seq_len=8)
    torch.manual_seed(0)
    model = EngramLM(c)
    assert all(type(b.mlp) is SwiGLU for b in model.blocks)
    assert [n for n, _ in model.named_parameters() if ".mlp." in n] == [
        f"blocks.{i}.mlp.{w}.weight" for i in range(2) for w in ("w13", "w2")
    ]
    torch.manual_seed(0)
    again = EngramLM(LMConfig.from_dict(c.to_dict()))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_bad_moe_config_refused():
    with pytest.raises(ValueError, match="moe_top_k=3"):
        LMConfig(vocab_size=10, dim=16, n_heads=2, moe_experts=2, moe_top_k=3)
    with pytest.raises(ValueError, match="moe_experts=-1"):
        LMConfig(vocab_size=10, dim=16, n_heads=2, moe_experts=-1)
    with pytest.raises(ValueError, match="top_k=0"):
        MoE(8, 4, 2, 0)


def test_trainer_adds_the_load_balancing_loss(corpus):
    """The Trainer trains on loss + moe_aux_coef * aux and records the next-token loss alone."""
    from engram.apps.lm.train import Trainer, build_model, prepare_data
    from training_setup import tiny_cfg

    runs = {}
    for coef in (0.0, 10.0):
        cfg = tiny_cfg(
            corpus, engram=None, moe_experts=4, moe_top_k=2, moe_aux_coef=coef, steps=2, eval_every=0
        )
        data = prepare_data(cfg)
        t = Trainer(cfg, data, build_model(cfg, data))
        first = t.train_step()
        runs[coef] = (first, t.model.blocks[0].mlp.router.weight.detach().clone())
    assert runs[0.0][0] == runs[10.0][0]  # the same model and batch: the same next-token loss
    assert not torch.equal(runs[0.0][1], runs[10.0][1])  # the aux term moved the router
