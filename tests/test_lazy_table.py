"""A lazy table (add_engram under a process group, or lazy_tables=True) is not among the model's
parameters until drawn: a training forward that would draw it after an optimizer was built over
model.parameters() is refused by name (the table would silently never train); the ways to draw it
first work, and a no-grad forward draws it."""

from __future__ import annotations

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram, build_optimizer
from engram.model.table import TrainableTable


def _model(lazy: bool) -> torch.nn.Module:
    return add_engram(
        S.llama(seed=3), S.engram_config(), compression=S.compression(), seed=5, lazy_tables=lazy
    )


def test_a_training_forward_does_not_draw_a_lazy_table_behind_the_optimizer():
    model = _model(lazy=True)
    table = model.engram.module(1).table
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before the table exists
    ids = S.batch(2, 10, seed=1)
    with pytest.raises(RuntimeError, match=r"lazy \(seed .*prepare_data_parallel.*lazy_tables=False"):
        model(input_ids=ids, labels=ids)
    assert table.is_lazy  # nothing drawn
    assert not any(p.shape[0] == table.num_rows for g in opt.param_groups for p in g["params"])

    table.materialize()  # drawn first: the optimizer built now holds it, and the step reaches it
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # SGD takes the sparse gradient
    assert any(p is table.weight for g in opt.param_groups for p in g["params"])
    model(input_ids=ids, labels=ids).loss.backward()
    assert table.weight.grad is not None
    opt.step()


def test_build_optimizer_and_no_grad_forwards_draw_it():
    model = _model(lazy=True)
    build_optimizer(model)  # draws the table among the optimizer's
    assert not model.engram.module(1).table.is_lazy
    ids = S.batch(2, 10, seed=1)
    model(input_ids=ids, labels=ids).loss.backward()

    model = _model(lazy=True)
    with torch.no_grad():
        model(input_ids=ids)
    assert not model.engram.module(1).table.is_lazy


def test_a_plain_lazy_table_under_grad_is_refused_and_drawn_under_no_grad():
    t = TrainableTable(100, 8, seed=1, lazy=True)
    rows = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="100 x 8 table is lazy"):
        t.gather(rows)
    with torch.no_grad():
        out = t.gather(rows)
    assert out.shape == (1, 3, 8) and not t.is_lazy
    assert torch.equal(t.gather(rows), out)
