"""scripts/bench_ops.py end to end at a small size: rows, builds and JSON."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import grace.native as gn

REPO = Path(__file__).resolve().parents[2]


def _runs(isa: str) -> bool:
    try:
        with gn.cpu_build(isa):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not gn.available("cpu"), reason="libgrace_cpu not built")
def test_rows_for_each_method_and_build(tmp_path):
    out = tmp_path / "ops.json"
    builds = ["x86-64-v3", "x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    run = subprocess.run([sys.executable, "scripts/bench_ops.py", "--sizes", "12", "--repeats", "3",
                          "--only", "pack 1-bit", "onebit", "topk select", "--json", str(out),
                          *(["--builds", *builds] if builds else [])],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows if r["method"] == "copy"] == ["copy"]
    timed = [r for r in rows if r["method"] != "copy"]
    runnable = [b for b in builds if _runs(b)] or [gn.cpu_isa()]
    assert sorted((r["method"], r["build"]) for r in timed) == sorted(
        (m, b) for m in ("pack 1-bit", "onebit", "topk select (vs torch.topk)") for b in runnable)
    for r in timed:
        assert r["native_s"] > 0 and r["fallback_s"] > 0 and r["of_copy"] > 0
        assert r["speedup"] == pytest.approx(r["fallback_s"] / r["native_s"])
