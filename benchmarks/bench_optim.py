"""Table optimizer step time: `SparseRowAdam` on a 1M-row and a 64M-row table with the same number
of touched rows, and against dense `torch.optim.AdamW` and `torch.optim.SparseAdam` on the 1M-row
table, all measured in the same run.

    python benchmarks/bench_optim.py [--small-rows 1048576] [--large-rows 67108864] [--dim 16]
                                     [--touched 65536] [--repeats 20] [--threads 0]

`run_cuda` (in `benchmarks/gpu_check.py`) runs SparseRowAdam, SparseRowAdagrad and SparseSinkhorn on
CUDA against dense AdamW and the dense Sinkhorn-balanced update, 64K rows of a 16M-row table.

Dim is 16 so that the 64M-row table fits: 64M x 16 fp32 is 4 GiB of weights + 4 GiB of momentum
+ 0.5 GiB of per-row state (peak about 9 GiB; 64M x 64 would need 32 GiB). Every step touches
`touched` distinct rows drawn uniformly from the table's own range (the 64M table is also timed
with the 1M table's very row ids, to separate table size from access locality), given as `TrainableTable.gather`
makes it: sorted distinct rows in a sparse gradient not flagged coalesced; a few different row sets
are cycled so the rows are not cache-resident. AdamW gets the same rows as a dense gradient
(zeros elsewhere), as a dense embedding would give it. Reported: median seconds per `step()`;
ratio = baseline seconds / these seconds (> 1: faster than the baseline; about 1 for the
table-size row, since a step's cost depends on the touched rows only).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.sinkhorn import SparseSinkhorn

N_ROW_SETS = 4


def sparse_grads(num_rows: int, dim: int, touched: int, seed: int) -> list[torch.Tensor]:
    """`N_ROW_SETS` uncoalesced sparse gradients [num_rows, dim], each on `touched` distinct rows."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(N_ROW_SETS):
        # Uniform distinct rows without a randperm of the whole table: draw 2x, dedupe, shuffle.
        cand = torch.unique(torch.randint(0, num_rows, (2 * touched,), generator=gen))
        if cand.numel() < touched:
            raise ValueError(f"cannot draw {touched} distinct rows from {num_rows}")
        rows = cand[torch.randperm(cand.numel(), generator=gen)[:touched]].sort().values
        vals = torch.randn(touched, dim, generator=gen)
        grads.append(torch.sparse_coo_tensor(rows[None], vals, (num_rows, dim), check_invariants=False))
    return grads


def interleaved_step_times(cases: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Median seconds of `opt.step()` per case {name: (optimizer, param, grads)}.

    The cases take turns step by step (2 warm-up rounds first, which also allocate the state), so
    load from other processes on the machine falls on all of them alike.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 2):
        for name, (opt, p, grads) in cases.items():
            p.grad = grads[i % len(grads)]
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(
    small_rows: int = 1 << 20,
    large_rows: int = 64 << 20,
    dim: int = 16,
    touched: int = 1 << 16,
    repeats: int = 20,
) -> list[dict]:
    def m(n: int) -> str:
        return f"{n / 2**20:g}M"

    shape_s, shape_l = f"{m(small_rows)} x {dim}", f"{m(large_rows)} x {dim}"
    grads_s = sparse_grads(small_rows, dim, touched, seed=0)
    # The large table, once with the very same row ids as the small one (only the table size
    # differs), once with rows spread over all of it (adds cache/TLB misses: locality, not size).
    grads_same = [
        torch.sparse_coo_tensor(g._indices(), g._values(), (large_rows, dim), check_invariants=False)
        for g in grads_s
    ]
    grads_spread = sparse_grads(large_rows, dim, touched, seed=1)

    def case(num_rows: int, make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], grads) -> tuple:
        p = nn.Parameter(torch.zeros(num_rows, dim))  # values do not change the cost; zeros are quick
        return make_opt([p]), p, grads

    large = case(large_rows, SparseRowAdam, grads_same)
    t = interleaved_step_times(
        {
            "ours": case(small_rows, SparseRowAdam, grads_s),
            "adamw": case(small_rows, torch.optim.AdamW, [g.to_dense() for g in grads_s]),
            "sparse_adam": case(small_rows, torch.optim.SparseAdam, grads_s),
            "same": large,
            "spread": (large[0], large[1], grads_spread),  # same table and optimizer, other rows
        },
        repeats,
    )
    ours_s, adamw, sparse_adam, ours_same, ours_spread = (
        t["ours"],
        t["adamw"],
        t["sparse_adam"],
        t["same"],
        t["spread"],
    )

    k = f"{touched // 1024}K rows/step"
    return [
        {
            "op": f"SparseRowAdam {shape_l}, same {k}",
            "seconds": ours_same,
            "baseline": f"SparseRowAdam {shape_s}",
            "baseline_seconds": ours_s,
            "ratio": ours_s / ours_same,
        },
        {
            "op": f"SparseRowAdam {shape_l}, spread {k}",
            "seconds": ours_spread,
            "baseline": f"SparseRowAdam {shape_s}",
            "baseline_seconds": ours_s,
            "ratio": ours_s / ours_spread,
        },
        {
            "op": f"SparseRowAdam {shape_s}, {k}",
            "seconds": ours_s,
            "baseline": f"AdamW {shape_s} (dense grad)",
            "baseline_seconds": adamw,
            "ratio": adamw / ours_s,
        },
        {
            "op": f"SparseRowAdam {shape_s}, {k}",
            "seconds": ours_s,
            "baseline": f"torch SparseAdam {shape_s}",
            "baseline_seconds": sparse_adam,
            "ratio": sparse_adam / ours_s,
        },
    ]


