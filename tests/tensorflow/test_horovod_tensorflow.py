"""grace through Horovod's TensorFlow API in fresh single-rank processes (real Horovod, size 1):
the tape and Keras's optimizer, eager and inside tf.function, construction errors, state."""
from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_snippet

pytest.importorskip("horovod.tensorflow")

PRELUDE = """
import os, sys
import numpy as np
import tensorflow as tf
"""


def run(code: str, legacy_keras: bool = True) -> str:
    return run_snippet(PRELUDE, code, {"TF_CPP_MIN_LOG_LEVEL": "3", **({"TF_USE_LEGACY_KERAS": "1"} if legacy_keras else {})})


@pytest.mark.parametrize("first", ["grace", "horovod"])
def test_tape_compresses_in_either_import_order_eager_and_traced(first):
    imports = "import grace\nimport horovod.tensorflow as hvd" if first == "grace" else \
        "import horovod.tensorflow as hvd\nimport grace"
    out = run(imports + textwrap.dedent("""
    hvd.init()
    compression = grace.topk(0.1)
    w = tf.Variable(tf.zeros(50), name="w")
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [w])[0]
    x = tf.constant(np.arange(50, dtype=np.float32))
    eager = step(x).numpy()
    traced = [tf.function(step)(x).numpy() for _ in range(3)][-1]
    exchange = grace.tensorflow.exchange_for(compression)
    print(int(np.count_nonzero(eager)), int(np.count_nonzero(traced)), exchange.stats.steps,
          exchange.stats.last_step_bytes, int(exchange.exchange.steps["w"].numpy()),
          float(np.abs(exchange.exchange.memory["w"].numpy()).sum()))
    print("torch" in sys.modules or "horovod.torch" in sys.modules)
    """))
    first_line, leaked = out.strip().splitlines()
    nonzero_eager, nonzero_traced, steps, sent, counter, memory = first_line.split()
    # 5 of 50 values sent each step, 5 values + 5 one-byte indices in a frame padded to 8
    # bytes; the step counter and the memory live in variables that the traced step updates
    assert (nonzero_eager, nonzero_traced, steps, sent, counter) == ("5", "5", "4", "32", "4")
    assert float(memory) > 0 and leaked == "False"


def test_keras_fit_with_a_grace_method_keeps_state_in_variables():
    out = run("""
    import grace
    import horovod.tensorflow.keras as hvd
    hvd.init()
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=grace.dgc(0.25))
    model.compile(opt, "mse")
    x, y = np.random.default_rng(0).standard_normal((64, 8)), np.zeros((64, 4))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    exchange = opt.grace.exchange
    print(opt.grace.stats.steps, sorted(exchange.memory), int(exchange.steps["dense/kernel"].numpy()))
    """)
    steps, *rest = out.split(maxsplit=1)
    assert steps == "8"
    assert "'dense/bias', 'dense/kernel']" in rest[0] and rest[0].strip().endswith("8")


def test_what_cannot_work_is_refused_at_construction():
    out = run("""
    import grace
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    hvd.init()
    tape = tf.GradientTape()
    for kwargs in [dict(op=hvd.Adasum), dict(groups=2), dict(op=hvd.Min)]:
        try:
            hvd.DistributedGradientTape(tape, compression=grace.topk(0.1), **kwargs)
            print("accepted", kwargs)
        except ValueError as e:
            print("refused:", str(e)[:40])
    try:
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=grace.topk(0.1),
                                       backward_passes_per_step=2)
    except ValueError as e:
        print("refused:", str(e)[:40])
    print(type(hvd.DistributedGradientTape(tape)).__name__)  # Horovod's own path is untouched
    """)
    assert out.count("refused:") == 4 and "accepted" not in out
    assert out.strip().endswith("GradientTape")


def test_keras_3_gets_a_clear_error_at_construction():
    out = run("""
    import grace
    import horovod.tensorflow.keras as hvd
    hvd.init()
    try:
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=grace.topk(0.1))
        print("accepted")
    except RuntimeError as e:
        print(e)
    """, legacy_keras=False)
    assert "TF_USE_LEGACY_KERAS=1" in out and "Keras 3" in out


def test_keras_3_variables_get_a_clear_error_on_the_tape():
    """Horovod's tape reads Variable.ref(), which Keras 3 variables lack: grace says what to do
    at the gradient, eager and traced, instead of Horovod's AttributeError."""
    out = run("""
    import keras
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    x = tf.ones((2, 4))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        tape = hvd.DistributedGradientTape(tape, compression=grace.topk(0.5))
        return tape.gradient(loss, layer.trainable_variables)

    for run in (step, tf.function(step)):
        try:
            run()
            print("accepted")
        except RuntimeError as e:
            print("refused:", "TF_USE_LEGACY_KERAS=1" in str(e), "keras" in str(e))
    """, legacy_keras=False)
    assert out.split() == ["refused:", "True", "True"] * 2, out


def test_elastic_run_lets_an_error_of_the_users_own_through():
    """Horovod's TensorFlow elastic.run ends the training function silently on an UnknownError
    that names no allreduce, allgather or broadcast (a failed alltoall among them: that one
    resets, see tests/multiprocess/test_elastic.py); with grace imported the error is raised."""
    out = run("""
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    state = hvd.elastic.ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, step=0)

    @hvd.elastic.run
    def train(state):
        raise tf.errors.UnknownError(None, None, "a failure of the user's own")

    try:
        print("returned", train(state))
    except tf.errors.UnknownError as e:
        print("raised:", e.message)
    """)
    assert "raised: a failure of the user's own" in out, out


