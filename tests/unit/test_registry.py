"""A method is one file: registered with its examples, it is exported and tried by every test
catalogue. tests/fixtures/methods/firstk.py, a method of the tests alone, is the proof."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import grace
from grace.core import registry
from grace.core.registry import example, register
from tests.unit.conftest import METHODS

FIXTURE = "firstk"  # tests/fixtures/methods/firstk.py
REPO = Path(__file__).resolve().parents[2]


def test_the_fixture_method_is_in_every_catalogue():
    from tests.multiprocess.test_overflow import LABELS
    from tests.multiprocess.workers.common import BROADCAST_VARIANTS, DDP_VARIANTS, VARIANTS
    from tests.unit.test_wire import DEFAULTS

    for catalogue in (METHODS, DEFAULTS, VARIANTS, DDP_VARIANTS, LABELS):
        assert FIXTURE in catalogue
    assert f"{FIXTURE}_via_broadcast" in BROADCAST_VARIANTS


def test_the_fixture_method_is_under_test_single_and_multi_process():
    """The parametrized tests that check each method (the multi-process ones against the
    all-rank reference, on every launcher) have a case for it."""
    checks = ["tests/unit/test_methods.py::test_decompress_restores_shape_and_dtype",
              "tests/unit/test_methods.py::test_numpy_and_torch_backends_agree",
              "tests/unit/test_buckets.py", "tests/unit/test_overflow.py",
              "tests/unit/test_wire.py::test_bytes_on_the_wire_are_the_ideal_within_one_percent",
              "tests/multiprocess/test_exchange.py::test_every_rank_gets_the_reference_result",
              "tests/multiprocess/test_exchange.py::test_one_collective_per_bucket_and_round",
              "tests/multiprocess/test_ddp.py::test_every_rank_gets_the_reference_result",
              "tests/multiprocess/test_ddp.py::test_ddp_and_horovod_give_the_same_gradients",
              "tests/multiprocess/test_overflow.py::test_an_overflow_on_one_rank_costs_one_step_on_every_rank"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *checks],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    for check in checks:
        assert any(i.startswith(check) and FIXTURE in i for i in ids), f"{check}: no case for {FIXTURE}"
    runs = {i.split("[")[1] for i in ids if "test_exchange.py::test_every_rank" in i and FIXTURE in i}
    assert len(runs) >= 7, runs  # every Horovod run: NumPy/mpi4py, PyTorch, TensorFlow


def test_grace_exports_its_own_methods_and_not_the_fixtures():
    from grace.compressors import TopK, topk

    assert grace.topk is topk and isinstance(topk(0.1).compressor, TopK)
    assert FIXTURE in registry.methods(None) and FIXTURE not in grace.methods()
    assert set(grace.methods()) <= set(grace.__all__) and not hasattr(grace, FIXTURE)
    assert all(getattr(grace, name) is registry.factory(name) for name in grace.methods())
    assert type(grace.create(FIXTURE, ratio=0.5).compressor).__name__ == "FirstK"  # created by name all the same


def test_every_method_has_its_main_example_and_labels_are_unique():
    for name in registry.methods(None):
        assert name in registry.examples(method=name)
    with pytest.raises(ValueError, match="one of its examples must be labelled 'bogus'"):
        register("bogus", examples=dict(other=example()))
    with pytest.raises(ValueError, match=r"example labels \['topk'\] are taken by \['topk'\]"):
        register("bogus", examples=dict(bogus=example(), topk=example()))
    assert "bogus" not in registry.methods(None)


def test_a_native_fast_path_is_one_kernel_file_and_one_registration():
    """tests/fixtures/methods/firstk_kernels.py gives the fixture method a native fast path (a CPU
    bucket's residual steps in one call) with one ``@kernels_for(FirstK)``, its method file left
    as it is: the bucketed exchange takes it and equals the per-tensor formula byte for byte."""
    import numpy as np
    import torch

    from grace.core.communicator import ReplicaCommunicator
    from grace.core.plans.kernels import kernels_of
    from tests.fixtures.methods import firstk, firstk_kernels

    if not grace.native.available():
        pytest.skip("grace's native library is not built")
    assert type(kernels_of(grace.create(FIXTURE, ratio=0.25).compressor)) is firstk_kernels.FirstKKernels
    assert "native" not in Path(firstk.__file__).read_text()
    taken, fast_path = [], firstk_kernels.FirstKKernels.compress_many_with_residual

    def spied(self, *args, **kwargs):
        result = fast_path(self, *args, **kwargs)
        taken.append(result is not None)
        return result

    rng = np.random.default_rng(0)
    steps = [{name: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
              for name, shape in (("w", (30, 7)), ("b", (5,)), ("head", (300,)))} for _ in range(4)]
    bucketed = grace.Exchange(grace.create(FIXTURE, ratio=0.25), ReplicaCommunicator(2))
    per_tensor = grace.Exchange(grace.create(FIXTURE, ratio=0.25, bucket_mb=0), ReplicaCommunicator(2))
    original = firstk_kernels.FirstKKernels.compress_many_with_residual
    firstk_kernels.FirstKKernels.compress_many_with_residual = spied
    try:
        for grads in steps:
            got = bucketed.exchange({name: g.clone() for name, g in grads.items()})
            want = per_tensor.exchange({name: g.clone() for name, g in grads.items()})
            for name in grads:
                assert got[name].numpy().tobytes() == want[name].numpy().tobytes(), name
    finally:
        firstk_kernels.FirstKKernels.compress_many_with_residual = original
    assert taken and all(taken), taken
    for name, memory in per_tensor.memory.items():
        assert bucketed.memory[name].numpy().tobytes() == memory.numpy().tobytes(), name
