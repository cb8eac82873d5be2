"""grace.tensorflow.retrace: the tf.functions being traced when grace is traced are traced again
after an elastic reset into another world, and only then (plain TensorFlow, no Horovod)."""
from __future__ import annotations

import gc

import pytest

tf = pytest.importorskip("tensorflow")
from grace.tensorflow import retrace  # noqa: E402


def traced_in(world, traces):
    """A tf.function that, when traced, records ``world[0]`` as grace's exchange does."""
    @tf.function
    def step(x):
        traces.append(world[0])
        retrace.record(world[0])
        return x + 1
    return step


def test_a_step_is_traced_again_only_after_a_reset_into_another_world():
    world, traces = [(0, 2)], []
    step = traced_in(world, traces)
    for _ in range(3):
        step(tf.constant(1.0))
    assert traces == [(0, 2)]
    assert retrace.follow((0, 2)) == 0  # a reset into the same world
    step(tf.constant(1.0))
    assert traces == [(0, 2)]
    world[0] = (0, 1)
    assert retrace.follow((0, 1)) == 1
    assert float(step(tf.constant(1.0))) == 2.0
    step(tf.constant(1.0))
    assert traces == [(0, 2), (0, 1)]


def test_nested_functions_are_all_traced_again():
    world, inner_traces, outer_traces = [(1, 2)], [], []
    inner = traced_in(world, inner_traces)

    @tf.function
    def outer(x):
        outer_traces.append(world[0])
        return inner(x) * 2

    outer(tf.constant(1.0))
    world[0] = (0, 1)  # (rank 0 left: this process is rank 0 of 1 now)
    assert retrace.follow(world[0]) == 2
    outer(tf.constant(1.0))
    assert outer_traces == [(1, 2), (0, 1)] and inner_traces == [(1, 2), (0, 1)]


def test_a_function_gone_is_forgotten():
    step = traced_in([(0, 4)], [])
    step(tf.constant(1.0))
    del step
    gc.collect()
    assert retrace.follow((0, 3)) == 0


def test_an_eager_call_records_nothing():
    assert retrace.record((0, 2)) == 0
