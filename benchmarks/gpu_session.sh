#!/usr/bin/env bash
# One command for a lent GPU machine, meant to end inside a 570-second limit:
#
#   OUT=/some/folder benchmarks/gpu_session.sh      # OUT: where every result goes
#
# Steps, each result written into $OUT as the step runs (a kill at any point
# leaves what finished; at most 8 files, none in a subfolder):
#   1. probe (benchmarks/gpu_probe.py -> probe.json): nvidia-smi; torch, CUDA,
#      cuDNN, Triton, setuptools versions; Python.h, omp.h, nvcc,
#      libcudart_static.a; which kernel SDPA picks for the timed shapes.  Before
#      anything is built.  No CUDA GPU: the session ends here, exit status 3 (a
#      dry run, within a minute);
#   2. build (tools/build_inplace.py -> build.log): HKT_CUDA=1 for the GPU's own
#      architecture only (its compute capability, e.g. sm_90), with whatever
#      setuptools is there; the extension must link no shared libcudart and have
#      has_cuda;
#   3. tests (benchmarks/gpu_tests.py -> tests.log, tests.jsonl, tests.json):
#      tests/kernels/test_cuda.py, each test limited (pytest-timeout), the whole step
#      limited to what is left once the timing step's share is kept; the first
#      failure is the one that matters; a sticky CUDA error restarts the rest in a
#      fresh process;
#   4. correctness and timings (benchmarks/gpu_check.py -> gpu.json): every
#      backend and variant against the float64 reference, bfloat16 at the timed
#      size, bitwise repeatability, then bfloat16 timings at B=4 H=16 T=4096 D=64
#      L=3, causal and not, forward and forward+backward;
#   and the whole output in session.log.
#
# Environment: OUT (default benchmarks/results/gpu_session), PYTHON (default: the
# first of python3, .venv/bin/python, python whose torch has CUDA),
# GPU_SESSION_BUDGET (seconds in all, default 570), GPU_SESSION_TIMING (seconds
# kept for step 4, default 180), GPU_SESSION_REHEARSAL=1 (no GPU: every step anyway,
# on the CPU -- a build without CUDA, gpu_check.py --device cpu --quick -- to try
# the session's plumbing before a GPU's minutes are spent on it).
# Exit status: 0 every step passed, 1 something failed, 3 no CUDA GPU (dry run).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/benchmarks/results/gpu_session}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
BUDGET=${GPU_SESSION_BUDGET:-570}
TIMING=${GPU_SESSION_TIMING:-180}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/session.log") 2>&1
TEE=$!

say() { echo "[gpu_session $(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# the last lines reach session.log before the exit: tee is waited for
finish() {
    say "$2"; say "results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    exec >&- 2>&-; wait "$TEE" 2>/dev/null; exit "$1"
}

say "start $(date -u +%FT%TZ), budget ${BUDGET}s (${TIMING}s kept for correctness and timings), OUT=$OUT"
if command -v git >/dev/null 2>&1 && git rev-parse HEAD >/dev/null 2>&1; then
    say "tree: $(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
fi

# ---- the interpreter: the first whose torch has CUDA, else the first with torch (a dry run)
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    for want in cuda any; do
        for c in python3 "$ROOT/.venv/bin/python" python; do
            command -v "$c" >/dev/null 2>&1 || continue
            if [[ $want == cuda ]]; then check="import torch, sys; sys.exit(0 if torch.version.cuda else 1)"
            else check="import torch"; fi
            if timeout 60 "$c" -c "$check" >/dev/null 2>&1; then PY=$c; break 2; fi
        done
    done
fi
[[ -n "$PY" ]] || finish 1 "FAILED: no Python with torch (set PYTHON=/path/to/python)"
say "python: $(command -v "$PY")"

# ---- 1. probe
say "1. probe -> probe.json"
timeout -k 5 90 "$PY" benchmarks/gpu_probe.py --out "$OUT/probe.json"
rc=$?
REHEARSAL=${GPU_SESSION_REHEARSAL:-0}
(( rc == 3 && REHEARSAL == 1 )) && { say "REHEARSAL: no GPU, every step on the CPU"; rc=0; }
case $rc in
    0) ;;
    3) finish 3 "DRY RUN: torch sees no CUDA GPU here, so nothing was built or timed; the probe is in probe.json" ;;
    1) finish 1 "FAILED: the probe found what stops the build (probe.json, build_blockers)" ;;
    *) finish 1 "FAILED: the probe ended with exit status $rc" ;;
