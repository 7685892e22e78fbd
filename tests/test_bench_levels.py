"""benchmarks/bench_levels.py runs end to end at a tiny size and reports what it promises."""

from __future__ import annotations


def test_bench_levels_tiny(tmp_path) -> None:
    from engram.benchmarks import bench_levels

    rows = bench_levels.run(rows=1 << 12, tokens=64, batches=2, repeats=1, folder=str(tmp_path))
    ops = [r["op"] for r in rows]
    assert any(op.startswith("public gather: FP8Table.gather") for op in ops)
    pages = next(r for r in rows if "rowfile_pages_per_row" in r)
    assert pages["rowfile_pages_per_row_alone"] == 1
    assert pages["rowfile_pages_per_row"] <= 1.0
    assert pages["safetensors_pages_per_row_alone"] >= 2.0  # values and scales in two tensors
    assert all(r["slowdown"] > 0 for r in rows if "slowdown" in r)
    assert list(tmp_path.iterdir()) == []  # temporary files removed
