#!/usr/bin/env bash
# Idempotent set-up of everything grace needs on a fresh Debian machine:
#   Open MPI and iptables (apt, if missing), a virtual environment in .venv with the pinned
#   requirements, Horovod 0.28.1 built from its sdist with our build fixes (wheel cached
#   outside the repo), and grace itself in editable mode.
# Usage: bash scripts/setup_env.sh        (re-running it takes seconds)
# Env:   GRACE_VENV  (default: <repo>/.venv)
#        GRACE_CACHE (default: ~/.cache/grace) where the built Horovod wheel is kept
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # keep TensorFlow quiet in --check-build

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRACE_VENV:-$REPO/.venv}"
CACHE="${GRACE_CACHE:-$HOME/.cache/grace}"
HOROVOD_VERSION=0.28.1
PATCH="$REPO/scripts/horovod/horovod-$HOROVOD_VERSION-build-fixes.patch"
PY="$VENV/bin/python"

log() { echo "[setup] $*"; }

# 1. System packages: Open MPI for mpirun and Horovod's MPI controller; patch for the fixes.
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin libopenmpi-dev)
command -v patch >/dev/null 2>&1 || missing+=(patch)
# the emulated cluster's latency on kernels without sch_netem (an NFQUEUE rule per host); the
# cluster needs root anyway, so only root installs it
if ! command -v iptables >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then missing+=(iptables); fi
if ((${#missing[@]})); then
    log "installing ${missing[*]} from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. Virtual environment with the pinned requirements.
if [[ ! -x "$PY" ]]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha256"
want="$(sha256sum "$REPO/requirements.txt" | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    log "installing requirements.txt"
    "$PY" -m pip install -q --disable-pip-version-check -r "$REPO/requirements.txt"
    echo "$want" >"$stamp"
fi

# 3. Horovod, built once per (patch, python, torch, tensorflow) and cached as a wheel.
versions="$("$PY" - <<'EOF'
import sys, importlib.metadata as md
print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{md.version('torch')}-tf{md.version('tensorflow-cpu')}")
EOF
)"
key="$HOROVOD_VERSION-$(sha256sum "$PATCH" | cut -c1-12)-$versions"
wheel_dir="$CACHE/horovod-wheels/$key"
if ! "$PY" -c "import importlib.metadata as m; assert m.version('horovod') == '$HOROVOD_VERSION'" 2>/dev/null \
   || [[ "$(cat "$VENV/.horovod-key" 2>/dev/null)" != "$key" ]]; then
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (takes a few minutes; cached in $wheel_dir)"
        build="$(mktemp -d)"
        trap 'rm -rf "$build"' EXIT
        "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
        tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
        (cd "$build/horovod-$HOROVOD_VERSION" && patch -p1 --forward <"$PATCH")
        mkdir -p "$wheel_dir.tmp"
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" PATH="$VENV/bin:$PATH" \
            "$PY" -m pip wheel -q --no-deps --no-build-isolation \
            -w "$wheel_dir.tmp" "$build/horovod-$HOROVOD_VERSION"
        rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
    fi
    log "installing Horovod from $wheel_dir"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    echo "$key" >"$VENV/.horovod-key"
fi

# 3b. Python-only fixes to the installed Horovod, no rebuild: its Keras callbacks bind bare
#     `keras` (Keras 3) instead of tf.keras (tf_keras), and fail on `K.get_value`.
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for fix in "$REPO"/scripts/horovod/horovod-$HOROVOD_VERSION-keras-*.patch; do
    if ! patch -p1 -d "$site" --dry-run -R -s -f <"$fix" >/dev/null 2>&1; then  # not applied yet
        log "patching the installed Horovod: $(basename "$fix")"
        patch -p1 -d "$site" -s --forward <"$fix"
    fi
done

# 4. grace itself, editable, and its native kernels (csrc/: the CPU library always, the CUDA one
#    where nvcc is found), rebuilt when their sources change; a no-op when they are up to date.
if ! (cd / && "$PY" -c "import grace" 2>/dev/null); then  # not from the repo root: that would find ./grace
    log "installing grace (editable)"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$REPO"
fi
"$PY" "$REPO/csrc/build.py"

# 5. Proof that Horovod sees every framework and controller we rely on.
#    (its stderr, TensorFlow's start-up lines, is shown only if the check fails)
check="$("$VENV/bin/horovodrun" --check-build 2>&1)"
for want in "PyTorch" "TensorFlow" "MPI" "Gloo"; do
    if ! grep -q "\[X\] $want" <<<"$check"; then
        echo "$check" >&2
        echo "[setup] ERROR: horovodrun --check-build does not list $want" >&2
        exit 1
    fi
done
log "ready: $VENV (Horovod $HOROVOD_VERSION with PyTorch, TensorFlow, MPI, Gloo)"
