#!/usr/bin/env bash
# One device call (issue 41): install, GPU kernel tests, kernel + decode benchmarks, one profiler trace,
# the goals table. Everything lands in $OUT (JSON + markdown + log + trace.tgz, <= 8 files, 2 folders deep).
#
#   bash experiments/gpu_suite.sh            # on the GPU machine, from the repository root (~6 min)
#   bash experiments/gpu_suite.sh --small    # CPU smoke test of every stage (tiny sizes, interpret mode)
#
# Each stage has its own time limit (a hang costs that stage only) and the stages run in order of
# importance: kernel correctness, kernel goals, decode goals. Env: WHL (folder of wheels to install first,
# default .whl or ../.whl), T_TESTS / T_KERNELS / T_DECODE (stage limits, s), DECODE_BUDGET (dsv4-bench-decode's
# --budget-s), TESTS_K (a pytest -k expression), KARGS / DARGS (bench_kernels / dsv4-bench-decode arguments
# replacing the defaults below), DECODE_ARGS (extra dsv4-bench-decode arguments).
set -u
SMALL=0
[ "${1:-}" = "--small" ] && SMALL=1
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1          # the whole log comes back too (8 files: log, tests, 2 x 2 bench, trace, goals)
export PYTHONUNBUFFERED=1
T0=$SECONDS
stage() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
PY=python3

stage "install"
WHL=${WHL:-}
[ -z "$WHL" ] && for d in .whl ../.whl; do ls $d/*.whl >/dev/null 2>&1 && WHL=$d && break; done
if [ "$SMALL" = 1 ]; then
    export JAX_PLATFORMS=cpu PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    T_TESTS=${T_TESTS:-900} T_KERNELS=${T_KERNELS:-600} T_DECODE=${T_DECODE:-900} DECODE_BUDGET=${DECODE_BUDGET:-60}
else
    if [ -n "$WHL" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
            && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -3 \
        || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export JAX_PLATFORMS=cuda
    # a rerun on the same (warm) machine reuses compiled programs
    export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    T_TESTS=${T_TESTS:-90} T_KERNELS=${T_KERNELS:-120} T_DECODE=${T_DECODE:-215} DECODE_BUDGET=${DECODE_BUDGET:-180}
fi

stage "environment"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || echo "no nvidia-smi"
    $PY - <<'EOF'
import platform, jax, jaxlib
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), [d.device_kind for d in jax.devices()])
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not importable")
import dsv4_jax
print("dsv4_jax from", dsv4_jax.__file__)
EOF
} 2>&1

stage "GPU kernel tests (limit ${T_TESTS} s)"
if [ "$SMALL" = 1 ]; then
    export DSV4_GPU_TESTS_ON_CPU=1
    TESTS="tests/test_kernels_gpu.py -k not(256) tests/test_kernels_lowering.py"
else
    # 4 workers: the tests are compile-bound (~3.7 s each on the H200 machine, 16 cores); the cross-lowering
    # tests (test_kernels_lowering.py) need no GPU and run in CI
    TESTS="tests/test_kernels_gpu.py -n 4 --dist load"
fi
[ -n "${TESTS_K:-}" ] && TESTS="tests/test_kernels_gpu.py"     # a selection: one process
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "$T_TESTS" $PY -m pytest -o addopts="" -q -p no:cacheprovider \
    -rfE -v --junitxml="$OUT/tests.xml" $TESTS ${TESTS_K:+-k "$TESTS_K"} 2>&1 | grep -v "^WARNING" | tail -80
unset DSV4_GPU_TESTS_ON_CPU

stage "bench_kernels (limit ${T_KERNELS} s)"
if [ "$SMALL" = 1 ]; then
    KARGS=${KARGS:-"--small --iters 2 --rows 512 --formats fp8_blk128"}
else
    KARGS=${KARGS:-"--tokens 1,8 --quant-tokens 1,8 --formats fp8_blk128 --rows 32768,262144 --iters 20"}
fi
timeout -k 5 "$T_KERNELS" $PY experiments/bench_kernels.py $KARGS --out "$OUT/kernels.json" 2>&1 | grep -v "^WARNING"

stage "dsv4-bench-decode (limit ${T_DECODE} s, budget ${DECODE_BUDGET} s)"
rm -rf /tmp/gpu_suite_trace
if [ "$SMALL" = 1 ]; then
    DARGS=${DARGS:-"--small --pairs 0 --dtypes bf16 --batches 1 --contexts 64 --verify-k 1,5 --draft-n 1,2 --loop-k 1 --loop-rounds 2 --loop-reps 1 --iters 2 --component-reps 2"}
else
    DARGS=${DARGS:-"--dtypes bf16 --batches 1,8,32 --contexts 4096,65536"}
fi
timeout -k 10 "$T_DECODE" $PY -m dsv4_jax.research.bench_decode $DARGS ${DECODE_ARGS:-} --budget-s "$DECODE_BUDGET" \
    --trace-dir /tmp/gpu_suite_trace --out "$OUT/decode.json" 2>&1 | grep -v "^WARNING"

stage "trace"
if [ -d /tmp/gpu_suite_trace ]; then
    tar czf "$OUT/trace.tgz" -C /tmp gpu_suite_trace
    if [ "$(stat -c %s "$OUT/trace.tgz")" -gt 15000000 ]; then     # keep under the 16 MiB file limit
        d=$(ls -d /tmp/gpu_suite_trace/*pallas* 2>/dev/null | head -1)
        [ -n "$d" ] && tar czf "$OUT/trace.tgz" -C "$(dirname "$d")" "$(basename "$d")"
    fi
    ls -la "$OUT/trace.tgz"
else
    echo "no trace written"
fi

stage "goals"
$PY experiments/gpu_goals.py --kernels "$OUT/kernels.json" --decode "$OUT/decode.json" --tests "$OUT/tests.xml" \
    --out "$OUT/goals.md"
stage "done"
ls -la "$OUT"
