"""The exchange takes the one-pass residual kernels (compensate, select, new residual) for top-k
and threshold with residual memory: over several steps the payloads, results and memory equal
those of the three separate steps (GRACE_NATIVE off)."""
from __future__ import annotations

import numpy as np
import pytest

import grace
import grace.native as gn
from grace.core.communicator import ReplicaCommunicator
from grace.core.exchange import Exchange
from tests.native.conftest import count_calls, device, gradient, host, on, torch  # noqa: F401

METHODS = {"topk": lambda: grace.topk(0.01), "threshold": lambda: grace.threshold(1.5),
           "topk_scaled": lambda: grace.topk(0.05, memory=grace.memories.ResidualMemory(beta=0.9, gamma=0.5))}
KERNEL = {"topk": "topk_ef_step", "threshold": "threshold_ef_step", "topk_scaled": "topk_ef_step"}
# a bucket's gradients in one call: each gradient at its own pointers (CPU), or segment-wise (GPU)
WHOLE_BUCKET = {"topk_ef_step": ("topk_ef_step_many", "topk_ef_step_segments"),
                "threshold_ef_step": ("threshold_ef_step_many",)}


def run(method, device, steps=3):
    exchange = Exchange(METHODS[method]().via("allgather"), ReplicaCommunicator(3))  # (not 'auto': one way)
    outs = []
    for step in range(steps):
        grads = {"w": on(device, gradient(4097 * 3, seed=step).reshape(3, 4097)), "b": on(device, gradient(77, seed=9))}
        outs.append({k: host(v) for k, v in exchange.exchange(grads).items()})
    return outs, {k: host(v) for k, v in exchange.memory.items()}, exchange.stats.bytes_sent


@pytest.mark.parametrize("method", sorted(METHODS))
def test_fused_residual_step_equals_the_separate_steps(device, method, monkeypatch):
    with gn.disabled():
        want = run(method, device)
    per_gradient = count_calls(monkeypatch, KERNEL[method])
    per_bucket = [count_calls(monkeypatch, name) for name in WHOLE_BUCKET[KERNEL[method]]]
    got = run(method, device)
    # 3 steps of a bucket of 2 gradients, each through a fused kernel
    assert len(per_gradient) + 2 * sum(map(len, per_bucket)) == 6, "the exchange did not take the fused kernel"
    for a, b in zip(want[0], got[0]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    for key in want[1]:
        np.testing.assert_array_equal(want[1][key], got[1][key])
    assert want[2] == got[2]


# a CPU bucket's gradients in one call: the methods without memory, and DGC's whole step
IN_ONE_CALL = {"signsgd": ("compress_many", "signsgd_compress"),
               "terngrad": ("compress_many", "terngrad_compress_drawn"), "qsgd": ("compress_many", "qsgd_compress_drawn"), "natural": ("compress_many", "natural_compress_drawn"),
               "dgc": ("dgc_step_many", "dgc_compensate_into")}


@pytest.mark.parametrize("method", sorted(IN_ONE_CALL))
def test_a_cpu_bucket_takes_one_native_call_with_the_per_tensor_results(method, monkeypatch):
    """On a CPU a bucket of these methods is compressed by one native call a step (never the
    per-gradient kernel): results and memories as the per-tensor exchange's, bit for bit."""
    make = {"signsgd": grace.signsgd, "terngrad": grace.terngrad, "natural": grace.natural,
            "qsgd": lambda **kw: grace.qsgd(127, **kw), "dgc": lambda **kw: grace.dgc(0.01, sample_ratio=0.1, **kw)}

    def steps(bucket_mb):
        compression = make[method](bucket_mb=bucket_mb, communicator="allgather")  # (not 'auto': one way)
        exchange, outs = Exchange(compression, ReplicaCommunicator(3)), []
        for step in range(3):
            grads = {"w": torch.from_numpy(gradient(4097 * 3, seed=step).reshape(3, 4097)),
                     "b": torch.from_numpy(gradient(77, seed=9))}
            outs.append({k: v.numpy().copy() for k, v in exchange.exchange(grads).items()})
        memory = {k: [t.numpy().copy() for t in (v if isinstance(v, tuple) else (v,))]
                  for k, v in exchange.memory.items()}
        return outs, memory

    want = steps(0)
    per_bucket, per_gradient = (count_calls(monkeypatch, name) for name in IN_ONE_CALL[method])
    got = steps(25)
    assert (len(per_bucket), len(per_gradient)) == (3, 0)  # 3 steps of one bucket of 2 gradients
    for a, b in zip(want[0], got[0]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert sorted(want[1]) == sorted(got[1])
    for key in want[1]:
        for x, y in zip(want[1][key], got[1][key]):
            np.testing.assert_array_equal(x, y)
