#!/usr/bin/env bash
# One command for a lent GPU (written for an H200, under 8 minutes in all):
#
#   benchmarks/gpu_check.sh
#
#   1. checks the set-up: a Python whose torch sees a CUDA GPU (PYTHON=..., else
#      .venv/bin/python, python3, python, the first whose torch has CUDA), pytest,
#      nvcc;
#   2. builds hkt._C with HKT_CUDA=1 in place, and checks that it links no shared
#      libcudart (ldd) and that hkt._C.has_cuda is True;
#   3. runs tests/test_cuda.py; a failure, or GPU tests skipped (all skipped
#      included), fails the check;
#   4. benchmarks/gpu_check.py: float64 correctness of the "kernels" and "sdpa"
#      backends against hkt.reference on the GPU, bitwise repeatability, then
#      bf16 timings at B=4 H=16 T=4096 D=64 L=3 (causal, forward and
#      forward+backward) of both backends against SDPA FlashAttention;
#   5. writes benchmarks/results/gpu.json (also when a step fails or runs out of
#      time: what was measured until then) and the logs next to it.
#
# Exit status 0 only when every step passed.  Each step has a timeout, taken
# from what is left of GPU_CHECK_BUDGET seconds (default 470).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
RES="$ROOT/benchmarks/results"
LOGS="$RES/gpu_logs"
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-470}
STATUS=0

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*"; }
die() { say "FAILED: $*"; exit 1; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# timeout for a step: its cap, or what is left of the budget if that is less;
# fails when less than 20 s are left
cap() {
    local c=$1 l
    l=$(left)
    if (( l < c )); then c=$l; fi
    if (( c < 20 )); then return 1; fi
    echo "$c"
}

# ---- 1. set-up
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    for c in "$ROOT/.venv/bin/python" python3 python; do
        if command -v "$c" >/dev/null 2>&1 &&
            "$c" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
            PY=$c
            break
        fi
    done
fi
[[ -n "$PY" ]] || die "no Python with a CUDA build of torch (set PYTHON=/path/to/python)"
say "python: $PY"
"$PY" - <<'EOF' || die "torch sees no CUDA GPU"
import sys, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPUs: "
      f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
"$PY" -c "import pytest" 2>/dev/null || die "pytest is not installed for $PY"
NVCC=${CUDA_HOME:+$CUDA_HOME/bin/nvcc}
if [[ -z "$NVCC" || ! -x "$NVCC" ]]; then NVCC=$(command -v nvcc || true); fi
[[ -n "$NVCC" ]] || die "nvcc not found (PATH or CUDA_HOME)"
say "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# ---- 2. build
mkdir -p "$LOGS"
say "building hkt._C with HKT_CUDA=1 (log: $LOGS/build.log)"
T=$(cap 200) || die "out of time (budget ${BUDGET}s)"
if ! HKT_CUDA=1 timeout "$T" "$PY" setup.py build_ext --inplace --force >"$LOGS/build.log" 2>&1; then
    tail -30 "$LOGS/build.log"
    die "build"
fi
SO=$(ls hkt/_C*.so | head -1)
ldd "$SO" | tee "$LOGS/ldd.txt"
if grep -q libcudart "$LOGS/ldd.txt"; then die "$SO links a shared libcudart"; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import hkt; from hkt import _C; assert _C.has_cuda, 'built without CUDA'; print('hkt._C:', _C.__file__)" ||
    die "hkt._C has no CUDA"

# ---- 3. tests/test_cuda.py
say "tests/test_cuda.py (log: $LOGS/test_cuda.log)"
T=$(cap 230) || die "out of time (budget ${BUDGET}s)"
set +e
timeout "$T" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
    --junitxml="$LOGS/test_cuda.xml" >"$LOGS/test_cuda.log" 2>&1
TEST_RC=$?
set -e
tail -25 "$LOGS/test_cuda.log"
if (( TEST_RC == 124 )); then say "tests/test_cuda.py timed out"; fi
if (( TEST_RC != 0 )); then STATUS=1; say "tests/test_cuda.py: exit status $TEST_RC"; fi
if grep -q "needs a CUDA GPU" "$LOGS/test_cuda.log"; then STATUS=1; say "GPU tests were skipped"; fi

# ---- 4./5. correctness and timings -> benchmarks/results/gpu.json
say "correctness and timings (benchmarks/gpu_check.py)"
BENCH=$(cap 240) || die "out of time (budget ${BUDGET}s) before the benchmarks"
set +e
JUNIT=()
if [[ -s "$LOGS/test_cuda.xml" ]]; then JUNIT=(--junit "$LOGS/test_cuda.xml"); fi
timeout "$BENCH" "$PY" benchmarks/gpu_check.py --out "$RES/gpu.json" --deadline $(( BENCH - 15 )) \
    "${JUNIT[@]}" --tests-rc "$TEST_RC" 2>&1 | tee "$LOGS/gpu_check.log"
BENCH_RC=${PIPESTATUS[0]}
set -e
if (( BENCH_RC != 0 )); then STATUS=1; say "benchmarks/gpu_check.py: exit status $BENCH_RC"; fi

say "$( ((STATUS == 0)) && echo "all passed" || echo "FAILED" ); results: $RES/gpu.json, logs: $LOGS"
exit $STATUS
