"""Whether the native kernels run, said to the user. A source checkout whose native library is
missing runs every method several times slower: the first exchange says so once, naming what is
missing and the command that builds it (each case in a new process: the libraries load once per
process; three steps of top-k by PyTorch). ``python -m grace`` says what runs natively."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import grace.native as gn

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys, warnings
from pathlib import Path
import grace.native._loader as loader
if sys.argv[1] != "-":
    loader.LIB_DIR = Path(sys.argv[1])  # (before anything loads a library: as if it were never built)
import torch
import grace
from grace.core.communicator import LocalCommunicator
exchange = grace.Exchange(grace.topk(0.1), LocalCommunicator())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(3):
        exchange.exchange({"w": torch.randn(100, 10), "b": torch.randn(10)})
print(json.dumps([str(w.message) for w in caught if "native" in str(w.message)]))
"""


def _warnings(lib_dir: str, **env) -> list:
    out = subprocess.run([sys.executable, "-c", SCRIPT, lib_dir], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_missing_native_library_is_reported_once_with_the_command_that_builds_it(tmp_path):
    (message,) = _warnings(str(tmp_path))
    assert "native cpu kernels are not loaded" in message and str(tmp_path / "libgrace_cpu.so") in message
    assert "python csrc/build.py" in message


def test_no_warning_where_the_library_loads_or_is_turned_off_on_purpose(tmp_path):
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu is not built here")
    assert _warnings("-") == []
    assert _warnings(str(tmp_path), GRACE_NATIVE="0") == []


def _about(**env) -> str:
    out = subprocess.run([sys.executable, "-m", "grace"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_python_m_grace_says_what_runs_natively():
    text = _about()
    assert text.startswith("grace ") and "torch" in text and "native libraries:" in text
    if gn.available("cpu"):
        assert f"cpu   {gn.library('cpu').path} ({gn.cpu_isa()})" in text
        native = text.split("native on cpu: ")[1].split(";")[0].split(", ")
        assert {"topk", "qsgd", "onebit", "powersgd"} <= set(native) and "sketchml" not in native
    off = _about(GRACE_NATIVE="0")
    assert "cpu   off (GRACE_NATIVE=0)" in off and "native on cpu" not in off
