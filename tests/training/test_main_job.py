"""README's main command, ``bash scripts/run_training.sh``, as a user runs it (set-up included,
from outside the repository), in 3 epochs: it trains, prints its summary, and prints no line from
TensorFlow, which a PyTorch job does not use (TensorFlow's C++ start-up lines begin with a
glog-style 'I0000 00:00:...' header, or absl's pre-initialisation warning)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "run_training.sh"
TENSORFLOW_LINE = re.compile(r"^(\[\d+\]<std(out|err)>:)?\s*([IWEF]\d{4} \d\d:\d\d:"
                             r"|WARNING: All log messages before absl"
                             r"|.*(oneDNN custom operations|cudart_stub|cpu_feature_guard|This TensorFlow binary))")


@pytest.mark.timeout(900)
def test_the_main_job_trains_and_prints_no_tensorflow_line(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), "--epochs", "3"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=840)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert re.search(r"test accuracy\s+0\.\d+", output) and "ranks agree       True" in output, output[-4000:]
    noise = [line for line in output.replace("\r", "\n").splitlines() if TENSORFLOW_LINE.match(line)]
    assert not noise, "\n".join(noise[:10])
