"""Worker: a TensorFlow elastic benchmark written as Horovod's own TF2 elastic benchmark is, the
only grace line being the compression:

    - one ``@tf.function`` step with no arguments, traced once by the script and never rebuilt,
      the compression made inside it (``hvd.DistributedGradientTape(tape, compression=...)``);
    - Horovod's ``TensorFlowKerasState`` for model and optimizer, a reset callback that only
      rescales the learning rate, a commit after every batch;
    - the world shrinks from outside: the launcher's host-discovery script stops listing a host,
      and Horovod ends that host's worker.

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER \\
        python tensorflow_elastic_benchmark.py --compression "grace.topk(0.01)" --out DIR

Rank 0 prints ``iteration I on N ranks`` as it goes (the test removes a host on that cue); the
run stops after a few iterations on one rank. Rank 0 writes DIR/result.json: the world of each
iteration, the world each trace of the step was made for, and the exchange's step counter.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's Keras support needs Keras 2

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

import grace  # noqa: E402,F401  (the --compression expression names it)
import grace.tensorflow  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--compression", required=True, help="a grace method, e.g. grace.topk(0.01)")
parser.add_argument("--iterations", type=int, default=300, help="at most")
parser.add_argument("--stop-after", type=int, default=4, help="iterations on one rank, once the world has shrunk")
parser.add_argument("--batches-per-iteration", type=int, default=2)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(hvd.rank())
model = tf.keras.Sequential([tf.keras.layers.Conv2D(8, 3, activation="relu"), tf.keras.layers.BatchNormalization(),
                             tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])
base_lr = 0.01
opt = tf.keras.optimizers.SGD(base_lr * hvd.size())
images = tf.random.uniform([8, 16, 16, 3])
labels = tf.random.uniform([8], maxval=10, dtype=tf.int64)
traced_for = []  # the world size each trace was made for (Python in a tf.function runs when traced)
compressions = []


@tf.function
def train_one_batch():
    compression = eval(args.compression)  # the one grace line
    compressions.append(compression)
    traced_for.append(hvd.size())
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


train_one_batch()  # the variables exist before the first sync


@hvd.elastic.run
def run(state):
    # (runs until it has run a few iterations on one rank: the host goes when the launcher notices)
    while state.iteration < args.iterations and state.sizes[-args.stop_after:] != [1] * args.stop_after:
        for _ in range(args.batches_per_iteration):
            state.loss = float(train_one_batch())
            state.batches += 1
            state.commit()
        state.sizes.append(hvd.size())
        state.traced_for.append(traced_for[-1])
        if hvd.rank() == 0:
            print(f"iteration {state.iteration} on {hvd.size()} ranks, loss {state.loss:.4f}", flush=True)
        state.iteration += 1
        state.commit()


def on_state_reset():
    opt.learning_rate.assign(base_lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(model, opt, iteration=0, batches=0, loss=0.0, sizes=[], traced_for=[])
state.register_reset_callbacks([on_state_reset])
run(state)

if hvd.rank() == 0:
    steps = grace.tensorflow.exchange_for(compressions[-1]).exchange.steps
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps({
        "sizes": state.sizes, "traced_for": state.traced_for, "batches": state.batches, "loss": state.loss,
        "steps": sorted({int(v) for v in steps.values()}), "traces": len(traced_for)}))
