#!/usr/bin/env bash
# GPU check of the native kernels, in one go, on a machine with an NVIDIA GPU (H100/H200),
# python3 with a CUDA build of torch, pytest, numpy, and nvcc on PATH. No Horovod, no
# TensorFlow, no network needed; the repository as it is (no .venv, no built libraries).
#
#   bash scripts/device_check.sh            # logs and JSON in $OUT (default: results/device_check)
#
#   1. builds libgrace_cpu.so and libgrace_cuda.so in place (csrc/build.py, as setup.py does)
#   2. tests/native with the CUDA cases (a skipped CUDA case fails the check)
#   3. scripts/bench_step.py on cuda (ResNet-50, a BERT-base encoder: per tensor and bucketed,
#      with kernel and host-sync counts), scripts/bench_ddp_step.py (whole DDP steps per hook:
#      NCCL, and Gloo with 2 processes sharing the GPU)
#   4. tests/unit with the torch tensors on the GPU (GRACE_TEST_DEVICE=cuda), without Horovod
#      (spread over 8 processes where pytest-xdist is installed)
#   5. scripts/bench_ops.py on cuda at 2^16, 2^20, 2^24 (CPU_BENCH=1: also on the host's CPU,
#      both CPU builds)
#   bench_step_fallback (not in the default STEPS: a call of its own, STEPS=bench_step_fallback):
#      bench_step.py on cuda with GRACE_NATIVE=0, the tensor-op fallback whose two phases a
#      bucket torch.compile fuses (compiled in each bucket's third step): its kernels and time
#   6. BASE_CUDA_SOURCE=folder or file (an earlier csrc/cuda/, e.g. from `git archive`, or a single
#      earlier source such as the one-file csrc/cuda/grace_cuda.cu, e.g. from `git show`): last,
#      bench_step.py again with libgrace_cuda built from it (an A/B on one machine, in one call);
#      the sources are put back and the library rebuilt after
# Stops at the first failing step (KEEP_GOING=1: runs every step, fails at the end).
# Env: PYTHON (default python3), OUT, KEEP_GOING, CPU_BENCH, STEPS (the steps to run, by name;
# default all), BENCH_STEP_ARGS (more arguments for bench_step.py, e.g. --bucketed-only),
# BASE_CUDA_SOURCE.
# All steps took 6 minutes on an H100 host (16 cores); it fits in one call of the `device` tool.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/results/device_check}"
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=2 PYTHONDONTWRITEBYTECODE=1
failed=()
t_start=$SECONDS
STEPS="${STEPS:-build tests_native bench_cuda bench_step_cuda bench_ddp_nccl bench_ddp_gloo tests_unit_cuda}"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

log() { echo "[device_check $((SECONDS - t_start))s] $*"; }
fail() {
    echo "[device_check] FAILED: $*" >&2
    failed+=("$1")
    if [[ "${KEEP_GOING:-0}" != "1" ]]; then
        echo "[device_check] logs in $OUT" >&2
        exit 1
    fi
}
# run NAME TIMEOUT CMD...: CMD with a time limit, its output in $OUT/NAME.log
run() {
    local name="$1" limit="$2"
    shift 2
    log "$name: $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        fail "$name" "timed out after ${limit}s"
        return 1
    elif ((rc != 0)); then
        fail "$name" "exit status $rc (see $OUT/$name.log)"
        return 1
    fi
}
maxfail=(-x)
[[ "${KEEP_GOING:-0}" == "1" ]] && maxfail=(--maxfail=25)

# 0. what is there
command -v nvcc >/dev/null || fail "environment" "nvcc is not on PATH"
{
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvcc --version | tail -2
    "$PY" - <<'EOF_PY'
import os, sys, numpy, pytest, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"numpy {numpy.__version__}, pytest {pytest.__version__}, {os.cpu_count()} CPUs")
assert torch.cuda.is_available(), "torch sees no GPU"
print("GPU:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
EOF_PY
} 2>&1 | tee "$OUT/environment.txt"
((PIPESTATUS[0] == 0)) || fail "environment" "python3 with torch, numpy, pytest and a visible GPU is needed"

# 1. build in place (CUDA required), then load both libraries
wanted build && run build 420 bash -c "'$PY' csrc/build.py --cuda on && '$PY' -c \"
import grace.native as g
assert g.available('cpu'), g.load_error('cpu')
assert g.available('cuda'), g.load_error('cuda')
print('libgrace_cpu (' + g.cpu_isa() + ') and libgrace_cuda loaded')\"" || true

