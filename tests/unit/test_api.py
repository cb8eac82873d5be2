"""The public API: factories, validation at construction, GRACE dictionaries, imports."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import grace
from grace import Exchange
from grace.core import registry
from grace.core.communicator import LocalCommunicator


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan"), "0.1", None, True])
@pytest.mark.parametrize("factory", [grace.topk, grace.randomk])
def test_ratio_outside_0_1_is_refused_at_construction(factory, ratio):
    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\]"):
        factory(ratio)


@pytest.mark.parametrize("call, message", [
    (lambda: grace.threshold(-1.0), "threshold must be a finite number >= 0"),
    (lambda: grace.threshold(float("inf")), "threshold must be a finite number >= 0"),  # would send nothing, ever
    (lambda: grace.threshold(float("nan")), "threshold must be a finite number >= 0"),
    (lambda: grace.ResidualMemory(beta=float("nan")), "beta must be a finite number >= 0"),
    (lambda: grace.ResidualMemory(gamma=float("inf")), "gamma must be a finite number >= 0"),
    (lambda: grace.efsignsgd(float("inf")), "lr must be a finite number > 0"),
    (lambda: grace.efsignsgd(0), "lr must be a finite number > 0"),
    (lambda: grace.inceptionn(float("nan")), "error_bound must be a finite number > 0"),
    (lambda: grace.dgc(0.1, clip_norm=float("inf")), "clip_norm must be a finite number >= 0"),
    (lambda: grace.topk(0.1, memory="bogus"), "memory must be one of"),
    (lambda: grace.topk(0.1, communicator="bogus"), "communicator must be one of"),
    (lambda: grace.topk(0.1, communicator="allreduce"), "cannot carry TopK payloads"),
    (lambda: grace.threshold(0.1, communicator="allreduce"), "cannot carry Threshold payloads"),
    (lambda: grace.fp16("int8"), "dtype must be 'float16' or 'bfloat16'"),
    (lambda: grace.randomk(0.1, seed=-1), "seed must be a non-negative integer"),
    (lambda: grace.ResidualMemory(beta=-1), "beta must be a finite number >= 0"),
    (lambda: grace.create("bogus"), "unknown compression method 'bogus'"),
    (lambda: grace.from_params({"compressor": "bogus"}), "unknown compression method 'bogus'"),
    (lambda: grace.from_params({"memory": "residual"}), "needs a 'compressor' key"),
    (lambda: grace.from_params({"compressor": "topk", "compress_ratio": 0.1, "quantum_num": 4}),
     "topk does not take parameter 'quantum_num'"),
    (lambda: grace.from_params({"compressor": "topk", "compress_ratio": 2}), "ratio must be"),
])
def test_bad_arguments_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_from_params_accepts_grace_dictionaries():
    c = grace.from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                           "compress_ratio": 0.3, "world_size": 8})
    assert (type(c.compressor).__name__, c.compressor.ratio, type(c.memory).__name__, c.collective.value) == \
        ("TopK", 0.3, "ResidualMemory", "allgather")
    c = grace.from_params({"compressor": "threshold", "threshold": 0.01, "memory": "none",
                           "communicator": "broadcast"})
    assert (c.compressor.threshold, type(c.memory).__name__, c.collective.value) == (0.01, "NoMemory", "broadcast")
    assert grace.from_params({"compressor": "fp16"}).collective.value == "allreduce"


def test_default_memories_follow_the_catalogue():
    memories = {name: type(grace.create(name, **args).memory).__name__ for name, args in
                [("none", {}), ("fp16", {}), ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1}),
                 ("threshold", {"threshold": 0.1})]}
    assert memories == {"none": "NoMemory", "fp16": "NoMemory", "topk": "ResidualMemory",
                        "randomk": "ResidualMemory", "threshold": "ResidualMemory"}


def test_integer_gradients_are_refused_with_their_dtype():
    with pytest.raises(TypeError, match="'w' has dtype int64"):
        Exchange(grace.topk(0.1), LocalCommunicator()).exchange({"w": np.arange(10)})


def test_horovod_hook_on_a_grace_object_fails_loudly():
    with pytest.raises(RuntimeError, match="Horovod's dense allreduce hook"):
        grace.topk(0.1).compress(np.zeros(3))


def test_import_grace_imports_no_toolkit_and_no_horovod():
    code = ("import sys, grace; grace.topk(0.1); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'horovod', 'mpi4py')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_registered_method_is_under_test():
    from tests.multiprocess.workers.common import VARIANTS
    from tests.unit.conftest import METHODS

    for labels in (METHODS, VARIANTS):
        tested = {type(make().compressor) for make in (labels[k] if labels is METHODS else labels[k].make
                                                        for k in labels)}
        registered = {type(METHODS[name]().compressor) for name in registry.methods(None)}
        assert registered <= tested, registered - tested
