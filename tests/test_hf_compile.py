"""torch.compile on a Hugging Face model with Engram attached: the compiled model equals eager from
its first call (the hasher set up inside it), with and without padding, at a second shape, through
a training step and in generate(). The host work (hashing, decode states), the table gather and the
kernel gate stay out of the graph (`torch.compiler.disable`, see engram.hf.hooks), so
fullgraph=True is refused.

Tolerances: backend="eager" runs dynamo's graphs as eager runs the code: equal bit for bit
(logits, loss, every gradient, every parameter after a step). Inductor reorders and fuses float32
sums (measured on these models, 2 CPU cores): logits within atol 1e-6 (measured <= 9e-8, logits of
about 0.4); gradients within rtol 1e-4 / atol 1e-6 (measured 3e-8 abs, 1e-5 relative); parameters
after one AdamW step at lr 1e-3 within atol 5e-5 (measured 6.5e-6: Adam's first step is about
lr * sign(g), and where g ~ 0 rounding moves it); greedy tokens equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_setup as S
from engram.hf import EngramCollator, add_engram, build_optimizer

transformers = pytest.importorskip("transformers")

NEW = 6
_INDUCTOR = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing (dynamo's caches are per code object, shared across models)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(layers: int = 3, engram_layers: tuple[int, ...] = (0, 2)):
    """A tiny Llama with a trained-looking Engram (it must change the logits), never called yet."""
    model = S.llama(layers=layers, seed=0)
    add_engram(model, S.engram_config(engram_layers), compression=S.compression())
    with torch.no_grad():
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.5)
            m.table.weight.normal_(std=1.0)
    return model


def _left_padded(t: int = 6):
    ids = S.batch(2, t, seed=3)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


class _Recorder:
    """A backend that runs dynamo's graphs as they are, as backend="eager" does, and keeps them."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):
        self.graphs.append(gm)
        return gm.forward

    def traced_engram(self) -> bool:
        """Whether a graph holds an Engram projection (`wkv`): the layer math is compiled, not skipped."""
        return any(n.op == "placeholder" and "wkv" in n.name for gm in self.graphs for n in gm.graph.nodes)


def _backend(backend: str):
    return _Recorder() if backend == "eager" else backend


def _same(got: torch.Tensor, ref: torch.Tensor, backend: str) -> None:
    if backend == "eager":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, **_INDUCTOR)


def _forward_equals_eager(backend: str, layers: int, engram_layers: tuple[int, ...]) -> None:
    model = _model(layers, engram_layers)
    run = _backend(backend)
    compiled = torch.compile(model, backend=run)
    pad_ids, mask = _left_padded()
    other = S.batch(3, 5, seed=2)  # a second shape, no padding: dynamo recompiles
    with torch.no_grad():
        # compiled first: the hasher's lazy set-up happens in the compiled call
        got = [compiled(pad_ids, attention_mask=mask).logits, compiled(other).logits]
        ref = [model(pad_ids, attention_mask=mask).logits, model(other).logits]
        plain = S.llama(layers=layers, seed=0)(other).logits
    for g, r in zip(got, ref, strict=True):
        _same(g, r, backend)
    assert not torch.allclose(ref[1], plain)  # Engram changes the logits compared here
    if isinstance(run, _Recorder):
        assert run.traced_engram()


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_compiled_forward_equals_eager():
    _forward_equals_eager("eager", 3, (0, 2))


@pytest.mark.slow
def test_compiled_forward_equals_eager_inductor():
    """Inductor on the CPU (about a minute on 2 cores, cold: its C++ compile of each graph)."""
    _forward_equals_eager("inductor", 2, (1,))


def test_fullgraph_is_refused_at_the_host_work():
    """The stack's pre-hook hashes on the host (outside the graph: `engram.model.graph_break`): no single
    graph holds it; the break is where that hook is first entered."""
    compiled = torch.compile(_model(), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"(?s)graph_break\.py.*disable"), torch.no_grad():
        compiled(S.batch(1, 4))


def _grads(model, opt) -> dict[str, torch.Tensor]:
    """Every gradient by parameter name (the tables': sparse, held by the optimizer until its step)."""
    out = {n: opt.pending.get(p, p.grad) for n, p in model.named_parameters()}
    return {n: g for n, g in out.items() if g is not None}


def _train_step_equals_eager(backend: str, layers: int, engram_layers: tuple[int, ...]) -> None:
    """One AdamW + SparseRowAdam step on a collator's batch (engram_rows, padding, labels)."""
    model = _model(layers, engram_layers)
    ref_model = copy.deepcopy(model)
    features = [{"input_ids": S.batch(1, n, seed=10 + n)[0].tolist()} for n in (7, 5)]
    batch = EngramCollator(model, pad_token_id=0)(features)
    run = _backend(backend)
    losses, grads = [], []
    for m, call in ((model, torch.compile(model, backend=run)), (ref_model, ref_model)):
        opt = build_optimizer(m, lr=1e-3, table_lr=1e-2)
        loss = call(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        got = _grads(m, opt)
        assert all(got[f"engram.layers.{i}.table.weight"].is_sparse for i in engram_layers)
        grads.append({n: g.to_dense() if g.is_sparse else g.clone() for n, g in got.items()})
        opt.step()
    if isinstance(run, _Recorder):
        assert run.traced_engram()
    _same(losses[0], losses[1], backend)
    assert grads[0].keys() == grads[1].keys()
    params, ref_params = dict(model.named_parameters()), dict(ref_model.named_parameters())
    for name, g in grads[0].items():
        if backend == "eager":
            assert torch.equal(g, grads[1][name]), name
            assert torch.equal(params[name], ref_params[name]), name
        else:  # Adam's first step is lr * sign(g) where g ~ 0: rounding moves it by a part of lr
            torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(params[name], ref_params[name], rtol=0, atol=5e-5, msg=name)


def test_compiled_training_step_equals_eager():
    _train_step_equals_eager("eager", 3, (0, 2))


@pytest.mark.slow
def test_compiled_training_step_equals_eager_inductor():
    _train_step_equals_eager("inductor", 2, (1,))


def _generate_equals_eager(backend: str) -> None:
    """generate() of a model compiled in place (model.compile: generate calls the model itself),
    greedy, left-padded: the decode states of the cache are kept outside the graph."""
    model = _model()
    ref_model = copy.deepcopy(model)
    run = _backend(backend)
    model.compile(backend=run)
    ids, mask = _left_padded()
    kw = {"max_new_tokens": NEW, "min_new_tokens": NEW, "pad_token_id": 0, "do_sample": False}
    got = model.generate(ids, attention_mask=mask, **kw)
    ref = ref_model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, ref)
    if isinstance(run, _Recorder):
        assert run.traced_engram()


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_compiled_generate_equals_eager():
    _generate_equals_eager("eager")


@pytest.mark.slow
def test_compiled_generate_equals_eager_inductor():
    _generate_equals_eager("inductor")
