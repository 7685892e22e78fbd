"""The table optimizers (SparseRowAdam, SparseRowAdagrad, SparseSinkhorn) and the device of their
tables: a load puts the state where the parameters are (a checkpoint written on another device, read
to the host), and a step whose state is on another device than its table (the model moved after the
optimizer made its state) is refused with the fix, the table unchanged. The other device is 'meta'
here, so every check runs on a CPU machine; tests/test_train_device.py moves real runs to a GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engram.checkpoint.optim_state import optimizers_from_tensors, optimizers_to_tensors
from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn
from engram.model.table import TrainableTable

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: SparseRowAdam(ps, lr=1e-2),
    "adagrad": lambda ps: SparseRowAdagrad(ps, lr=1e-2),
    "sinkhorn": lambda ps: SparseSinkhorn(ps, lr=1e-2),
}


def stepped(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
    """A 50 x 8 table on the CPU and its optimizer after one step over rows 1, 2 and 7."""
    torch.manual_seed(0)
    table = TrainableTable(50, 8)
    opt = make([table.weight])
    table.gather(torch.tensor([[1, 2, 2, 7]])).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return table, opt


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_load_puts_the_state_where_the_table_is(name):
    table, opt = stepped(OPTIMIZERS[name])
    saved = tensors_of(opt.state[table.weight])
    elsewhere = TrainableTable(50, 8, device="meta")  # the same table on another device
    other = OPTIMIZERS[name]([elsewhere.weight])
    other.load_state_dict(opt.state_dict())
    moved = tensors_of(other.state[elsewhere.weight])
    assert set(moved) == set(saved) and all(v.device.type == "meta" for v in moved.values())
    assert {k: (v.shape, v.dtype) for k, v in moved.items()} == {
        k: (v.shape, v.dtype) for k, v in saved.items()
    }


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_checkpoints_host_state_loads_onto_the_tables_device(name):
    """What resume does: the optimizer's tensors as a checkpoint holds them (host tensors), loaded into
    an optimizer whose table is on another device."""
    _, opt = stepped(OPTIMIZERS[name])
    tensors, groups = optimizers_to_tensors({"table": opt})
    assert tensors and all(t.device.type == "cpu" for t in tensors.values())
    elsewhere = TrainableTable(50, 8, device="meta")
    other = OPTIMIZERS[name]([elsewhere.weight])
    optimizers_from_tensors({"table": other}, tensors, groups)
    moved = tensors_of(other.state[elsewhere.weight])
    assert moved and all(v.device.type == "meta" for v in moved.values())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_with_its_state_on_another_device_is_refused(name):
    table, opt = stepped(OPTIMIZERS[name])
    before = table.weight.detach().clone()
    state = opt.state[table.weight]
    opt.state[table.weight] = {
        k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }
    table.gather(torch.tensor([[3, 7]])).sum().backward()
    with pytest.raises(ValueError) as e:
        opt.step()
    message = str(e.value)
    assert "of the 50 x 8 table is on meta, the table on cpu" in message
    assert "optimizer.load_state_dict(optimizer.state_dict()) after model.to(device)" in message
    assert torch.equal(table.weight.detach(), before)  # refused before anything changed
