"""communicator='alltoall' with real processes: every rank must get, bit for bit, what the
all-rank NumPy reference of the two-phase algorithm computes (tests/multiprocess/reference_alltoall.py),
and send the bytes it counts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from grace.core import traffic
from tests.conftest import launch
from tests.multiprocess.conftest import WORKERS
from tests.multiprocess.reference import buckets, expected
from tests.multiprocess.reference_alltoall import expected_alltoall
from tests.multiprocess.workers.common import (ALLTOALL_VARIANTS, AUTO_VARIANTS, PARAMS, STEPS, TRAFFIC_METHODS,
                                               VARIANTS, names)


def layouts_of(got, variant):
    """The buckets a run recorded per step ('layout/<step>': 'key|name,name,...'), as the
    reference takes them; None where it recorded none (grace planned them)."""
    if "layout/0" not in got.files:
        return None
    index = {name: i for i, name in enumerate(names(variant))}
    return [[(entry.split("|")[0], [index[name] for name in entry.split("|")[1].split(",")])
             for entry in got[f"layout/{step}"]] for step in range(STEPS)]


def assert_two_phase_result(label: str, ranks: int, out, exact: bool = True) -> None:
    """Every rank's results, bytes and memories equal the reference's: bit for bit, or (torch,
    whose own sums and norms may round in another order than NumPy's) to float32 rounding."""
    variant = ALLTOALL_VARIANTS[label]
    got = [np.load(out / f"{label}.rank{rank}.npz") for rank in range(ranks)]
    want = expected_alltoall(variant, ranks, layouts_of(got[0], variant))
    for rank in range(ranks):
        assert sorted(k for k in got[rank].files if not k.startswith(("calls/", "layout/"))) == sorted(want[rank]), \
            f"{label} rank {rank}: different tensors"
        for key, value in want[rank].items():
            have = got[rank][key]
            if key.startswith("bytes/"):
                assert int(have) == value, f"{label} rank {rank} {key}: sent {int(have)} bytes, promised {value}"
            elif exact:
                np.testing.assert_array_equal(have, np.asarray(value, dtype=have.dtype),
                                              err_msg=f"{label} rank {rank} {key}")
            else:
                np.testing.assert_allclose(have, value, rtol=1e-5, atol=1e-6, err_msg=f"{label} rank {rank} {key}")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_allgather_method_runs_two_phase_on_the_reference_worker(ranks, tmp_path):
    """The NumPy worker over mpi4py (the collective code every toolkit shares), 2, 3 and 4
    ranks: shards that do not divide the bucket, odd N, and every method family."""
    labels = list(ALLTOALL_VARIANTS)
    assert len(labels) >= 18
    launch("mpirun", ranks, WORKERS / "numpy_mpi.py", "--out", tmp_path, "--variants", *labels, timeout=300)
    for label in labels:
        assert_two_phase_result(label, ranks, tmp_path)


# every family, on each toolkit's own alltoall (Horovod's on PyTorch and TensorFlow, DDP's all_to_all_single)
FAMILIES = ["qsgd_via_alltoall", "terngrad_via_alltoall", "natural_via_alltoall", "signsgd_via_alltoall",
            "signum_via_alltoall", "onebit_via_alltoall", "efsignsgd_via_alltoall", "topk_via_alltoall",
            "threshold_via_alltoall", "dgc_via_alltoall"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_pytorch_two_phase(ranks, tmp_path):
    """Every allgather method through hvd.DistributedOptimizer on horovodrun (Gloo); per bucket and
    step one alltoall and one allgather at Horovod's entry points (and at the first step the
    ranks' check and the owners' memory hand-over, allreduces)."""
    labels = list(ALLTOALL_VARIANTS)
    launch("horovodrun", ranks, WORKERS / "torch_horovod.py", "--out", tmp_path, "--variants", *labels, timeout=600)
    for label in labels:
        assert_two_phase_result(label, ranks, tmp_path, exact=False)
        compression = ALLTOALL_VARIANTS[label].make()
        per_step = 2 * len(buckets(compression))
        # the first step: the ranks' check, and where owners keep memory its hand-over (an allreduce a bucket)
        first = 1 + compression.memory.needs_feedback * len(buckets(compression))
        calls = [int(np.load(tmp_path / f"{label}.rank0.npz")[f"calls/{s}"]) for s in range(STEPS)]
        assert calls == [per_step + first * (s == 0) for s in range(STEPS)], f"{label}: {calls}"


def test_horovod_pytorch_two_phase_under_mpirun(tmp_path):
    launch("mpirun", 2, WORKERS / "torch_horovod.py", "--out", tmp_path, "--variants", *FAMILIES[:4], timeout=600)
    for label in FAMILIES[:4]:
        assert_two_phase_result(label, 2, tmp_path, exact=False)


def test_ddp_hook_two_phase(tmp_path):
    """The DDP communication hook on Gloo, 3 ranks: DDP's own buckets (rebuilt after the first
    step) cut into shards."""
    launch("torchrun", 3, WORKERS / "torch_ddp.py", "--out", tmp_path, "--variants", *FAMILIES, timeout=600)
    for label in FAMILIES:
        assert_two_phase_result(label, 3, tmp_path, exact=False)


def test_tensorflow_two_phase_inside_tf_function(tmp_path):
    """hvd.DistributedGradientTape inside tf.function, 3 ranks: fixed and variable lengths."""
    launch("horovodrun", 3, WORKERS / "tensorflow_horovod.py", "--out", tmp_path, "--variants", *FAMILIES,
           timeout=600)
    for label in FAMILIES:
        assert_two_phase_result(label, 3, tmp_path, exact=False)


@pytest.mark.parametrize("ranks", [2, 3])
def test_auto_takes_the_cheapest_way_on_every_rank(ranks, tmp_path):
    """communicator='auto' on the reference worker: each bucket goes the way grace.core.traffic
    names for its size and the world (here one bucket), and every rank gets that way's result."""
    launch("mpirun", ranks, WORKERS / "numpy_mpi.py", "--out", tmp_path, "--variants", *AUTO_VARIANTS, timeout=300)
    ways = set()
    for label, variant in AUTO_VARIANTS.items():
        compression = variant.make()
        (group,) = buckets(compression)
        numel = sum(int(np.prod(PARAMS[i][1])) for i in group)
        way = traffic.chosen(compression, traffic.received(compression, numel, ranks), ranks)
        ways.add(way)
        method = label.removesuffix("_via_auto")
        got = [np.load(tmp_path / f"{label}.rank{rank}.npz") for rank in range(ranks)]
        if way == "alltoall":
            want = expected_alltoall(ALLTOALL_VARIANTS[f"{method}_via_alltoall"], ranks)
        else:
            assert way == "allgather", way
            want = expected(VARIANTS[method], ranks)
        for rank in range(ranks):
            assert sorted(got[rank].files) == sorted(want[rank]), f"{label} rank {rank}"
            for key, value in want[rank].items():
                np.testing.assert_allclose(got[rank][key].astype(np.float64), value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{label} ({way}) rank {rank} {key}")
    # 2 ranks: one payload either way, the two-phase frames cost more; 3 ranks: both ways occur
    assert ways == ({"allgather"} if ranks == 2 else {"allgather", "alltoall"}), ways


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_bytes_received_at_horovods_entry_points_are_the_traffic_table(ranks, tmp_path):
    """horovodrun (Gloo), a small model: what each rank receives per step, counted at Horovod's
    own allgather and alltoall (their outputs less this rank's own part), is within 2% of
    grace.core.traffic's table for the buckets the run used, under allgather, alltoall and auto;
    the two phases receive less than the allgather at 8 ranks, and at 4 for all but top-k and
    onebit (whose owners send back four times a shard's payload: 3.75 payloads per rank against the
    allgather's 3)."""
    methods = list(TRAFFIC_METHODS) if ranks < 8 else ["qsgd", "signsgd", "topk"]  # (8 processes on 2 cores)
    launch("horovodrun", ranks, WORKERS / "torch_traffic.py", "--out", tmp_path, "--methods", *methods, timeout=600)
    for rank in range(ranks):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key, got in results.items():
            method, communicator = key.split("/")
            compression = TRAFFIC_METHODS[method](communicator)
            model = 0
            for numel in got["buckets"]:
                costs = traffic.received(compression, numel, ranks)
                way = traffic.chosen(compression, costs, ranks) if communicator == "auto" else communicator
                model += costs[way]
            assert abs(got["received"][-1] / model - 1) <= 0.02, f"rank {rank} {key}: {got['received']} vs {model}"
            if communicator == "auto":
                assert got["plans"] == ["alltoall" if way == "alltoall" else "per-gradient"], (key, got["plans"])
        if ranks >= 4:
            for method in methods if ranks == 8 else [m for m in methods if m not in ("topk", "onebit")]:
                assert results[f"{method}/alltoall"]["received"][-1] < results[f"{method}/allgather"]["received"][-1]
