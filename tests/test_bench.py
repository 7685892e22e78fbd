from __future__ import annotations

import pytest

from engram.apps.bench import SUITE, find_benchmarks, format_rows, run_suite


def test_suite_files_exist_and_have_run():
    root = find_benchmarks()
    for file, _, _ in SUITE.values():
        text = (root / file).read_text()
        assert "def run(" in text, file


def test_format_rows():
    rows = [
        {"op": "hash x", "tokens_per_s": 2.5e7, "baseline": "numpy demo", "ratio": 20.0},
        {"op": "lookup y", "rows_per_s": 1.2e6, "gb_per_s": 0.31, "baseline": "torch", "ratio": 3.5},
        {"op": "gate: skipped (no CUDA)", "skipped": True},
    ]
    lines = format_rows(rows)
    assert "25.00 M tok/s" in lines[1] and "20.00x" in lines[1] and "numpy demo" in lines[1]
    assert "1.20 M rows/s" in lines[2] and "0.31" in lines[2]
    assert lines[3] == "gate: skipped (no CUDA)"


def test_unknown_and_missing(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_suite(["nope"])
    assert find_benchmarks(tmp_path / "x").name == "benchmarks"  # falls back to the checkout's


def test_run_hash_quick(capsys):
    from engram.cli.commands import main

    assert main(["bench", "--only", "hash", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "numba" in out and "x" in out


def test_fraction_of_peak_only_for_device_rows():
    rows = [
        {
            "op": "cpu lookup",
            "rows_per_s": 1e6,
            "gb_per_s": 2.0,
            "device": "cpu",
            "ratio": 2.0,
            "baseline": "t",
        },
        {
            "op": "gpu lookup",
            "rows_per_s": 1e9,
            "gb_per_s": 3000.0,
            "device": "NVIDIA H200",
            "ratio": 3.0,
            "baseline": "t",
        },
        {"op": "gate", "fused_ms": 1.0, "fused_gb_per_s": 1500.0, "device": "NVIDIA H200", "ratio": 2.0},
    ]
    lines = format_rows(rows, peak_gb_per_s=4000.0)
    assert "of peak" not in lines[1]
    assert "(75% of peak)" in lines[2] and "(38% of peak)" in lines[3]


def test_hash_bench_torch_baseline_matches_numpy_baseline(v41_hasher):
    """The GPU hash bench's baseline (the demo algorithm in torch) is checked here on the CPU."""
    import importlib.util

    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location("bench_hash", find_benchmarks() / "bench_hash.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ids = np.random.default_rng(3).integers(0, v41_hasher.config.vocab_size, size=(3, 50))
    want = mod.demo_baseline(v41_hasher, ids)
    np.testing.assert_array_equal(mod.torch_demo_baseline(v41_hasher, torch.from_numpy(ids)).numpy(), want)
    np.testing.assert_array_equal(want, v41_hasher.hash(ids))


def test_tiers_cuda_bench_runs_on_cpu():
    """bench_tiers.run_cuda (measured on a GPU by benchmarks/gpu_check.py) runs end to end here too."""
    import sys

    sys.path.insert(0, str(find_benchmarks()))
    try:
        import bench_tiers
    finally:
        sys.path.pop(0)
    rows = bench_tiers.run_cuda(rows=1 << 14, tokens=64, batches=2, repeats=1, device="cpu", matmul=32)
    assert [r["ratio"] > 0 for r in rows] == [True] * 3
    assert rows[1]["fetched_bytes_per_row"] < rows[0]["fetched_bytes_per_row"]  # the cache saves reads