def test_exchange_state_round_trips_through_a_checkpoint():
    out = run("""
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    def steps(compression, xs):
        w = tf.Variable(tf.zeros((6, 5)), name="w")  # a new model each time
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * x)
            return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [w])[0]
        return [step(x).numpy() for x in xs]
    xs = [tf.constant(np.random.default_rng(i).standard_normal((6, 5)), tf.float32) for i in range(4)]
    straight = steps(grace.powersgd(1), xs)
    first = grace.powersgd(1)
    steps(first, xs[:2])
    saved = grace.tensorflow.exchange_for(first).exchange.state_dict()
    resumed = grace.powersgd(1)
    grace.tensorflow.exchange_for(resumed).exchange.load_state_dict(saved)
    print(float(np.abs(np.stack(steps(resumed, xs[2:])) - np.stack(straight[2:])).max()))
    """)
    assert float(out) < 1e-6


@pytest.mark.parametrize("bucket_mb", [25, 0])
def test_two_variables_of_one_name_are_refused_not_mixed(bucket_mb):
    out = run(f"""
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    a, b = tf.Variable(tf.ones(4)), tf.Variable(tf.ones(4))  # both named 'Variable'
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * 2.0) + tf.reduce_sum(b * 3.0)
    tape = hvd.DistributedGradientTape(tape, compression=grace.topk(0.5, bucket_mb={bucket_mb}))
    try:
        tape.gradient(loss, [a, b])
    except ValueError as error:
        print(error)
    """)
    assert "two variables are named 'Variable'" in out


@pytest.mark.parametrize("bucket_mb", [25, 0])
def test_a_compression_built_inside_the_traced_step_keeps_one_state(bucket_mb):
    """Horovod's tensorflow2 examples build the tape's compression inside the tf.function step,
    which is traced again for first_batch=False: the second trace must continue the first's
    state (not fail creating variables, nor start from empty memory)."""
    out = run(f"""
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    xs = [tf.constant(np.random.default_rng(i).standard_normal(40), tf.float32) for i in range(6)]
    def train(inside):
        w = tf.Variable(tf.zeros(40), name="w")
        outside = grace.topk(0.1, bucket_mb={bucket_mb})
        @tf.function
        def step(x, first_batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * x)
            compression = grace.topk(0.1, bucket_mb={bucket_mb}) if inside else outside
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            grad = tape.gradient(loss, [w])[0]
            if first_batch:
                hvd.broadcast_variables([w], root_rank=0)
            return grad
        return np.stack([step(x, i == 0).numpy() for i, x in enumerate(xs)])
    inside, outside = train(True), train(False)
    print(int(np.count_nonzero(inside[1:] != inside[1])), float(np.abs(inside - outside).max()))
    """)
    changing, difference = out.split()
    assert int(changing) > 0  # memory carries over: the selection moves from step to step
    assert float(difference) == 0.0


def test_keras_fit_with_horovods_callbacks():
    """Horovod's Keras callbacks, as its keras examples use them (setup_env.sh fixes their Keras
    backend binding: tf_keras, not Keras 3), with a grace optimizer."""
    out = run("""
    import grace
    import horovod.tensorflow.keras as hvd
    hvd.init()
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), compression=grace.topk(0.25))
    model.compile(opt, "mse")
    x, y = np.random.default_rng(0).standard_normal((64, 8)), np.zeros((64, 4))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, verbose=0)]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    print(opt.grace.stats.steps, float(tf.keras.backend.get_value(model.optimizer.lr)), history.history["loss"][-1] < history.history["loss"][0])
    """)
    steps, lr, improved = out.split()
    assert (int(steps), float(lr), improved) == (12, pytest.approx(0.1), "True")


@pytest.mark.parametrize("bucket_mb", [25, 0])
def test_models_with_the_same_names_never_share_state(bucket_mb):
    """One compression object used by two tapes over two models whose variables have the same
    names (and by a new model built later) must give each model its own memory: the weights
    equal those of a run with one compression per model."""
    out = run(f"""
    import grace
    import horovod.tensorflow as hvd
    hvd.init()
    xs = [tf.constant(np.random.default_rng(i).standard_normal(40), tf.float32) for i in range(5)]
    def model():
        return tf.Variable(tf.ones(40), name="w")
    def train(models, compressions, traced):
        def step(w, x, compression):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w * x)
            grad = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [w])[0]
            w.assign_sub(0.1 * grad)
        for x in xs:
            for w, compression in zip(models, compressions):
                (tf.function(step) if traced else step)(w, x, compression)
        return np.stack([w.numpy() for w in models])
    for traced in (False, True):
        shared = grace.topk(0.1, bucket_mb={bucket_mb})
        together = train([model(), model()], [shared, shared], traced)
        apart = train([model(), model()], [grace.topk(0.1, bucket_mb={bucket_mb}) for _ in range(2)], traced)
        later = train([model()], [shared], traced)  # a new model, the same names and compression
        fresh = train([model()], [grace.topk(0.1, bucket_mb={bucket_mb})], traced)
        print(float(np.abs(together - apart).max()), float(np.abs(later - fresh).max()))
    """)
    for line in out.strip().splitlines():
        assert [float(v) for v in line.split()] == [0.0, 0.0]
