"""scripts/bench_compress.py, run quick as a subprocess: a row per configured method and size,
sane times, grace's own byte accounting, the output files; bad configurations fail clearly."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import grace
from grace.core.compressor import index_dtype
from grace.core.wire import wire_report

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_compress.py"
CONFIG = REPO / "configs" / "bench_compress.yaml"
QUICK_SIZES = [2**8, 2**10, 2**12]


def run_bench(*args, timeout=120):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_compress")
    proc = run_bench("--config", CONFIG, "--out", out, "--quick", "--no-progress")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "bench_compress.json").read_text())


def test_quick_config_is_small():
    quick = yaml.safe_load(CONFIG.read_text())["quick"]
    assert [2 ** int(s.split("^")[1]) if isinstance(s, str) else s for s in quick["sizes"]] == QUICK_SIZES
    assert quick["repeats"] == 2


def test_every_method_of_the_catalogue_is_configured():
    methods = yaml.safe_load(CONFIG.read_text())["methods"]
    assert {m["grace"]["compressor"] for m in methods} == set(grace.methods())


def test_a_row_per_method_and_size_with_sane_times(quick):
    out, stdout, result = quick
    rows = [r for r in result["rows"] if (r["backend"], r["device"]) == ("torch", "cpu")]
    names = [m["name"] for m in yaml.safe_load(CONFIG.read_text())["methods"]]
    assert sorted((r["method"], r["size"]) for r in rows) == sorted((m, n) for m in names for n in QUICK_SIZES)
    for r in rows:
        for key in ("compress_ms", "decompress_ms", "total_ms", "pipeline_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["method"], r["size"], key, r[key])
        assert r["total_ms"] == pytest.approx(r["compress_ms"] + r["decompress_ms"])
        assert math.isfinite(r["feedback_ms"]) and r["feedback_ms"] >= 0
        assert r["repeats"] == 2 and r["ranks"] == 4
        assert r["bytes"] > 0 and r["dense_bytes"] == 4 * r["size"]
        assert r["method"] in stdout
    assert result["config"]["sizes"] == QUICK_SIZES and result["quick"] is True
    assert result["environment"]["versions"]["torch"]


def test_bytes_are_graces_own_accounting(quick):
    _, _, result = quick
    rows = {(r["method"], r["size"]): r for r in result["rows"] if (r["backend"], r["device"]) == ("torch", "cpu")}
    n = 2**12
    k = math.ceil(0.01 * n)  # top-k: k float32 values and k indices (int16 below 2^15 elements)
    assert index_dtype(n) == "int16"
    framed = -(-(k * (4 + 2) + 1) // 8) * 8  # one frame per bucket: payload, overflow flag byte, padding to 8
    assert rows["topk(0.01)", n]["bytes"] == framed == wire_report(grace.topk(0.01), (n,)).sent_bytes
    # fixed-length methods send the same whatever the data: equal to wire_report's count
    for m in yaml.safe_load(CONFIG.read_text())["methods"]:
        compression = grace.from_params(m["grace"])
        if compression.compressor.traits.variable_length:
            continue
        row = rows[m["name"], n]
        shape = tuple(int(d) for d in row["shape"].split("x"))
        assert row["bytes"] == wire_report(compression, shape).sent_bytes, m["name"]
    # P and Q, and the overflow flag as one more float32 of the first round's allreduce
    assert rows["powersgd(1)", n]["shape"] == "64x64" and rows["powersgd(1)", n]["bytes"] == (64 + 64 + 1) * 4


def test_files_and_plot_exist(quick):
    out, _, result = quick
    assert (out / "bench_compress.csv").read_text().splitlines()[0].startswith("method,")
    assert len((out / "bench_compress.csv").read_text().splitlines()) == 1 + len(result["rows"])
    png = out / "latency_vs_size.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("config, message", [
    ("sizes: [16]\nmethods: [{name: x, grace: {compressor: nosuch}}]", "unknown compression method 'nosuch'"),
    ("methods: [{name: x, grace: {compressor: none}}]", "missing key(s) 'sizes'"),
    ("sizes: [16]\nmethods: [{name: x}]", "methods[0] ('x'): missing key(s) 'grace'"),
    ("sizes: [16]\nmethods: [{name: e, grace: {compressor: efsignsgd}}]", "'lr'"),
    ("sizes: [16]\nmethods: [{name: t, grace: {compressor: topk, compress_ratio: 2}}]", "ratio must be"),
    ("sizes: [16]\nrepeat: 3\nmethods: [{name: x, grace: {compressor: none}}]", "unknown key(s) 'repeat'"),
    ("sizes: [2^x]\nmethods: [{name: x, grace: {compressor: none}}]", "sizes[0]"),
    ("sizes: [16]\nbackends: [jax]\nmethods: [{name: x, grace: {compressor: none}}]", "unknown 'jax'"),
])
def test_bad_config_names_the_problem(tmp_path, config, message):
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    proc = run_bench("--config", path, "--out", tmp_path / "out", "--no-progress", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