esac
ARCH=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['hkt_cuda_archs'])" "$OUT/probe.json")

# ---- 2. build, for this GPU's architecture only
CUDA_BUILD=(HKT_CUDA=1 HKT_CUDA_ARCHS=$ARCH)
[[ $ARCH == None ]] && CUDA_BUILD=(HKT_CUDA=0)  # a rehearsal
say "2. build: ${CUDA_BUILD[*]} -> build.log"
T=$(( $(left) - TIMING - 30 ))
(( T > 240 )) && T=240
(( T < 30 )) && finish 1 "FAILED: out of time before the build"
env "${CUDA_BUILD[@]}" timeout -k 5 "$T" "$PY" tools/build_inplace.py -j "$(nproc)" --force \
    >"$OUT/build.log" 2>&1
rc=$?
if (( rc != 0 )); then
    tail -30 "$OUT/build.log"
    finish 1 "FAILED: the build (exit status $rc$( ((rc == 124)) && echo ', timed out after '"$T"'s'))"
fi
SO=$(ls hkt/_C*.so | head -1)
LDD=$(ldd "$SO" 2>&1)
printf -- '---- ldd %s\n%s\n' "$SO" "$LDD" >>"$OUT/build.log"
grep -q libcudart <<<"$LDD" && finish 1 "FAILED: $SO links a shared libcudart (build.log)"
timeout -k 5 60 "$PY" -c "from hkt import _C; import sys; print('hkt._C:', _C.__file__, 'has_cuda:', _C.has_cuda)
sys.exit(0 if _C.has_cuda or sys.argv[1] == '1' else 1)" "$REHEARSAL" || finish 1 "FAILED: hkt._C does not import, or has no CUDA"
say "built in $(( $(date +%s) - START ))s since the start"

# ---- 3. tests, bounded so that step 4 keeps its share
STATUS=0
T=$(( $(left) - TIMING ))
if (( T >= 30 )); then
    say "3. tests/kernels/test_cuda.py, ${T}s -> tests.log, tests.jsonl, tests.json"
    # the ptxas spill check needs no GPU and ran where the code was written
    timeout -k 5 $(( T + 15 )) "$PY" benchmarks/gpu_tests.py --budget "$T" --per-test 120 \
        --progress "$OUT/tests.jsonl" --summary "$OUT/tests.json" --log "$OUT/tests.log" -- \
        tests/kernels/test_cuda.py --deselect tests/kernels/test_cuda.py::test_kernels_compile_for_sm80_and_sm90_without_spills
    rc=$?
    (( rc != 0 )) && { STATUS=1; say "tests: exit status $rc (tests.json: first_failure, gpu_skipped, not_run)"; }
else
    STATUS=1
    say "3. tests skipped: ${T}s left before the timing step's share"
fi

# ---- 4. correctness and timings
T=$(( $(left) - 5 ))
say "4. correctness and timings, ${T}s -> gpu.json"
SUMMARY=()
[[ -s "$OUT/tests.json" ]] && SUMMARY=(--tests-summary "$OUT/tests.json")
DEVICE=()
(( REHEARSAL == 1 )) && DEVICE=(--device cpu --quick)
timeout -k 5 "$T" "$PY" benchmarks/gpu_check.py --out "$OUT/gpu.json" --deadline $(( T - 15 )) "${SUMMARY[@]}" \
    "${DEVICE[@]}"
rc=$?
(( rc != 0 )) && { STATUS=1; say "benchmarks/gpu_check.py: exit status $rc (gpu.json: failures)"; }

if (( STATUS == 0 )); then finish 0 "all passed"; else finish 1 "FAILED (see above)"; fi
