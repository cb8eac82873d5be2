#!/usr/bin/env bash
# README's main command: set up everything (idempotent), then a real compressed training run:
# 4 ranks on scikit-learn's digits, top-k(0.01) with residual memory, through stock Horovod.
#   bash scripts/run_training.sh [--ranks N] [train.py arguments]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RANKS=4
if [[ "${1:-}" == "--ranks" ]]; then RANKS="$2"; shift 2; fi
bash "$REPO/scripts/setup_env.sh"
VENV="${GRACE_VENV:-$REPO/.venv}"
export TF_CPP_MIN_LOG_LEVEL=2
# horovodrun whose build check asks PyTorch first: TensorFlow's start-up lines stay out of the log
exec "$VENV/bin/python" -m grace.bench.horovodrun -np "$RANKS" -H "localhost:$RANKS" --gloo \
    "$VENV/bin/python" "$REPO/scripts/train.py" --compressor topk --ratio 0.01 "$@"
