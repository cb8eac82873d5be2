"""Launching real multi-process runs (horovodrun with Gloo, mpirun, torchrun) from tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # a hung collective fails the test instead of the CI run


def worker_env() -> dict:
    """The environment of launched workers: the venv's launchers first on PATH, one thread each,
    and the repository on PYTHONPATH (workers import the test package, e.g. its fixture methods)."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def launch(launcher: str, np_: int, script: Path, *args, timeout: int = TIMEOUT) -> str:
    """Run ``script`` on ``np_`` real processes; return their output, fail with it on error."""
    python = [sys.executable, str(script), *map(str, args)]
    if launcher == "horovodrun":
        cmd = [str(VENV_BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *python]
    elif launcher == "torchrun":  # (a free port of its own: runs may overlap)
        cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(np_), *python[1:]]
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.fail("mpirun not found: run scripts/setup_env.sh")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np_), *python]
    else:
        raise ValueError(launcher)
    env = worker_env()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s\n{exc.stdout}\n{exc.stderr}")
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}")
    return output


def run_snippet(prelude: str, code: str, env=None) -> str:
    """``prelude`` + ``code`` in a fresh interpreter (import order matters, and hvd.init() must
    not run in the pytest process that later launches mpirun); its stdout, or a failure."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


# --- tiers: a marker per kind of test, from the folder it lives in -------------------------
TIERS = {
    "unit": "single-process tests: methods, backends, native kernels, the toolkit adapters (a few minutes)",
    "multiprocess": "real multi-process runs (horovodrun, mpirun) against an all-rank reference",
    "training": "training runs and benchmark scripts end to end",
    "cluster": "the emulated cluster (network namespaces; needs root)",
    "cuda": "cases on a GPU (skipped where there is none)",
}
_TIER_OF_FOLDER = {"unit": "unit", "torch": "unit", "tensorflow": "unit", "native": "unit",
                   "multiprocess": "multiprocess", "training": "training", "scripts": "training",
                   "cluster": "cluster"}
_CLUSTER_SCRIPTS = {"test_bench_train.py"}  # bench_train brings up the emulated cluster


def pytest_configure(config):
    for name, doc in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(items):
    tests = Path(__file__).parent
    for item in items:
        parts = Path(str(item.fspath)).relative_to(tests).parts
        tier = "cluster" if parts[-1] in _CLUSTER_SCRIPTS else _TIER_OF_FOLDER.get(parts[0], "unit")
        item.add_marker(getattr(pytest.mark, tier))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(value == "cuda" for value in params.values()) or "cuda" in item.name.split("[")[0]:
            item.add_marker(pytest.mark.cuda)
