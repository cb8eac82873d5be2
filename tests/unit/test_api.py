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
    (lambda: grace.randomk(0.1, seed=-1), "seed must be a non-negative integer below 2\\*\\*24"),
    (lambda: grace.ResidualMemory(beta=-1), "beta must be a finite number >= 0"),
    (lambda: grace.create("bogus"), "unknown compression method 'bogus'"),
    (lambda: grace.from_params({"compressor": "bogus"}), "unknown compression method 'bogus'"),
    (lambda: grace.from_params(["topk"]), "params must be a dict of GRACE parameters"),
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


SEEDED = ["randomk", "qsgd", "natural", "terngrad", "powersgd", "dgc"]


@pytest.mark.parametrize("seed", [None, 1.5, float("nan"), "3", -1, True, 2**24])
@pytest.mark.parametrize("method", SEEDED)
def test_a_bad_seed_is_refused_at_construction(method, seed):
    make = registry.examples(method=method)[method]
    with pytest.raises(ValueError, match=r"seed must be a non-negative integer below 2\*\*24"):
        make.func(*make.args, **{**make.keywords, "seed": seed})


def test_a_seed_is_taken_from_grace_dictionaries_too():
    with pytest.raises(ValueError, match="seed must be"):
        grace.from_params({"compressor": "qsgd", "quantum_num": 8, "seed": "3"})
    assert grace.from_params({"compressor": "qsgd", "quantum_num": 8, "seed": 3}).compressor.seed == 3


MEMORIES = ["none", "residual", "dgc", "powersgd"]


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("method", [m for m in registry.methods() if m != "efsignsgd"])  # (its memory needs lr)
def test_a_memory_either_fits_its_method_or_is_refused_at_construction(method, memory):
    """Each named memory with each method: refused when the method is built, with a ValueError
    naming the memory, or it runs steps on NumPy and PyTorch, per tensor and in buckets."""
    torch = pytest.importorskip("torch")
    make = registry.examples(method=method)[method]
    try:
        compression = make.func(*make.args, **{**make.keywords, "memory": memory})
    except ValueError as error:
        assert "memory" in str(error)
        return
    rng = np.random.default_rng(0)
    for convert in (np.asarray, torch.from_numpy):
        for bucket_mb in (0, 25):
            compression.bucket_mb = bucket_mb
            exchange = Exchange(compression, LocalCommunicator())
            for _ in range(2):
                out = exchange.exchange({"w": convert(rng.standard_normal((8, 6)).astype(np.float32)),
                                         "b": convert(rng.standard_normal(6).astype(np.float32))})
                assert all(np.isfinite(np.asarray(v)).all() for v in out.values())


def test_powersgd_memory_is_refused_for_other_methods():
    with pytest.raises(ValueError, match="memory PowerSGDMemory cannot be used with TopK"):
        grace.topk(0.1, memory="powersgd")


@pytest.mark.parametrize("bucket_mb", [0, 25])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_qsgd_bucket_beyond_a_tensor_is_the_whole_tensor(backend, bucket_mb):
    """bucket_size=10**12 used to pad every tensor to 10**12 elements (a step that never ends)."""
    convert = np.asarray if backend == "numpy" else pytest.importorskip("torch").from_numpy
    rng = np.random.default_rng(1)
    grads = {f"g{n}": rng.standard_normal(n).astype(np.float32) for n in (1, 7, 33, 100)}
    outs = []
    for bucket_size in (10**12, 0):
        exchange = Exchange(grace.qsgd(8, bucket_size=bucket_size, bucket_mb=bucket_mb), LocalCommunicator())
        outs.append(exchange.exchange({k: convert(v.copy()) for k, v in grads.items()}))
    for name in grads:
        np.testing.assert_array_equal(np.asarray(outs[0][name]), np.asarray(outs[1][name]))