def run_cuda(
    num_rows: int = 16 << 20,
    dim: int = 64,
    touched: int = 1 << 16,
    repeats: int = 10,
    device: str = "cuda",
) -> list[dict]:
    """The table optimizers on CUDA (`benchmarks/gpu_check.py`): SparseRowAdam, SparseRowAdagrad and
    SparseSinkhorn on a `num_rows` x `dim` fp32 table, each step touching `touched` distinct rows (4 row
    sets cycled, as `TrainableTable.gather` gives them), against the dense updates of the same table
    measured in the same run: torch AdamW (fused) and the Sinkhorn-balanced update in plain torch
    (`bench_sinkhorn.DenseSinkhorn`), fed the same rows as a dense gradient (built outside the timing).
    Reported: median seconds a step, ratio = dense / sparse (target >= 5), and the host syncs one step
    makes (torch.cuda's sync debug mode): a few a step, never one a row. Each table is made, stepped and
    freed in turn (the dense ones hold 4-5 tables' worth). `device="cpu"`: a smoke test, not a measurement.
    """
    import warnings

    from engram.benchmarks.bench_sinkhorn import DenseSinkhorn  # numba's passes come with it

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    grads = [g.to(dev) for g in sparse_grads(num_rows, dim, touched, seed=0)]
    dense_grad: list[torch.Tensor] = []

    def dense(i: int) -> torch.Tensor:  # one buffer, refilled before each dense step (untimed)
        if not dense_grad:
            dense_grad.append(torch.zeros(num_rows, dim, device=dev))
        g = grads[i % len(grads)]
        buf = dense_grad[0].zero_()
        buf.index_copy_(0, g._indices()[0], g._values())
        return buf

    def steps(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], grad_of) -> tuple[float, int, int]:
        """(median seconds a step, host syncs in one step, active rows) of a fresh table."""
        p = nn.Parameter(torch.full((num_rows, dim), 0.01, device=dev))
        opt = make([p])
        times = []
        for i in range(repeats + 2):  # 2 untimed: compile, allocate the state
            p.grad = grad_of(i)
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        syncs = 0
        if cuda:
            p.grad = grad_of(0)
            sync()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        active = opt.active_rows(p) if isinstance(opt, SparseSinkhorn) else touched
        del opt, p
        if cuda:
            torch.cuda.empty_cache()
        return statistics.median(times), syncs, active

    def sparse(i: int) -> torch.Tensor:
        return grads[i % len(grads)]

    fused = {"fused": True} if cuda else {}
    adam = steps(SparseRowAdam, sparse)
    adagrad = steps(SparseRowAdagrad, sparse)
    sink = steps(SparseSinkhorn, sparse)
    adamw = steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, **fused), dense)
    dense_sink = steps(DenseSinkhorn, dense)
    shape = f"{num_rows / 2**20:g}M x {dim}"
    k = f"{touched // 1024}K rows/step"
    out = []
    for name, (sec, syncs, active), (base_name, (base, base_syncs, _)) in (
        ("SparseRowAdam", adam, ("AdamW (fused), dense grad", adamw)),
        ("SparseRowAdagrad", adagrad, ("AdamW (fused), dense grad", adamw)),
        ("SparseSinkhorn", sink, ("dense Sinkhorn-balanced update, torch", dense_sink)),
    ):
        out.append(
            {
                "op": f"optim CUDA: {name} {shape} fp32, {k} ({syncs} host syncs/step)",
                "us_per_step": sec * 1e6,
                "seconds": sec,
                "ratio": base / sec,
                "baseline": f"{base_name}, {base * 1e3:.2f} ms/step (target ratio >= 5)",
                "baseline_seconds": base,
                "host_syncs_per_step": syncs,
                "baseline_host_syncs_per_step": base_syncs,
                "active_rows": active,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small-rows", type=int, default=1 << 20)
    ap.add_argument("--large-rows", type=int, default=64 << 20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--touched", type=int, default=1 << 16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = run(args.small_rows, args.large_rows, args.dim, args.touched, args.repeats)
    for r in rows:
        print(
            f"{r['op']:<45} {r['seconds'] * 1e3:8.2f} ms   baseline {r['baseline']:<30} "
            f"{r['baseline_seconds'] * 1e3:8.2f} ms   ratio {r['ratio']:.2f}x"
        )
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    print(f"peak RSS {peak_gib:.1f} GiB, {time.perf_counter() - t0:.0f} s, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
