"""Sparse, row-wise optimizers for Engram tables (parameters whose gradient touches few rows).

`SparseRowAdam` (per-element momentum, per-row second moment and step count: the tables'
default) and `SparseRowAdagrad` (one accumulator per row) take sparse COO gradients, refuse dense
ones, and read and write only the touched rows, lazily; `split_param_groups` separates the
tables from the dense backbone. Knows parameters and their gradients, nothing of how the rows
were looked up or where the table lives. Design: docs/model.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engram.model.saved_state import check_number, check_state_device, first_bad_row, saved_param_states
from engram.model.table import TrainableTable
from engram.storage import hugepages

__all__ = [
    "DenseTableAdam",
    "SparseRowAdagrad",
    "SparseRowAdam",
    "check_number",
    "check_table_param",
    "split_param_groups",
    "state_dtype",
    "takes_sparse_gradient",
    "touched_rows",
]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """fp64 parameters keep fp64 state (exact reference checks); every other dtype keeps fp32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _same_kind(stored: torch.dtype, kept: torch.dtype) -> bool:
    """Whether stored state of dtype `stored` may load (cast) as `kept`: float into float, integer into
    integer (the same bytes read as the other kind are other numbers)."""
    if stored.is_complex or stored == torch.bool:
        return False
    return stored.is_floating_point == kept.is_floating_point


# the tables a sparse row optimizer was built over (it takes their sparse gradients): a table whose sparse
# gradient nothing takes is refused where it is accumulated (engram.hf: the Trainer's default AdamW)
# (by id with a weak reference: a tensor's == is elementwise, so tensors cannot key a WeakSet)
_SPARSE_TAKEN: dict[int, weakref.ref[torch.Tensor]] = {}


def takes_sparse_gradient(p: torch.Tensor) -> bool:
    """Whether a sparse row optimizer (SparseRowAdam, SparseRowAdagrad, SparseSinkhorn) holds `p`."""
    ref = _SPARSE_TAKEN.get(id(p))
    return ref is not None and ref() is p


def check_table_param(p: torch.Tensor, opt_name: str) -> None:
    """Refuse what a sparse row optimizer cannot update; record `p` as one whose sparse gradient it takes."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{opt_name} params must be tensors, got {type(p).__name__}")
    if p.dim() != 2:
        raise ValueError(
            f"{opt_name} updates tables [num_rows, dim]; got a parameter of shape {tuple(p.shape)}. "
            "Give other parameters to torch.optim.AdamW (see engram.model.optim.split_param_groups)."
        )
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(f"{opt_name} needs a fp32, bf16, fp16 or fp64 table, got {p.dtype}")
    key = id(p)
    _SPARSE_TAKEN[key] = weakref.ref(p, lambda _: _SPARSE_TAKEN.pop(key, None))


def touched_rows(p: torch.Tensor, dtype: torch.dtype, opt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (U,) int64, distinct and sorted; grad rows (U, dim) in `dtype`) from p's sparse grad."""
    grad = p.grad
    assert grad is not None
    if grad.layout != torch.sparse_coo:
        raise TypeError(
            f"{opt_name} needs a sparse COO gradient, got a {grad.layout} gradient for the parameter of "
            f"shape {tuple(p.shape)}: look rows up with TrainableTable.gather (or "
            "F.embedding(..., sparse=True)), or use torch.optim.AdamW for dense parameters"
        )
    if grad.shape != p.shape:
        raise ValueError(f"gradient shape {tuple(grad.shape)} != parameter shape {tuple(p.shape)}")
    if grad.sparse_dim() == 1 and not grad.is_coalesced():
        # TrainableTable.gather's gradient lists sorted distinct rows but is not flagged coalesced;
        # checking that (one pass over U ids) is far cheaper than the sort inside coalesce().
        idx = grad._indices()[0]
        if idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):  # sync point on CUDA
            return idx, grad._values().to(dtype)
    # Cast before coalescing so repeated rows of a bf16 gradient are summed in fp32.
    grad = grad.to(dtype).coalesce()  # sync point on CUDA (the nnz of the result)
    if grad.sparse_dim() == 1:  # hybrid: indices (1, U), values (U, dim); what embeddings produce
        return grad.indices()[0], grad.values()
    # Fully sparse: indices (2, nnz), values (nnz,). Scatter into one dense row per touched row.
    idx = grad.indices()
    rows, inverse = torch.unique(idx[0], return_inverse=True)  # (U,), (nnz,)
    vals = grad.values().new_zeros(rows.numel(), p.shape[1])  # (U, dim)
    vals[inverse, idx[1]] = grad.values()  # coalesced: each (row, col) once
    return rows, vals


