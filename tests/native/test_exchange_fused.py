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
    exchange = Exchange(METHODS[method](), ReplicaCommunicator(3))
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
