"""horovodrun, asking Horovod's PyTorch extension first how Horovod was built.

Before it launches, horovodrun checks the build (Gloo, MPI, NCCL) by importing a framework's
extension in a forked process, TensorFlow's first. Importing TensorFlow writes its C++
start-up lines (oneDNN, CUDA drivers) to the launcher's stderr, and no log-level variable
silences them; the PyTorch extension of the same build gives the same answers without them.
Everything else is horovodrun unchanged:

    python -m grace.bench.horovodrun -np 4 -H localhost:4 --gloo python scripts/train.py
"""
import sys

#: the command that runs it, for a launch from Python
HOROVODRUN = [sys.executable, "-m", "grace.bench.horovodrun"]


def main() -> int:
    from horovod.common import util  # (here: importing this module for HOROVODRUN needs no Horovod)
    from horovod.runner.launch import run_commandline

    util.EXTENSIONS[:] = ["torch"] + [name for name in util.EXTENSIONS if name != "torch"]
    sys.argv[0] = "horovodrun"
    return run_commandline()


if __name__ == "__main__":
    sys.exit(main())
