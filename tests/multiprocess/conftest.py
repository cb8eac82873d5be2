"""The shared multi-process runs: each launched once per test session, on first use."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import launch
from tests.multiprocess.reference import expected

WORKERS = Path(__file__).parent / "workers"
RUNS = {  # name: (launcher, ranks, worker)
    "numpy-mpi4py-np2": ("mpirun", 2, "numpy_mpi.py"),
    "numpy-mpi4py-np3": ("mpirun", 3, "numpy_mpi.py"),
    "torch-horovod-gloo-np2": ("horovodrun", 2, "torch_horovod.py"),
    "torch-horovod-gloo-np3": ("horovodrun", 3, "torch_horovod.py"),
    "torch-horovod-mpi-np2": ("mpirun", 2, "torch_horovod.py"),
    "tensorflow-horovod-gloo-np2": ("horovodrun", 2, "tensorflow_horovod.py"),
    "tensorflow-horovod-gloo-np3": ("horovodrun", 3, "tensorflow_horovod.py"),
    "torch-ddp-gloo-np2": ("torchrun", 2, "torch_ddp.py"),
    "torch-ddp-gloo-np3": ("torchrun", 3, "torch_ddp.py"),
}


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """Launch each run once, lazily; return its output folder."""
    done = {}

    def get(run: str) -> Path:
        if run not in done:
            launcher, ranks, worker = RUNS[run]
            out = tmp_path_factory.mktemp(run)
            launch(launcher, ranks, WORKERS / worker, "--out", out)
            done[run] = out
        return done[run]

    return get


def tolerance(label: str):
    if label in ("fp16", "bf16"):
        return dict(rtol=2e-2, atol=2e-2)
    if label.startswith("powersgd"):  # float32 Gram-Schmidt against NumPy's QR (Householder), then
        return dict(rtol=1e-4, atol=1e-5)  # steps of error feedback: apart by rounding, amplified
    return dict(rtol=1e-5, atol=1e-6)


def assert_reference_result(run: str, label: str, variant, out: Path) -> None:
    """Every rank's gradients, bytes sent and final state equal the all-rank reference's."""
    ranks = RUNS[run][1]
    want = expected(variant, ranks)
    for rank in range(ranks):
        got = np.load(out / f"{label}.rank{rank}.npz")
        assert sorted(k for k in got.files if not k.startswith("calls/")) == sorted(want[rank]), \
            f"rank {rank}: different tensors"
        for key, value in want[rank].items():
            if key.startswith("bytes/"):
                assert int(got[key]) == value, f"rank {rank} {key}: sent {int(got[key])} bytes, promised {value}"
            else:
                np.testing.assert_allclose(got[key].astype(np.float64), value, **tolerance(label),
                                           err_msg=f"{run} {label} rank {rank} {key}")
