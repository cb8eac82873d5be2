"""The phase clock benchmarks hand to an Exchange: phases nest exclusively, every phase of the
path training runs is seen, and timing changes no result."""
from __future__ import annotations

import time

import numpy as np
import pytest

import grace
from grace.core.communicator import ReplicaCommunicator
from grace.core.phases import PHASES, PhaseClock


def test_nested_phases_count_exclusively():
    clock = PhaseClock()
    with clock.phase("compress"):
        time.sleep(0.02)
        with clock.phase("collective"):
            time.sleep(0.05)
        time.sleep(0.02)
    seconds = clock.reset()
    assert 0.05 <= seconds["collective"] < 0.09
    assert 0.04 <= seconds["compress"] < 0.08  # without the nested collective
    assert clock.reset() == dict.fromkeys(PHASES, 0.0)


def test_a_phase_can_be_renamed_while_it_runs():
    clock = PhaseClock()
    with clock.phase("compress") as mark:
        time.sleep(0.01)
        mark[0] = "decompress"
    seconds = clock.reset()
    assert seconds["compress"] == 0 and seconds["decompress"] >= 0.01


def _grads():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}


@pytest.mark.parametrize("make, feedback", [(lambda: grace.topk(0.1), True), (lambda: grace.qsgd(16), False),
                                            (lambda: grace.powersgd(1), True),
                                            (lambda: grace.topk(0.1, bucket_mb=0), True),
                                            (lambda: grace.powersgd(1, bucket_mb=0), True)])
def test_an_exchange_reports_every_phase_and_the_same_result(make, feedback):
    timed, plain = grace.Exchange(make(), ReplicaCommunicator(4)), grace.Exchange(make(), ReplicaCommunicator(4))
    timed.phases = clock = PhaseClock()
    for _ in range(3):
        clock.reset()
        t0 = time.perf_counter()
        out = timed.exchange(_grads())
        wall = time.perf_counter() - t0
        expected = plain.exchange(_grads())
        seconds = clock.reset()
        for name in expected:
            np.testing.assert_array_equal(out[name], expected[name])
        assert seconds["compress"] > 0 and seconds["collective"] > 0 and seconds["decompress"] > 0, seconds
        assert (seconds["feedback"] > 0) == feedback, seconds
        assert sum(seconds.values()) <= wall
