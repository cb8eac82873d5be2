"""A job in which only some ranks run grace can never finish (the grace ranks wait in a
collective the others never make, and no toolkit can cancel one). It must not hang silently:
the grace rank says, within seconds, what it waits for and the likely causes. (With DDP on Gloo
the two ranks' collectives differ in size, and Gloo may stop the job first with its own
"collective mismatch" error; either way the job ends or is explained, never silent.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, worker_env

WORKER = Path(__file__).parent / "workers" / "torch_one_rank_grace.py"
SAYS = "grace: rank 0 has waited"


def output_until(cmd, needle: str, limit: float = 120.0) -> str:
    """Run ``cmd`` until its output holds ``needle`` (or ``limit`` seconds), then stop it whole."""
    env = {**worker_env(), "GRACE_STALL_SECONDS": "3"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline and proc.poll() is None and not any(needle in line for line in lines):
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
    return "".join(lines)


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_grace_on_one_rank_only_says_why_the_job_waits(launcher):
    python = [sys.executable, str(WORKER)]
    cmd = [str(VENV_BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *python] \
        if launcher == "horovodrun" else \
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(WORKER), "--ddp"]
    out = output_until(cmd, SAYS)
    assert "finished" not in out
    if launcher == "torchrun" and "collective mismatch" in out:  # Gloo saw the sizes differ, and stopped
        return
    assert SAYS in out, out[-3000:]
    assert "runs Horovod's own optimizer or DDP's own allreduce" in out
