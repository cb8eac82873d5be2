"""Residual memory: what is compensated is exactly what was sent plus what is remembered."""
from __future__ import annotations

import numpy as np
import pytest

import grace
from grace import Exchange
from grace.core.communicator import LocalCommunicator
from grace.core.memory import buffer_of, Deferred
from tests.unit.conftest import METHODS, to_backend


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold", "fp16"])
def test_compensated_equals_transmitted_plus_new_residual(xp, method):
    compression = METHODS[method]()
    compression.memory = grace.ResidualMemory()
    exchange = Exchange(compression, LocalCommunicator())
    rng = np.random.default_rng(0)
    residual = None
    for step in range(5):
        g = to_backend(xp, rng.standard_normal((20, 30)))
        p = xp.to_numpy(g) + (0 if residual is None else residual)
        sent = xp.to_numpy(exchange.exchange({"w": g})["w"])  # one rank: the mean is its own Q^-1(Q(p))
        residual = xp.to_numpy(exchange.memory["w"])
        np.testing.assert_allclose(sent + residual, p, rtol=1e-6, atol=1e-6)
    assert exchange.steps == {"w": 5}


def test_beta_and_gamma_weight_memory_and_gradient(xp):
    memory = grace.ResidualMemory(beta=0.5, gamma=2.0)
    g, e = to_backend(xp, np.ones(3)), to_backend(xp, np.full(3, 4.0))
    np.testing.assert_array_equal(xp.to_numpy(memory.compensate(xp, g, e)), [4.0, 4.0, 4.0])
    np.testing.assert_array_equal(xp.to_numpy(memory.compensate(xp, g, memory.init(xp, g))), [2.0, 2.0, 2.0])


def test_no_memory_keeps_nothing(xp):
    exchange = Exchange(grace.topk(0.1, memory="none"), LocalCommunicator())
    exchange.exchange({"w": to_backend(xp, np.arange(50.0))})
    assert exchange.memory == {}


class ResidualMadeOnFirstUpdate(grace.Memory):
    """A memory of a user's: no init of its own (no state until the first update)."""
    needs_feedback = True

    def compensate(self, xp, g, residual):
        return g if residual is None else g + residual

    def update(self, xp, p, p_hat, residual):
        return p - p_hat


@pytest.mark.parametrize("bucket_mb", [0, 25], ids=["per-tensor", "bucketed"])
def test_a_memory_without_an_init_keeps_what_its_update_makes(xp, bucket_mb):
    """A memory is asked for its state where its class has an init or an update of its own (a
    stateless one is not asked per gradient and step): one without an init still gets back what
    its update made, as ResidualMemory does."""
    def run(memory):
        method = grace.topk(0.1)
        compression = grace.GradientCompression(method.compressor, memory, method.collective, bucket_mb=bucket_mb)
        exchange = Exchange(compression, LocalCommunicator())
        rng = np.random.default_rng(0)
        return [xp.to_numpy(exchange.exchange({"w": to_backend(xp, rng.standard_normal((20, 30))),
                                               "b": to_backend(xp, rng.standard_normal(30))})["w"])
                for _ in range(4)]

    for want, got in zip(run(grace.ResidualMemory()), run(ResidualMadeOnFirstUpdate())):
        np.testing.assert_array_equal(want, got)


def test_state_round_trips_exactly(xp):
    rng = np.random.default_rng(1)
    grads = [to_backend(xp, rng.standard_normal(100)) for _ in range(4)]
    straight = Exchange(grace.randomk(0.1), LocalCommunicator())
    outputs = [straight.exchange({"w": g})["w"] for g in grads]
    first = Exchange(grace.randomk(0.1), LocalCommunicator())
    for g in grads[:2]:
        first.exchange({"w": g})
    resumed = Exchange(grace.randomk(0.1), LocalCommunicator())
    resumed.load_state_dict(first.state_dict())
    for g, want in zip(grads[2:], outputs[2:]):
        np.testing.assert_array_equal(xp.to_numpy(resumed.exchange({"w": g})["w"]), xp.to_numpy(want))


def test_powersgd_reuses_two_buffers_for_its_memory(xp):
    """PowerSGD writes each step's compensated gradient, which its new memory holds (the
    approximation's subtraction deferred where tensors are mutable), into the buffer the memory
    before last used (mutable backends): no gradient-sized allocation per step. The result is
    the one of the allocating path: what was sent plus what is remembered is p."""
    exchange = Exchange(grace.powersgd(1), LocalCommunicator())
    rng = np.random.default_rng(0)
    buffers, residual = [], None
    for step in range(4):
        g = to_backend(xp, rng.standard_normal((20, 30)))
        p = xp.to_numpy(g) + (0 if residual is None else residual)
        sent = xp.to_numpy(exchange.exchange({"w": g})["w"])
        memory = exchange.store.tables["memory"]["w"]
        # (deferred where the next step's first pass can subtract it: grace.native's products)
        assert isinstance(memory, Deferred) == bool(xp.native("lowrank_project_many", g, "float32"))
        residual = xp.to_numpy(exchange.memory["w"])
        np.testing.assert_allclose(sent + residual, p, rtol=1e-5, atol=1e-5)
        buffers.append(buffer_of(memory))  # (kept alive: a freed tensor's id could come back)
    if xp.mutable_tensors:  # two buffers in turn
        assert buffers[1] is buffers[3] and buffers[0] is buffers[2] and buffers[1] is not buffers[2]