def _mean_square(g: torch.Tensor) -> torch.Tensor:
    """mean(g_r ** 2) per row, (U, dim) -> (U,), in one pass (no (U, dim) temporary)."""
    return torch.linalg.vector_norm(g, dim=1).square_().div_(g.shape[1])


class _SparseRowOptimizer(torch.optim.Optimizer):
    """The step loop (closure, touched rows, lazy state), shared checks, state validation and the
    dtype-preserving `load_state_dict`; subclasses give `_check_group`, `expected_state`, `_init_state`
    and `_update`."""

    _name = "sparse row optimizer"
    _hyperparameters: tuple[str, ...] = ()  # every group's keys besides "params" (a saved group's too)
    _nonnegative: frozenset[str] = frozenset()  # state keys whose values are >= 0 (counts, sums of squares)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """Refuse a group's hyperparameters (constructor arguments, an added or a saved group alike);
        `where` names the group in the message."""
        raise NotImplementedError

    def expected_state(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Key -> (shape, dtype) of each state tensor of parameter `p` once it has stepped (what
        `load_state_dict` accepts; checkpoints check their stored state against it)."""
        raise NotImplementedError

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, sd: torch.dtype) -> dict[str, torch.Tensor]:
        """The state of `p` at its first step (the only allocation a step makes)."""
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        g: torch.Tensor,
        sd: torch.dtype,
    ) -> None:
        """Update the touched `rows` (U,) of `p` and their state from their gradient g (U, dim)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update the rows each table's sparse gradient touches, and their state.

        Every gradient and state is read and checked before any table or state changes; a table's
        state is allocated at its first step (the only allocation a step makes).

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            TypeError: A gradient is dense (look rows up with `TrainableTable.gather`, or give dense
                parameters to torch.optim.AdamW).
            ValueError: A gradient's shape is not its parameter's, or a state is on another device.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every gradient and state is read and checked before any table or state changes.
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                check_state_device(self._name, p, self.state.get(p, {}))
                sd = state_dtype(p)
                rows, g = touched_rows(p, sd, self._name)  # (U,), (U, dim)
                work.append((group, p, rows, g, sd))
        for group, p, rows, g, sd in work:
            if not self.state[p]:
                self.state[p] = self._init_state(group, p, sd)
            if rows.numel():
                self._update(group, p, self.state[p], rows, g, sd)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of tables, checked as the constructor checks its arguments.

        Args:
            param_group: "params" (tables [num_rows, dim] in fp32, bf16, fp16 or fp64) and any
                hyperparameters (the defaults fill the rest).

        Raises:
            TypeError: A parameter is not a tensor or has another dtype.
            ValueError: A parameter is not 2-D, is already in a group, or a hyperparameter is out of range.
        """
        super().add_param_group(param_group)  # fills defaults, refuses duplicated params
        group = self.param_groups[-1]
        for p in group["params"]:
            check_table_param(p, self._name)
        self._check_group(group, f"param group {len(self.param_groups) - 1}")

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse what `load_state_dict` would refuse, changing nothing.

        A caller that loads several optimizers checks them all first.

        Args:
            state_dict: A `state_dict()` of this kind of optimizer.

        Raises:
            ValueError: The groups, hyperparameters, ids or a state's keys, dtypes, shapes or values
                do not fit this optimizer (e.g. NaN, or a state of another table size).
        """
        self._saved_states(state_dict)

    def _saved_states(self, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, Any]]:
        """(saved id, parameter, saved state or None), every part of `state_dict` checked: its groups'
        hyperparameters as the constructor checks them, ids, and each state's keys, dtypes, shapes and
        values."""
        saved = saved_param_states(
            self._name, state_dict, self.param_groups, self._hyperparameters, self._check_group
        )
        for pid, p, entry in saved:
            if entry is not None:
                self._check_saved_state(pid, entry, p)
        return saved

    def _check_saved_state(self, pid: int, saved: Any, p: torch.Tensor) -> None:
        expected = self.expected_state(p)
        if not isinstance(saved, dict):
            raise ValueError(
                f"saved state of parameter {pid} is a {type(saved).__name__}, {self._name} keeps a dict of "
                f"{sorted(expected)}: the saved state is damaged or of another optimizer"
            )
        if set(saved) != set(expected):
            raise ValueError(
                f"saved state of parameter {pid} has keys {sorted(map(repr, saved))}, {self._name} expects "
                f"{sorted(expected)}: was it saved by another optimizer?"
            )
        for key, (shape, dtype) in expected.items():
            value = saved[key]
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"saved state {key!r} of parameter {pid} is a {type(value).__name__}, not a tensor: the "
                    "saved state is damaged or of another optimizer"
                )
            if not _same_kind(value.dtype, dtype):  # an int32 momentum would load cast, as garbage
                raise ValueError(
                    f"saved state {key!r} of parameter {pid} has dtype {value.dtype}, {self._name} keeps "
                    f"it as {dtype}: the saved state is damaged or of another optimizer"
                )
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"saved state {key!r} of parameter {pid} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(p.shape)} needs {shape}: does the table size match?"
                )
            nonneg = key in self._nonnegative
            bad = first_bad_row(value, nonnegative=nonneg)
            if bad is not None:
                what = "NaN, Inf or a negative value" if nonneg else "NaN or Inf"
                raise ValueError(
                    f"saved state {key!r} of parameter {pid} holds {what} at row {bad}: a damaged state"
                )

    def load_state_dict(self, state_dict: dict[str, Any], *, copy: bool = True) -> None:
        """Load a `state_dict()`, checked whole before anything changes (`check_state_dict`).

        State keeps its fp32/int32 dtypes (torch's default casts floating state to the parameter's
        dtype, which would round the fp32 momentum of a bf16 table, and int32 step counts to float).

        Args:
            state_dict: A `state_dict()` of this kind of optimizer.
            copy: True: the state is copied, not shared. False: the optimizer takes the given
                tensors where they already have the state's dtype and device (a caller that read
                them fresh, e.g. a resuming rank, so its state is held once, not twice).

        Raises:
            ValueError: See `check_state_dict`.
        """
        saved = self._saved_states(state_dict)
        # hyperparameters, param mapping; the state is set below (torch's load would cast a bf16
        # table's fp32 state to bf16 first: a transient copy)
        super().load_state_dict({**state_dict, "state": {}})
        for _, p, entry in saved:
            if entry is None:
                continue
            self.state[p] = {
                key: entry[key].to(device=p.device, dtype=dtype, copy=copy)
                for key, (_, dtype) in self.expected_state(p).items()
            }


class SparseRowAdam(_SparseRowOptimizer):
    """Adam for tables: per-element momentum, per-row second moment and step count, lazy.

    For each row r present in the (coalesced) sparse gradient g, with its own count t_r:

        m_r  = b1 * m_r + (1 - b1) * g_r                        # (dim,)
        v_r  = b2 * v_r + (1 - b2) * mean(g_r ** 2)             # scalar per row
        t_r  = t_r + 1
        w_r -= lr * ( (m_r / (1 - b1**t_r)) / (sqrt(v_r / (1 - b2**t_r)) + eps) + weight_decay * w_r )

    The weight decay is decoupled (AdamW-style, scaled by lr) and applies to touched rows only.
    Rows absent from the gradient are not read or written (their m, v, t do not decay).

    State per table [num_rows, dim] (keys of `optimizer.state[p]`):
        "exp_avg"        [num_rows, dim]  fp32  momentum m (the only full-size state)
        "exp_avg_sq_row" [num_rows]       fp32  second moment v
        "step"           [num_rows]       int32 t
    Memory: 4 * num_rows * dim + 8 * num_rows bytes, i.e. 4 + 8 / dim bytes per parameter
    (4.03 at dim 256) for fp32/bf16/fp16 tables; fp64 tables keep fp64 m and v (8 + 12 / dim).
    Allocated (zeros) at a table's first step.

    Args:
        params: Tables [num_rows, dim] (fp32, bf16, fp16 or fp64) with sparse gradients, or
            param groups of them.
        lr: As torch's Adam/SparseAdam: the normalised update moves each element by about lr,
            i.e. 5% of the default 0.02 init std per step.
        betas: (b1, b2), each in [0, 1).
        eps: Added to the denominator; > 0.
        weight_decay: Decoupled weight decay, >= 0.

    Raises:
        TypeError: A parameter is not a tensor, or has another dtype.
        ValueError: A parameter is not 2-D, or a hyperparameter is out of range.

    Examples:
        >>> import torch
        >>> from engram import SparseRowAdam, TrainableTable
        >>> table = TrainableTable(1000, 32)
        >>> opt = SparseRowAdam(table.parameters(), lr=1e-3)
        >>> before = table.weight.detach().clone()
        >>> table.gather(torch.tensor([3, 3, 7])).sum().backward()
        >>> opt.step()
        >>> (table.weight != before).any(dim=1).nonzero().flatten().tolist()  # only the touched rows
        [3, 7]
        >>> opt.state[table.weight]["step"][[3, 7, 8]].tolist()  # a step count per row
        [1, 1, 0]
    """

    _name = "SparseRowAdam"
    _hyperparameters = ("lr", "betas", "eps", "weight_decay")
    _nonnegative = frozenset({"exp_avg_sq_row", "step"})

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        check_number("lr", group["lr"], 0.0, where=where)
        betas = group["betas"]
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):  # < 1: bias correction divides by 1 - beta**t
            check_number(f"betas[{i}]", b, 0.0, 1.0, hi_open=True, where=where)
        # eps = 0 would make a touched row with an all-zero gradient and zero v compute 0 / 0.
        check_number("eps", group["eps"], 0.0, lo_open=True, where=where)
        check_number("weight_decay", group["weight_decay"], 0.0, where=where)

    def expected_state(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The state of a table once it has stepped: what `load_state_dict` accepts.

        Checkpoints check their stored state against it.

        Args:
            p: A table [num_rows, dim].

        Returns:
            Key -> (shape, dtype): "exp_avg" [num_rows, dim], "exp_avg_sq_row" [num_rows] (fp32,
                fp64 for an fp64 table) and "step" [num_rows] int32.
        """
        sd = state_dtype(p)
        return {
            "exp_avg": (tuple(p.shape), sd),
            "exp_avg_sq_row": ((p.shape[0],), sd),
            "step": ((p.shape[0],), torch.int32),
        }

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, sd: torch.dtype) -> dict[str, torch.Tensor]:
        return {
            "exp_avg": hugepages.empty(
                tuple(p.shape), dtype=sd, device=p.device
            ).zero_(),  # the one full-size state
            "exp_avg_sq_row": torch.zeros(p.shape[0], dtype=sd, device=p.device),
            "step": torch.zeros(p.shape[0], dtype=torch.int32, device=p.device),
        }

    def _update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        g: torch.Tensor,
        sd: torch.dtype,
    ) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        m_all, v_all, t_all = state["exp_avg"], state["exp_avg_sq_row"], state["step"]

        # Few passes over the (U, dim) rows: the step is memory-bound on gathers/scatters.
        m = m_all.index_select(0, rows).lerp_(g, 1 - b1)  # (U, dim): b1 * m + (1 - b1) * g
        m_all.index_copy_(0, rows, m)
        v = v_all.index_select(0, rows).lerp_(_mean_square(g), 1 - b2)  # (U,)
        v_all.index_copy_(0, rows, v)
        t = t_all.index_select(0, rows).add_(1)  # (U,) int32
        t_all.index_copy_(0, rows, t)

        tf = t.to(sd)
        bc1 = 1 - torch.pow(b1, tf)  # (U,)
        bc2 = 1 - torch.pow(b2, tf)
        denom = (v / bc2).sqrt_().add_(eps)  # (U,)
        scale = denom.mul_(bc1).reciprocal_().mul_(-lr)  # (U,): -lr / (bc1 * denom)
        w = p.index_select(0, rows).to(sd)  # (U, dim), a copy in the state dtype
        if wd != 0:
            w.mul_(1 - lr * wd)  # w - lr * wd * w
        w.addcmul_(m, scale[:, None])
        p.index_copy_(0, rows, w.to(p.dtype))


