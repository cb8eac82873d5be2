#!/usr/bin/env bash
# README's test command: set up everything (idempotent), then run the whole test suite.
#   bash scripts/run_tests.sh [pytest arguments]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup_env.sh"
cd "$REPO"
export TF_CPP_MIN_LOG_LEVEL=2
exec "${GRACE_VENV:-$REPO/.venv}/bin/python" -m pytest "$@"