# 2. native tests, CUDA included; any CUDA skip is a failure here (without test_build's reruns of
#    the suite under the other CPU builds: CPU-only, run by CI, and here they would triple the step)
if wanted tests_native && run tests_native 300 "$PY" -m pytest tests/native -q "${maxfail[@]}" -p no:cacheprovider -rfs \
  --tb=short -k "not the_portable_build and not the_8_lane_loops"; then
    if grep -E "^SKIPPED .*(CUDA|cuda)" "$OUT/tests_native.log"; then
        fail "tests_native" "CUDA tests were skipped on a GPU machine"
    fi
fi

# 3. benchmarks (before the unit tests, whose failures would stop the check)
# 3a. compression work per training step on ResNet-50's and a BERT-base encoder's gradients
wanted bench_step_cuda && { run bench_step_cuda 300 "$PY" scripts/bench_step.py --device cuda \
  --models resnet50 transformer --out "$OUT" ${BENCH_STEP_ARGS:-} || true; }

# 3a'. the same without grace's libraries: the fallback, fused by torch.compile (opt-in step)
wanted bench_step_fallback && { run bench_step_fallback 540 env GRACE_NATIVE=0 "$PY" scripts/bench_step.py \
  --device cuda --models resnet50 transformer --bucketed-only --out "$OUT/fallback" ${BENCH_STEP_ARGS:-} || true; }

# 3b. whole DDP steps on ResNet-50 per hook (PyTorch's own and grace's): NCCL in a world of one,
#     then Gloo with 2 processes sharing the GPU
wanted bench_ddp_nccl && { run bench_ddp_nccl 240 "$PY" scripts/bench_ddp_step.py --device cuda --models resnet50 \
  --out "$OUT" || true; }
wanted bench_ddp_gloo && { run bench_ddp_gloo 300 "$PY" scripts/bench_ddp_step.py --device cuda --backend gloo \
  --world 2 --models resnet50 --methods topk powersgd --iters 5 --out "$OUT" || true; }

# 4. unit tests with the torch tensors on the GPU (no Horovod, no TensorFlow)
parallel=()
"$PY" -c "import xdist" 2>/dev/null && parallel=(-n 8)
wanted tests_unit_cuda && { run tests_unit_cuda 420 env GRACE_TEST_DEVICE=cuda "$PY" -m pytest tests/unit -q \
  "${parallel[@]}" "${maxfail[@]}" -p no:cacheprovider -rf --tb=short \
  --ignore=tests/unit/test_tensorflow_backend.py -k "not horovod" || true; }

# 5. one tensor per method against plain torch code (bench_ops), last: the longest and least urgent
wanted bench_cuda && { run bench_cuda 240 "$PY" scripts/bench_ops.py --device cuda --sizes 16 20 24 \
  --json "$OUT/bench_cuda.json" || true; }
[[ "${CPU_BENCH:-0}" == "1" ]] && { run bench_cpu 300 "$PY" scripts/bench_ops.py --device cpu --sizes 16 20 24 \
  --builds x86-64-v3 x86-64-v2 --json "$OUT/bench_cpu.json" || true; }

# 6. the A/B: the same bench_step with the earlier CUDA source (only libgrace_cuda is rebuilt)
if [[ -n "${BASE_CUDA_SOURCE:-}" ]]; then
    # (build.py compiles every csrc/cuda/*.cu: the current sources leave the folder meanwhile)
    current="$(mktemp -d)"
    cp csrc/cuda/*.cu csrc/cuda/*.cuh "$current"/ 2>/dev/null
    put_back() { rm -f csrc/cuda/*.cu csrc/cuda/*.cuh; cp "$current"/* csrc/cuda/; }
    trap put_back EXIT
    rm -f csrc/cuda/*.cu csrc/cuda/*.cuh
    if [[ -d "$BASE_CUDA_SOURCE" ]]; then
        cp "$BASE_CUDA_SOURCE"/*.cu csrc/cuda/ && cp "$BASE_CUDA_SOURCE"/*.cuh csrc/cuda/ 2>/dev/null
    else
        cp "$BASE_CUDA_SOURCE" csrc/cuda/grace_cuda.cu
    fi
    run build_base 420 "$PY" csrc/build.py --cuda on &&
        run bench_step_base 300 "$PY" scripts/bench_step.py --device cuda --models resnet50 transformer \
          --out "$OUT/base" ${BENCH_STEP_ARGS:-}
    put_back
    run build_again 420 "$PY" csrc/build.py --cuda on || true
fi

if ((${#failed[@]})); then
    echo "[device_check] FAILED steps: ${failed[*]} (logs in $OUT)" >&2
    exit 1
fi
log "all steps passed; logs in $OUT"