class SparseRowAdagrad(_SparseRowOptimizer):
    """Row-wise Adagrad for tables: one accumulator per row, lazy.

    For each row r present in the (coalesced) sparse gradient g:

        acc_r  = acc_r + mean(g_r ** 2)                          # scalar per row
        w_r   -= lr * g_r / (sqrt(acc_r) + eps)

    Rows absent from the gradient are not read or written.

    State per table [num_rows, dim]: "sum_row" [num_rows] fp32 (fp64 for fp64 tables), starting at
    `initial_accumulator_value`. Memory: 4 * num_rows bytes, i.e. 4 / dim bytes per parameter
    (0.016 at dim 256); allocated at a table's first step.

    Args:
        params: Tables [num_rows, dim] (fp32, bf16, fp16 or fp64) with sparse gradients, or
            param groups of them.
        lr: The learning rate (the default is torch.optim.Adagrad's, as are the others).
        eps: Added to the denominator, >= 0.
        initial_accumulator_value: Where each row's accumulator starts, >= 0 (not 0 with eps 0).

    Raises:
        TypeError: A parameter is not a tensor, or has another dtype.
        ValueError: A parameter is not 2-D, or a hyperparameter is out of range (eps and
            initial_accumulator_value both 0 would divide 0 by 0).
    """

    _name = "SparseRowAdagrad"
    _hyperparameters = ("lr", "eps", "initial_accumulator_value")
    _nonnegative = frozenset({"sum_row"})

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        check_number("lr", group["lr"], 0.0, where=where)
        check_number("eps", group["eps"], 0.0, where=where)
        check_number("initial_accumulator_value", group["initial_accumulator_value"], 0.0, where=where)
        if group["eps"] == 0 and group["initial_accumulator_value"] == 0:
            raise ValueError(
                f"{where}: eps and initial_accumulator_value are both 0: a touched row with an all-zero first "
                "gradient would compute 0 / 0; make one of them > 0"
            )

    def expected_state(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The state of a table once it has stepped: what `load_state_dict` accepts.

        Args:
            p: A table [num_rows, dim].

        Returns:
            Key -> (shape, dtype): "sum_row" [num_rows], fp32 (fp64 for an fp64 table).
        """
        return {"sum_row": ((p.shape[0],), state_dtype(p))}

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, sd: torch.dtype) -> dict[str, torch.Tensor]:
        init = group["initial_accumulator_value"]
        return {"sum_row": torch.full((p.shape[0],), init, dtype=sd, device=p.device)}

    def _update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        g: torch.Tensor,
        sd: torch.dtype,
    ) -> None:
        lr, eps = group["lr"], group["eps"]
        acc_all = state["sum_row"]
        acc = acc_all.index_select(0, rows).add_(_mean_square(g))  # (U,)
        acc_all.index_copy_(0, rows, acc)
        scale = acc.sqrt().add_(eps).reciprocal_().mul_(-lr)  # (U,): -lr / (sqrt(acc) + eps)
        w = p.index_select(0, rows).to(sd)  # (U, dim)
        w.addcmul_(g, scale[:, None])
        p.index_copy_(0, rows, w.to(p.dtype))


def split_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split a model's parameters into the dense ones and the tables (`TrainableTable.weight`s).

    Every parameter of `model` appears once (shared parameters are deduplicated, frozen ones are
    kept; optimizers skip parameters without a gradient).

    Args:
        model: The model.

    Returns:
        The pair (dense_params, table_params).

    Raises:
        TypeError: `model` is not an nn.Module.

    Examples:
        >>> import torch
        >>> from engram import Engram, EngramConfig, SparseRowAdam, split_param_groups
        >>> engram = Engram(EngramConfig.preset("tiny"), layer_id=1)
        >>> dense, tables = split_param_groups(engram)
        >>> len(dense), [t.shape for t in tables]
        (3, [torch.Size([33048, 32])])
        >>> opts = [torch.optim.AdamW(dense, lr=3e-4), SparseRowAdam(tables, lr=1e-3)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"split_param_groups needs an nn.Module, got {type(model).__name__}")
    table_ids: set[int] = set()
    tables: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, TrainableTable) and id(module.weight) not in table_ids:
            table_ids.add(id(module.weight))
            tables.append(module.weight)
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    return dense, tables


class DenseTableAdam(torch.optim.Adam):
    """The paper's table optimizer: torch's Adam over the whole table, so every row's moments decay
    and every row moves each step (SparseRowAdam reads and writes only the looked-up rows). Sparse
    gradients are made dense first (a [num_rows, dim] temporary). Two states per parameter (8 bytes
    in fp32): the cost V4.1's single-state update removes. For comparisons (`engram study optimizers`)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.layout == torch.sparse_coo:
                    p.grad = p.grad.to_dense()
        return super().step(closure)
