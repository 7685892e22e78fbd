"""The benchmarks, shipped as `engram.benchmarks` (src/engram/benchmarks links to this folder).

Each `bench_*.py` has `run(**kwargs) -> list[dict]` (what `engram bench` calls) and runs as a
script: `python benchmarks/bench_hash.py`. `timing.py` holds the timers they share.
`gpu_check.py` runs the GPU half in one go; `gpu_check.sh` wraps it with the CUDA tests.
"""
