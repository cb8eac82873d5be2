"""The documentation site builds with Sphinx, strictly: any warning (a broken link or anchor, an
image not found, a docstring that is not valid reST, a page left out of the toctree) fails."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grace

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_docs_build_without_warnings_and_document_the_api(tmp_path):
    # -E: a fresh environment, so no page escapes being read; doctrees kept out of docs/
    cmd = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ["grace.topk", "grace.from_params", "grace.methods", "GraceState", "exchange_for",
                 "Compressor", "Memory"]:
        assert name in api, name
    missing = [name for name in grace.methods() if f'id="grace.{name}"' not in api]
    assert not missing, f"docs/api.md lacks the factories of {missing}"
    assert (tmp_path / "html" / "_images" / "bench_train_throughput.png").exists()
