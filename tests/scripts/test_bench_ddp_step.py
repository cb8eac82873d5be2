"""scripts/bench_ddp_step.py, quick, on the CPU: 2 processes over Gloo run whole DDP steps with
PyTorch's hooks and grace's, and report what each sent."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ddp_step.py"


def test_every_hook_runs_and_reports_its_bytes(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--models", "mlp48", "--world", "2",
                           "--iters", "1", "--threads", "1", "--methods", "topk", "powersgd", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["hook"]: r for r in json.loads((tmp_path / "bench_ddp_step_cpu_gloo_2.json").read_text())["rows"]}
    assert list(rows) == ["DDP", "DDP fp16_compress_hook", "DDP powerSGD_hook(1)", "DDP powerSGD_hook(4)",
                          "grace topk", "grace powersgd"]
    dense = 4 * 48 * (512 * 512 + 512)
    assert rows["DDP"]["bytes"] == dense and rows["DDP fp16_compress_hook"]["bytes"] == dense // 2
    assert rows["DDP powerSGD_hook(1)"]["bytes"] == 4 * 48 * (1024 + 512)  # P, Q and the bias per layer
    assert rows["grace powersgd"]["bytes"] - rows["DDP powerSGD_hook(1)"]["bytes"] in range(4, 4 * 49)  # + flags
    assert rows["grace topk"]["bytes"] < dense / 40
    assert all(r["step_ms"] > 0 and r["world"] == 2 for r in rows.values())
