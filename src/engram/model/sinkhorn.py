"""`SparseSinkhorn`: DeepSeek-V4.1's table optimizer, the Sinkhorn-balanced update (SPEC §7b), exact on
sparse tables while touching only their active rows.

Algorithm 1 of the V4.1 report, for a parameter W (m rows, n features, m >= n) with gradient G:
momentum M <- beta M + (1 - beta) G (the only state); Nesterov blend N <- beta M + (1 - beta) G; rows
with ||N_i|| <= tau * mean_i ||N_i|| (the mean over all m rows) masked; then K alternating row /
column L2 normalisations (rows first and last); W <- W - gamma * lr * sqrt(n) * U.

A row whose momentum is zero and that was not looked up has N = 0: it is masked and adds nothing to
any column norm. So state and work cover only the *active* rows, those with nonzero momentum: their
ids and momentum (A, n). A row that stops being looked up stays active, and keeps being updated while
its decaying momentum clears the mask, until its momentum underflows to zero. Step time and state
memory follow A, not m. Sparse COO gradients (our tables) and dense ones (token embedding, LM head;
their all-zero rows are rows not looked up) both work. The passes are numba kernels on the CPU
(`kernels.cpu_sinkhorn`) and their torch twins elsewhere (`kernels.reference`); the row-sharded twin
(`engram.distributed`) all-reduces the column sums and the row-norm sum through `_all_reduce`.
Design: docs/model.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch

from engram import kernels
from engram.kernels import reference
from engram.model.optim import check_table_param, state_dtype, touched_rows
from engram.model.saved_state import (
    check_active_state,
    check_number,
    check_state_device,
    saved_param_states,
)

__all__ = ["SparseSinkhorn"]


class SparseSinkhorn(torch.optim.Optimizer):
    """The Sinkhorn-balanced update over the active rows of tables [num_rows, dim] (num_rows >= dim).

    The defaults of beta, iterations, tau, eps and lr_correction are V4.1's values; there is no
    weight decay. State per parameter (keys of `optimizer.state[p]`):

        "rows"     (A,)      int64   the active rows, sorted
        "momentum" (A, dim)  fp32    their momentum (fp64 for fp64 tables)

    i.e. 4 bytes per active parameter plus 8 per active row (SparseRowAdam: 4 per parameter of the
    whole table plus 8 per row; dense Adam: 8 per parameter). On the CPU both are prefixes of
    arrays with room for up to 1.25x the active rows (`STATE_ROOM`), so that new rows join in
    place. The passes use one fp32 (A, dim) workspace and (A,) scratch (row norms, mask), kept
    between steps.

    Args:
        params: Tables [num_rows, dim] (num_rows >= dim; sparse or dense gradients), or param
            groups of them.
        lr: The base learning rate, > 0.
        beta: The momentum, in [0, 1).
        iterations: K, odd: rows, then (K - 1) / 2 column / row pairs.
        tau: The mask, a fraction of the mean row norm.
        eps: Added to each norm, > 0.
        lr_correction: gamma, which matches Adam's update size.
        threads: The CPU kernels' threads (None: every core on large active sets).
        backend: "auto", or "torch" to run the passes' plain torch twins on the CPU too (the twins
            run off the CPU).

    Raises:
        TypeError: A parameter is not a tensor, or has another dtype.
        ValueError: An unknown `backend`, a table with fewer rows than columns, or a hyperparameter
            out of range.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        beta: float = 0.95,
        iterations: int = 11,
        tau: float = 1e-3,
        eps: float = 1e-20,
        lr_correction: float = 0.18,
        threads: int | None = None,
        backend: str = "auto",
    ) -> None:
        defaults = {
            "lr": lr,
            "beta": beta,
            "iterations": iterations,
            "tau": tau,
            "eps": eps,
            "lr_correction": lr_correction,
        }
        if backend not in ("auto", "torch"):
            raise ValueError(
                f"backend must be 'auto' (numba on the CPU) or 'torch' (the plain twins), got {backend!r}"
            )
        self.threads, self.backend = threads, backend
        self._work: dict[Any, torch.Tensor] = {}  # the (A, dim) workspace and (A,) scratch, grown as needed
        self._room: dict[int, dict[str, Any]] = {}  # id(p) -> the numba merge's arrays (cpu_sinkhorn.merge)
        # Its own hyperparameters: torch's load_state_dict adds keys of its own to `defaults` (e.g.
        # 'differentiable'), which a saved group need not have.
        self._hyperparameters = tuple(defaults)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ checks
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of tables, checked as the constructor checks its arguments.

        Args:
            param_group: "params" (tables [num_rows, dim], num_rows >= dim) and any hyperparameters
                (the defaults fill the rest).

        Raises:
            TypeError: A parameter is not a tensor or has another dtype.
            ValueError: A parameter is not 2-D or has fewer rows than columns, or a hyperparameter
                is out of range.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            check_table_param(p, "SparseSinkhorn")
            rows = self._table_rows(p)
            if rows < p.shape[1]:
                raise ValueError(
                    f"SparseSinkhorn balances the rows of a table [num_rows, dim] with num_rows >= dim (the larger "
                    f"side), got a table of shape {(rows, p.shape[1])}; pass its transpose's layout or use "
                    "AdamW for it"
                )
        self._check_group(group, f"param group {len(self.param_groups) - 1}")

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """Refuse a group's hyperparameters (constructor arguments, an added or a saved group alike);
        `where` names the group in the message."""
        check_number("lr", group["lr"], 0.0, lo_open=True, where=where)
        check_number("beta", group["beta"], 0.0, 1.0, hi_open=True, where=where)  # the momentum's decay
        k = group["iterations"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(
                f"{where}: iterations must be an odd int >= 1 (rows first and last: 1 + 2 * column/row pairs; "
                f"V4.1: 11), got {k!r}"
            )
        check_number("tau", group["tau"], 0.0, where=where)
        check_number("eps", group["eps"], 0.0, lo_open=True, where=where)
        check_number("lr_correction", group["lr_correction"], 0.0, lo_open=True, where=where)

    # ------------------------------------------------------------------ hooks of the sharded twin
    def _table_rows(self, p: torch.Tensor) -> int:
        """Rows of the whole table (the mean row norm divides by it); a shard's twin gives the global count."""
        return p.shape[0]

    def _all_reduce(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """x (float64 sums over p's rows, on p's device) summed over the processes that hold the table's
        rows (here: one, the identity)."""
        return x

    def _empty_grad_steps(self) -> bool:
        """Whether a parameter without a gradient still steps (decays its active rows): the sharded twin's
        ranks must all take part in every reduction."""
        return False

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Sinkhorn-balanced update of every table, over its active rows.

        Every gradient and state is read and checked before any table or state changes.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every gradient and state is read and checked before any table or state changes.
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and not self._empty_grad_steps():
                    continue
                check_state_device("SparseSinkhorn", p, self.state.get(p, {}))
                sd = state_dtype(p)
                rows, g = _gradient_rows(p, sd)
                work.append((group, p, rows, g, sd))
        for group, p, rows, g, sd in work:
            self._update(group, p, rows, g, sd)
        return loss

    def _update(
        self, group: dict[str, Any], p: torch.Tensor, grows: torch.Tensor, g: torch.Tensor, sd: torch.dtype
    ) -> None:
        state = self.state[p]
        if not state:
            state["rows"] = torch.zeros(0, dtype=torch.int64, device=p.device)
            state["momentum"] = torch.zeros(0, p.shape[1], dtype=sd, device=p.device)
        ops = self._passes(p)
        active, mom, gidx = ops.merge(state["rows"], state["momentum"], grows)
        a, n = mom.shape
        u = self._workspace(sd, a, n, p.device)  # (A, n) the update, normalised in place
        rho = self._workspace(torch.float64, a, 1, p.device, "rho").view(a)  # (A,) row norms of the blend
        keep = self._workspace(torch.bool, a, 1, p.device, "keep").view(a)  # (A,) rows above the mask
        beta, eps = float(group["beta"]), float(group["eps"])
        total, zero_rows = ops.blend(mom, gidx, g, beta, u, rho)
        total_all = self._all_reduce(torch.tensor([total], dtype=torch.float64, device=p.device), p)
        thresh = float(group["tau"]) * float(total_all[0]) / self._table_rows(p)
        colsq = ops.rows(u, rho, thresh, eps, keep)  # (n,) float64
        pairs = (int(group["iterations"]) - 1) // 2
        step = float(group["lr_correction"]) * float(group["lr"]) * math.sqrt(n)
        for i in range(pairs):
            colsq = self._all_reduce(colsq, p)  # column norms run over every row of the table
            colinv = 1.0 / (colsq.sqrt() + eps)
            if i < pairs - 1:
                colsq = ops.cols_rows(u, colinv, keep, eps, True)
            else:  # the last pair ends on rows, each kept row's update written to W at once
                ops.cols_rows_apply(u, colinv, keep, eps, p.data, active, step)
        if not pairs:  # K = 1: the row pass alone
            ops.apply(p.data, active, u, keep, step)
        if zero_rows:  # rows whose momentum underflowed to zero leave the active set (exactly: N = 0)
            active, mom = ops.compact(active, mom)
        state["rows"], state["momentum"] = active, mom

    def _passes(self, p: torch.Tensor) -> SimpleNamespace:
        """The passes for p's device: numba on the CPU, Triton on CUDA (with triton), else torch."""
        if self.backend == "auto" and p.device.type == "cpu":
            return _numba_passes(self.threads, self._room.setdefault(id(p), {}))
        triton = self.backend == "auto" and kernels.use_triton(p)
        ops: Any = kernels if triton else reference  # the Triton kernels or their torch twins
        apply = kernels.sinkhorn_apply if triton else _torch_apply

        def cols_rows_apply(
            u: torch.Tensor,
            colinv: torch.Tensor,
            keep: torch.Tensor,
            eps: float,
            w: torch.Tensor,
            rows: torch.Tensor,
            step: float,
        ) -> None:  # the last pair, then the apply: two passes here
            ops.sinkhorn_cols_rows(u, colinv, keep, eps, False)
            apply(w, rows, u, keep, step)

        return SimpleNamespace(
            merge=_merge,
            compact=_torch_compact,
            blend=ops.sinkhorn_blend,
            rows=ops.sinkhorn_rows,
            cols_rows=ops.sinkhorn_cols_rows,
            cols_rows_apply=cols_rows_apply,
            apply=apply,
        )

    def workspace_bytes(self) -> int:
        """Bytes of the buffers the passes keep between steps.

        The workspace and its scratch: one set for every table, grown by half when an active set
        outgrows them.

        Returns:
            Their bytes.
        """
        return sum(buf.numel() * buf.element_size() for buf in self._work.values())

    def _workspace(
        self, dtype: torch.dtype, a: int, n: int, device: torch.device, name: str = "u"
    ) -> torch.Tensor:
        """An (a, n) buffer of the passes (`name`: "u" the workspace, "rho", "keep"), kept between
        steps (grown by half): fresh memory would cost a page fault every 4 KiB each step."""
        key = (name, dtype)
        buf = self._work.get(key)
        if buf is None or buf.numel() < a * n or buf.device != device:
            buf = torch.empty(
                max(a * n, int(1.5 * (0 if buf is None else buf.numel()))), dtype=dtype, device=device
            )
            self._work[key] = buf
        return buf[: a * n].view(a, n)

    # ------------------------------------------------------------------ state
    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse what `load_state_dict` would refuse, changing nothing.

        A caller that loads several optimizers checks them all first.

        Args:
            state_dict: A `state_dict()` of a SparseSinkhorn.

        Raises:
            ValueError: The groups, hyperparameters, ids or a state's keys, row ids, dtypes, shapes
                or values do not fit this optimizer.
        """
        self._saved_states(state_dict)

    def _saved_states(self, state_dict: dict[str, Any]) -> list[tuple[int, torch.Tensor, Any]]:
        """(saved id, parameter, saved state or None), every part of `state_dict` checked: its groups'
        hyperparameters as the constructor checks them, ids, and each state's keys, dtypes, shapes and
        values."""
        saved = saved_param_states(
            "SparseSinkhorn", state_dict, self.param_groups, self._hyperparameters, self._check_group
        )
        for pid, p, entry in saved:
            if entry is not None:
                check_active_state("SparseSinkhorn", pid, entry, p, state_dtype(p))
        return saved

    def load_state_dict(self, state_dict: dict[str, Any], *, copy: bool = True) -> None:
        """Load a `state_dict()`, checked whole before anything changes.

        `check_state_dict` checks the hyperparameters as the constructor does, and the keys, row ids,
        dtypes, shapes and finite momentum. The momentum keeps its fp32 dtype (torch's default would
        cast it to a bf16 table's dtype).

        Args:
            state_dict: A `state_dict()` of a SparseSinkhorn.
            copy: False: the given tensors are kept where they already have the state's dtype and
                device (and are contiguous), so a caller that made them fresh holds the state once.

        Raises:
            ValueError: See `check_state_dict`.
        """
        saved = self._saved_states(state_dict)
        super().load_state_dict({**state_dict, "state": {}})  # the state is set below, uncast
        self._room.clear()  # the loaded states are new tensors
        for _, p, entry in saved:
            if entry:
                self.state[p] = {
                    "rows": entry["rows"].to(device=p.device, dtype=torch.int64, copy=copy).contiguous(),
                    "momentum": entry["momentum"]
                    .to(device=p.device, dtype=state_dtype(p), copy=copy)
                    .contiguous(),
                }

    def row_state_dict(self) -> dict[str, Any]:
        """The state in per-row form, as training checkpoints keep it (row-sharded runs gather and slice it).

        Lossless: the active rows are exactly the rows of nonzero momentum.

        Returns:
            `state_dict()` with each table's state as one "momentum" [num_rows, dim] (zeros at
                inactive rows).
        """
        sd = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, st in sd["state"].items():
            p = params[pid]
            full = torch.zeros(p.shape, dtype=st["momentum"].dtype, device=p.device)
            full[st["rows"]] = st["momentum"]
            sd["state"][pid] = {"momentum": full}
        return sd

    def load_row_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `row_state_dict` gave (the active rows are the rows of nonzero momentum).

        Args:
            state_dict: A `row_state_dict()`.

        Raises:
            ValueError: A state is not one "momentum" of its table's shape, or the groups do not fit.
        """
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        params = {
            pid: p
            for pid, p, _ in saved_param_states(
                "SparseSinkhorn", {"state": {}, "param_groups": groups}, self.param_groups,
                self._hyperparameters, self._check_group,
            )
        }  # fmt: skip
        state = {}
        saved_state = state_dict["state"] if isinstance(state_dict.get("state"), dict) else {}
        for pid, st in saved_state.items():
            mom = st.get("momentum") if isinstance(st, dict) else None
            if (
                not isinstance(st, dict)
                or set(st) != {"momentum"}
                or not isinstance(mom, torch.Tensor)
                or mom.dim() != 2
            ):
                keys = sorted(map(repr, st)) if isinstance(st, dict) else type(st).__name__
                raise ValueError(
                    f"saved per-row state of parameter {pid!r} has {keys}; SparseSinkhorn's is one 'momentum' "
                    "[num_rows, dim]: was it saved by another optimizer?"
                )
            p = params.get(pid)  # None: an unknown id, which load_state_dict refuses
            if p is not None and tuple(mom.shape) != tuple(p.shape):
                raise ValueError(
                    f"saved per-row state 'momentum' of parameter {pid} has shape {tuple(mom.shape)}, the table "
                    f"{tuple(p.shape)}: does the table size match?"
                )
            rows = mom.ne(0).any(dim=1).nonzero()[:, 0]
            state[pid] = {"rows": rows, "momentum": mom[rows]}  # new tensors: taken as they are
        self.load_state_dict({"state": state, "param_groups": groups}, copy=False)

    def active_rows(self, p: torch.Tensor) -> int:
        """How many rows of a table have state (nonzero momentum) now.

        Args:
            p: One of the optimizer's tables.

        Returns:
            The count (0 before its first step).
        """
        state = self.state.get(p)
        return 0 if not state else int(state["rows"].numel())


def _torch_compact(rows: torch.Tensor, mom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of nonzero momentum (and their momentum)."""
    alive = mom.ne(0).any(dim=1)
    return rows[alive], mom[alive]


def _torch_apply(
    w: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, keep: torch.Tensor, step: float
) -> None:
    """w[rows[i]] -= step * u[i] for the kept rows, rounded once to w's dtype."""
    kept = keep.nonzero()[:, 0]
    w.index_add_(0, rows[kept], u[kept].to(w.dtype), alpha=-step)


STATE_ROOM = 1.25  # a growing active set's rows and momentum get room for this many times their rows


def _numba_passes(threads: int | None, room: dict[str, Any]) -> SimpleNamespace:
    """The numba kernels (engram.kernels.cpu_sinkhorn) behind the torch passes' signatures. `room`:
    one table's arrays that its state's rows and momentum (and the merge's gidx) are prefixes of,
    kept between steps, so that `merge` adds new rows in place (`cpu_sinkhorn.merge`)."""
    from engram.kernels import cpu_sinkhorn as k

    def apply(w: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, keep: torch.Tensor, step: float) -> None:
        if w.dtype == u.dtype and w.is_contiguous():
            k.apply(w.numpy(), rows.numpy(), u.numpy(), keep.numpy(), step, threads)
        else:  # a bf16 / fp16 table
            _torch_apply(w, rows, u, keep, step)

    def cols_rows_apply(
        u: torch.Tensor,
        colinv: torch.Tensor,
        keep: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        rows: torch.Tensor,
        step: float,
    ) -> None:
        colinv_np = colinv.to(u.dtype).numpy()
        if w.dtype == u.dtype and w.is_contiguous():  # one sweep: each row's update written at once
            k.cols_rows_apply(u.numpy(), colinv_np, keep.numpy(), eps, w.numpy(), rows.numpy(), step, threads)
        else:  # a bf16 / fp16 table
            k.cols_rows(u.numpy(), colinv_np, keep.numpy(), eps, False, threads)
            _torch_apply(w, rows, u, keep, step)

    def merge(rows: torch.Tensor, mom: torch.Tensor, grows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows_np, mom_np = rows.numpy(), mom.numpy()
        rows_room, mom_room = room.get("rows"), room.get("momentum")
        if (  # the state is a prefix of the room (else it was set from outside: a loaded state)
            rows_room is None
            or mom_room is None
            or rows_room.ctypes.data != rows_np.ctypes.data
            or mom_room.ctypes.data != mom_np.ctypes.data
            or mom_room.dtype != mom_np.dtype
            or mom_room.shape[1:] != mom_np.shape[1:]
        ):
            rows_room = mom_room = None
        merged = k.merge(rows_np, mom_np, grows.numpy(), rows_room, mom_room, room.get("gidx"), STATE_ROOM)
        for key, x, given in zip(("rows", "momentum", "gidx"), merged, (rows_np, mom_np, None), strict=True):
            if x is not given:  # a prefix of a room (one given or a new one): its .base
                room[key] = x.base if x.base is not None else x
        return tuple(torch.from_numpy(x) for x in merged)

    def compact(rows: torch.Tensor, mom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = k.compact(rows.numpy(), mom.numpy())
        return rows[:kept], mom[:kept]

    return SimpleNamespace(
        merge=merge,
        compact=compact,
        blend=lambda mom, gidx, g, beta, u, rho: k.blend(
            mom.numpy(), gidx.numpy(), g.numpy(), beta, u.numpy(), rho.numpy(), threads
        ),
        rows=lambda u, rho, thresh, eps, keep: torch.from_numpy(
            k.rows(u.numpy(), rho.numpy(), thresh, eps, keep.numpy(), threads)
        ),
        cols_rows=lambda u, colinv, keep, eps, want: torch.from_numpy(
            k.cols_rows(u.numpy(), colinv.to(u.dtype).numpy(), keep.numpy(), eps, want, threads)
        ),
        cols_rows_apply=cols_rows_apply,
        apply=apply,
    )


def _gradient_rows(p: torch.Tensor, sd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (R,) int64 sorted distinct, their gradient (R, dim) in `sd`) of p's gradient: the rows of a
    sparse one, the nonzero rows of a dense one (none without a gradient); refuses NaN or Inf."""
    grad = p.grad
    if grad is None:
        rows = torch.zeros(0, dtype=torch.int64, device=p.device)
        return rows, torch.zeros(0, p.shape[1], dtype=sd, device=p.device)
    if grad.layout == torch.sparse_coo:
        rows, g = touched_rows(p, sd, "SparseSinkhorn")
    else:
        if grad.shape != p.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} != parameter shape {tuple(p.shape)}")
        rows = grad.ne(0).any(dim=1).nonzero()[:, 0]  # rows not looked up have an all-zero gradient
        g = grad[rows].to(sd)
    finite = torch.isfinite(g).all(dim=1)
    if not bool(finite.all()):  # sync point on CUDA
        bad = int(rows[(~finite).nonzero()[0, 0]])
        raise ValueError(
            f"the gradient of the table of shape {tuple(p.shape)} holds NaN or Inf at row {bad}; nothing was "
            "updated. Lower the learning rate or check the loss for overflow (bf16/fp16: a loss scaler)"
        )
    return rows, g.contiguous()


def _merge(
    rows: torch.Tensor, mom: torch.Tensor, grows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The active set after adding the gradient's rows: (rows (A',) sorted, momentum (A', n) with zeros for
    new rows, gidx (A',): each active row's index in the gradient, or -1)."""
    if grows.numel() == 0:
        return rows, mom, torch.full((rows.numel(),), -1, dtype=torch.int64, device=rows.device)
    if rows.numel() == 0:
        active, new_mom = grows, torch.zeros(grows.numel(), mom.shape[1], dtype=mom.dtype, device=mom.device)
    else:
        pos = torch.searchsorted(rows, grows).clamp_(max=rows.numel() - 1)
        fresh = rows[pos] != grows
        if not bool(fresh.any()):
            active, new_mom = rows, mom
        else:
            active = torch.cat([rows, grows[fresh]]).sort().values
            new_mom = torch.zeros(active.numel(), mom.shape[1], dtype=mom.dtype, device=mom.device)
            new_mom[torch.searchsorted(active, rows)] = mom
    gidx = torch.full((active.numel(),), -1, dtype=torch.int64, device=active.device)
    gidx[torch.searchsorted(active, grows)] = torch.arange(grows.numel(), device=active.device)
    return active, new_mom, gidx
