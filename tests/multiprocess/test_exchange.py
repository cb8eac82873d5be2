"""Real multi-process exchanges: Horovod (Gloo and MPI controllers) and the mpi4py reference
must each deliver, on every rank, what the reference computes from all ranks' inputs."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import launch
from tests.multiprocess.conftest import RUNS, WORKERS, assert_reference_result
from tests.multiprocess.reference import collective_calls, expected
from tests.multiprocess.workers.common import BROADCAST_VARIANTS, PARAMS, STEPS, VARIANTS

HOROVOD_RUNS = [run for run, (launcher, _, _) in RUNS.items() if launcher != "torchrun"]


@pytest.mark.parametrize("label", list(VARIANTS))
@pytest.mark.parametrize("run", HOROVOD_RUNS)
def test_every_rank_gets_the_reference_result(run, label, run_dir):
    assert_reference_result(run, label, VARIANTS[label], run_dir(run))


@pytest.mark.parametrize("label", [l for l, v in VARIANTS.items() if v.make().bucket_mb])
@pytest.mark.parametrize("run", ["torch-horovod-gloo-np3", "torch-horovod-mpi-np2"])
def test_one_collective_per_bucket_and_round(run, label, run_dir):
    """Counted at Horovod's entry points: buckets x the method's rounds (broadcast: one per rank),
    and the ranks' agreement check before an optimizer's first exchange. An accelerator's
    variable-length buckets send their headers apart: two allgathers each."""
    ranks, variant = RUNS[run][1], VARIANTS[label]
    per_step = collective_calls(variant.make(), ranks) * (2 if variant.accelerator else 1)
    want = [per_step + (s in (0, variant.checkpoint_after + 1)) for s in range(STEPS)]
    for rank in range(ranks):
        got = np.load(run_dir(run) / f"{label}.rank{rank}.npz")
        assert [int(got[f"calls/{s}"]) for s in range(STEPS)] == want, f"rank {rank}"


# (threshold_dense sends everything dense: every memory is zero by design)
@pytest.mark.parametrize("label", [l for l in VARIANTS if l.startswith(("topk", "threshold", "randomk"))
                                   and l != "threshold_dense"])
def test_error_feedback_is_per_rank_and_per_parameter(label, run_dir):
    got = [np.load(run_dir("torch-horovod-gloo-np3") / f"{label}.rank{r}.npz") for r in range(3)]
    memories = [k for k in got[0].files if k.startswith("memory/")]
    if VARIANTS[label].make().memory.needs_feedback:
        assert len(memories) == len([p for p in PARAMS if np.prod(p[1]) > 0])
        for key in memories:
            if got[0][key].size > 1:
                assert not np.allclose(got[0][key], got[1][key]), f"{key}: ranks share one memory"
    else:
        assert memories == []


def test_sparsifiers_send_far_fewer_bytes_than_dense(run_dir):
    got = {label: np.load(run_dir("torch-horovod-gloo-np2") / f"{label}.rank0.npz")
           for label in ("none", "fp16", "topk", "randomk")}
    dense = sum(4 * int(np.prod(shape)) for _, shape, _ in PARAMS)
    assert int(got["none"][f"bytes/{STEPS - 1}"]) == dense
    assert int(got["fp16"][f"bytes/{STEPS - 1}"]) == dense // 2
    assert int(got["topk"][f"bytes/{STEPS - 1}"]) < dense / 4  # ratio 0.1: values + 2-byte indices
    assert int(got["randomk"][f"bytes/{STEPS - 1}"]) < dense / 3  # ratio 0.25: values only


def test_averaging_is_over_the_optimizers_process_set(tmp_path):
    """3 ranks, process set {0, 1}: ranks 0 and 1 get the 2-rank reference result."""
    launch("horovodrun", 3, WORKERS / "torch_process_set.py", "--out", tmp_path)
    want = expected(VARIANTS["topk"], 2)
    for rank in range(2):
        got = np.load(tmp_path / f"topk_process_set.rank{rank}.npz")
        assert sorted(got.files) == sorted(want[rank])
        for key, value in want[rank].items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {key}")
    assert not (tmp_path / "topk_process_set.rank2.npz").exists()


@pytest.mark.parametrize("run", ["tensorflow-horovod-gloo-np2", "tensorflow-horovod-gloo-np3"])
def test_tensorflow_with_grace_imported_still_averages(run, run_dir):
    """grace must not import horovod.torch into a TensorFlow process: that silently stops
    Horovod's own TensorFlow tape from averaging (seen with Horovod 0.28.1). The worker also fails
    if torch or horovod.torch was imported."""
    ranks = RUNS[run][1]
    for rank in range(ranks):
        got = np.load(run_dir(run) / f"horovod_own.rank{rank}.npz")["grad"]
        np.testing.assert_allclose(got, np.full(4, (ranks + 1) / 2))


def test_every_allgather_method_also_runs_by_broadcast(tmp_path):
    """communicator='broadcast' (each rank's payload broadcast in turn) for every allgather method:
    3 ranks of the NumPy reference worker match the all-rank reference."""
    labels = list(BROADCAST_VARIANTS)
    assert len(labels) >= 15
    launch("mpirun", 3, WORKERS / "numpy_mpi.py", "--out", tmp_path, "--variants", *labels)
    for label in labels:
        want = expected(BROADCAST_VARIANTS[label], 3)
        for rank in range(3):
            got = np.load(tmp_path / f"{label}.rank{rank}.npz")
            assert sorted(got.files) == sorted(want[rank]), label
            for key, value in want[rank].items():
                np.testing.assert_allclose(got[key].astype(np.float64), value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{label} rank {rank} {key}")
