"""The house's size rules hold (scripts/code_sizes.py): no file of grace/core, grace/native,
grace/torch or grace/tensorflow over 400 lines, no function over 60 lines or nested over 4 deep,
no C++/CUDA source over 1,200 lines, and the method contract (Compressor, Memory) at most 12
public members each."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_size_rules_hold():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "code_sizes.py")], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("breaches: python 0, native 0, contract 0"), done.stdout


def test_a_breach_is_reported(tmp_path):
    """The check can fail: a function of 61 lines is named."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import code_sizes
    finally:
        sys.path.pop(0)
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "grace").mkdir()
    (tmp_path / "grace" / "long.py").write_text(f"def long():\n{body}\n")
    original = code_sizes.ROOT
    code_sizes.ROOT = tmp_path
    try:
        assert list(code_sizes.python_breaches()) == ["grace/long.py:1 long: 61 lines (at most 60)"]
    finally:
        code_sizes.ROOT = original
