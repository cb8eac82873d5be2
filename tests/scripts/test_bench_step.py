"""scripts/bench_step.py end to end on the CPU (mlp48, two methods): the table and the JSON,
with grace's work and the stand-in collectives timed apart."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_step.py"


def test_bench_step_reports_work_without_the_stand_in_collectives(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "mlp48", "--methods", "none", "topk",
                           "--iters", "2", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench_step_cpu.json").read_text())["rows"]}
    assert set(rows) == {"none", "topk"}
    for row in rows.values():
        assert row["tensors"] == 96 and row["per_tensor_calls"] >= 96
        assert row["bucketed_calls"] == 2  # 50 MB of gradients in 25 MB buckets
        for mode in ("per_tensor", "bucketed"):
            assert row[f"{mode}_collective_ms"] > 0
            assert 0 < row[f"{mode}_work_ms"] < row[f"{mode}_exchange_ms"]
    assert rows["topk"]["bucketed_bytes"] * 40 < rows["none"]["bucketed_bytes"]
    assert "mlp48 on cpu: 96 gradient tensors" in proc.stdout
    # top-k's work against error feedback's floor, none's against a read plus a write: a ratio and its target
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split()}
    assert re.search(r" \d+\.\d\dx/2 ", lines["topk"]) and re.search(r" \d+\.\d\dx/1\.5 ", lines["none"])
    assert "CPU targets: bucketed work within 2x error feedback's floor" in proc.stdout
    # the floor sampled between the method's steps (each pass after backward's write), the model's warm repeat
    for key in ("read_ms", "write_ms", "compensate_ms", "feedback_floor_ms"):
        assert rows["topk"][key] > 0 and rows["topk"][f"warm_{key}"] > 0
    ratio = rows["topk"]["bucketed_work_ms"] / rows["topk"]["feedback_floor_ms"]
    assert f" {ratio:.2f}x/2 " in lines["topk"]


def test_the_accelerator_path_counted_on_a_cpu(tmp_path):
    """--accelerator-path: the code path a GPU takes, its operations and host waits counted on
    the CPU, with grace's CUDA library (each native call at its CUDA launches) and without it.
    Every method reads back once a step on both paths: top-k and DGC (k slots per segment) the
    overflow count, threshold every bucket's ranks' headers (its counts and the flags), which it
    sends apart from its frames: two collectives a bucket."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "mlp48", "--methods", "topk", "dgc", "threshold",
                           "--accelerator-path", "--iters", "1", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench_step_cpu.json").read_text())["rows"]}
    buckets = 2
    for method in ("topk", "dgc", "threshold"):
        assert rows[method]["bucketed_waits"] == rows[method]["bucketed_fallback_waits"] == 1, method
    for method, row in rows.items():
        assert row["bucketed_buckets"] == buckets
        assert row["bucketed_calls"] == buckets * (2 if method == "threshold" else 1), method
    # top-k's step: one native call a bucket (6 launches per 64 gradients: the radix passes, the
    # counts, the writes into the frame) and the mean (one), torch ops without them
    assert buckets * (6 + 1) <= rows["topk"]["bucketed_ops"] < rows["topk"]["bucketed_fallback_ops"]
    # without the library: top-k's and DGC's two phases a bucket fused by torch.compile (inductor's
    # C++ kernels counted); threshold's selection and mean too, its frame (sized by the counts) op by op
    for method in ("topk", "dgc", "threshold"):
        assert rows[method]["bucketed_fallback_ops"] <= 24 * buckets, method
    assert "limits: ops per bucket 12 native, 24 fallback" in proc.stdout


def test_shrunk_gradients_time_what_does_not_grow_with_size(tmp_path):
    """--shrink: the same model's gradients (count, names, ranks) about N times smaller, in as
    many buckets; no floor or CPU targets then (the passes would be over tiny tensors)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "mlp48", "--methods", "topk", "--bucketed-only",
                           "--shrink", "100", "--iters", "2", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((tmp_path / "bench_step_cpu.json").read_text())["rows"][0]
    assert row["shrink"] == 100 and row["tensors"] == 96 and row["bucketed_calls"] == 2
    assert 12.6e6 / 150 < row["parameters"] < 12.6e6 / 50  # (48 of 512 x 512 and 48 of 512, each ~100x smaller)
    assert "every gradient 100x smaller (--shrink)" in proc.stdout and "CPU targets" not in proc.stdout
    assert "read_ms" not in row and row["bucketed_work_ms"] > 0
