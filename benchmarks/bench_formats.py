"""Row formats against FP8: bytes per row and the CPU gather's time per row of INT8 (a bfloat16 scale per
32 values, and per row) and 4-bit rows, each against FP8 e4m3 + ue8m0 measured in the same run.

One float table of V4.1's 256-wide rows, quantised to each format (`engram.storage.quant.quantize`);
`lookup.dequantize_gather(..., backend="numba", threads=1)` of the same ids into a preallocated output,
uniform and Zipf(1.2) ids, float32 and bfloat16 output. All formats are timed interleaved round by round
(best of `repeats`), so a shared machine's load hits them alike; each is first checked bit-identical to
the torch backend. The table is sized to several times the last-level cache (at least 2M FP8 rows).

    python benchmarks/bench_formats.py [--rows N] [--tokens 8192] [--per-token 24] [--repeats 5]

Prints per format: bytes a row and its ratio to FP8's 264, rows/s, and the time per row over FP8's
(<= 1.2 is the target; < 1 is faster than FP8). `run_cuda` (benchmarks/gpu_check.py) does the same with
the tables on a GPU and the Triton gathers (`kernels.fp8_gather`, `kernels.int_gather`), adding each
gather's traffic as a fraction of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from engram.benchmarks.bench_lookup import default_rows, llc_bytes, make_ids
from engram.benchmarks.timing import best_times
from engram.rowformat.formats import RowFormat
from engram.storage import lookup, quant


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def make_tables(
    rows: int, dim: int, seed: int, device: str | torch.device = "cpu"
) -> dict[RowFormat, tuple[torch.Tensor, torch.Tensor]]:
    """Each format's (values, scales) of one random table (row magnitudes spread, as trained rows are),
    made and quantised on `device`."""
    g = torch.Generator(device).manual_seed(seed)
    out: dict[RowFormat, tuple[torch.Tensor, torch.Tensor]] = {}
    step = 1 << 16
    for fmt in RowFormat:
        values = torch.empty((rows, fmt.value_width(dim)), dtype=fmt.value_dtype, device=device)
        scales = torch.empty((rows, fmt.scales_per_row(dim)), dtype=fmt.scale_dtype, device=device)
        out[fmt] = (values, scales)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        x = (
            torch.randn(stop - start, dim, generator=g, device=device)
            * 0.02
            * torch.exp(torch.randn(stop - start, 1, generator=g, device=device))
        )
        for fmt, (values, scales) in out.items():
            v, s = quant.quantize(x, fmt)
            values[start:stop], scales[start:stop] = v, s
    return out


def run(
    rows: int | None = None,
    dim: int = 256,
    tokens: int = 8192,
    per_token: int = 24,
    repeats: int = 5,
    seed: int = 0,
) -> list[dict]:
    rows = rows or default_rows(RowFormat.FP8.row_bytes(dim))
    tables = make_tables(rows, dim, seed)
    results = []
    for zipf in (None, 1.2):
        ids = make_ids(rows, tokens, per_token, zipf, seed)
        n = ids.numel()
        for dtype in (torch.float32, torch.bfloat16):
            outs = {fmt: torch.empty((*ids.shape, dim), dtype=dtype) for fmt in tables}
            fns = {}
            for fmt, (v, s) in tables.items():
                want = lookup.dequantize_gather(v, s, ids, dtype, backend="torch")
                got = lookup.dequantize_gather(v, s, ids, dtype, outs[fmt], backend="numba", threads=1)
                if not torch.equal(bits(got), bits(want)):
                    raise AssertionError(f"{fmt.value}: the numba gather and the torch twin disagree")
                fns[fmt] = lambda v=v, s=s, o=outs[fmt], ids=ids, dtype=dtype: lookup.dequantize_gather(
                    v, s, ids, dtype, o, backend="numba", threads=1
                )
            times = best_times(fns, repeats)
            fp8_t = times[RowFormat.FP8]
            ids_name = "uniform" if zipf is None else f"Zipf({zipf})"
            for fmt, t in times.items():
                rb = fmt.row_bytes(dim)
                results.append(
                    {
                        "op": f"{fmt.value} gather -> {str(dtype).removeprefix('torch.')}, {ids_name} ids, 1 thread",
                        "format": fmt.value,
                        "row_bytes": rb,
                        "bytes_ratio": rb / RowFormat.FP8.row_bytes(dim),
                        "rows_per_s": n / t,
                        "ns_per_row": t / n * 1e9,
                        "baseline": "fp8 gather, same ids, same run",
                        "baseline_rows_per_s": n / fp8_t,
                        "time_ratio": t / fp8_t,
                        "ratio": fp8_t / t,
                        "table_rows": rows,
                    }
                )
    return results


def run_cuda(
    rows: int = 4 << 20,
    dim: int = 256,
    tokens: int = 65536,
    per_token: int = 24,
    repeats: int = 10,
    seed: int = 0,
    device: str = "cuda",
) -> list[dict]:
    """The Triton gathers of every row format with the tables resident on the GPU: `kernels.fp8_gather`
    for FP8, `kernels.int_gather` for the others, no dedup, into preallocated outputs, float32 and
    bfloat16, uniform and Zipf(1.2) ids; timed interleaved round by round (each call synchronised),
    each first checked bit-identical to the torch twin (`lookup.dequantize_gather(backend="torch")`).
    Per format: the time per row over FP8's, and the traffic (the row's stored bytes read plus the row
    written) as a fraction of a device-to-device copy measured in the same run. `rows` 4M: 1 GB of FP8
    rows, twenty times an H200's L2. `device="cpu"` (a test, the kernels interpreted) runs the same
    code on small sizes."""
    from engram import kernels
    from engram.apps.tools.bench import device_copy_gb_per_s

    cuda = torch.device(device).type == "cuda"
    copy = device_copy_gb_per_s() if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    tables = make_tables(rows, dim, seed, device)
    results = []
    for zipf in (None, 1.2):
        ids = make_ids(rows, tokens, per_token, zipf, seed).to(device)
        flat, n = ids.reshape(-1), ids.numel()
        ids_name = "uniform" if zipf is None else f"Zipf({zipf})"
        for dtype in (torch.float32, torch.bfloat16):
            fns = {}
            for fmt, (v, s) in tables.items():
                want = lookup.dequantize_gather(v, s, ids, dtype, backend="torch").reshape(n, dim)
                out = torch.empty_like(want)
                gather = kernels.fp8_gather if fmt is RowFormat.FP8 else kernels.int_gather

                def fn(gather=gather, v=v, s=s, flat=flat, out=out, dtype=dtype) -> None:
                    gather(v, s, flat, dtype, out)
                    sync()

                fn()
                if not torch.equal(bits(out), bits(want)):
                    raise AssertionError(
                        f"{fmt.value}: the Triton gather and the torch twin disagree ({dtype})"
                    )
                fns[fmt] = fn
                del want
            times = best_times(fns, repeats)
            fp8_t = times[RowFormat.FP8]
            out_bytes = dim * (4 if dtype == torch.float32 else 2)
            dn = str(dtype).removeprefix("torch.")
            for fmt, t in times.items():
                rb = fmt.row_bytes(dim)
                gbs = n * (rb + out_bytes) / t / 1e9
                results.append(
                    {
                        "op": f"CUDA {fmt.value} gather -> {dn}, {ids_name} ids"
                        + (f": {gbs / copy:.0%} of copy" if copy else ""),
                        "format": fmt.value,
                        "row_bytes": rb,
                        "bytes_ratio": rb / RowFormat.FP8.row_bytes(dim),
                        "rows_per_s": n / t,
                        "gb_per_s": gbs,
                        "copy_gb_per_s": copy,
                        "fraction_of_copy": None if copy is None else gbs / copy,
                        "baseline": "fp8 Triton gather, same ids, same run",
                        "baseline_rows_per_s": n / fp8_t,
                        "time_ratio": t / fp8_t,
                        "ratio": fp8_t / t,
                        "table_rows": rows,
                        "device": name,
                    }
                )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--per-token", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rows = args.rows or default_rows(RowFormat.FP8.row_bytes(args.dim))
    print(f"table: {rows} rows x {args.dim} (last-level cache {llc_bytes() >> 20} MiB); 1 thread")
    print(f"{'op':58s} {'B/row':>6s} {'xFP8 B':>7s} {'M rows/s':>9s} {'ns/row':>7s} {'xFP8 time':>9s}")
    for r in run(rows, args.dim, args.tokens, args.per_token, args.repeats):
        print(
            f"{r['op']:58s} {r['row_bytes']:6d} {r['bytes_ratio']:7.3f} {r['rows_per_s'] / 1e6:9.2f} "
            f"{r['ns_per_row']:7.1f} {r['time_ratio']:9.3f}"
        )


if __name__ == "__main__":
    main()
