"""Worker: Horovod elastic training on TensorFlow (``hvd.elastic.run``, an ``ObjectState``)
with grace, while the world shrinks from 2 ranks to 1 and grows back to 2.

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER --gloo \\
        python tensorflow_elastic.py --out DIR --hosts HOSTS_FILE --grow-host HOST --method none

As the PyTorch worker (torch_elastic.py): rank 1's process exits at step FAIL_AT, a third host
is listed at GROW_AT. The step is one tf.function, traced once per world: grace has it traced
again after each reset, with no reset callback of ours. Every step checks the averaged gradient
against the mean of all current ranks' own gradients (Horovod's plain allgather) and that all
ranks hold one model, and that no gradient mass is lost.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's Keras support needs Keras 2

import json  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

import grace.tensorflow  # noqa: E402
from common import ELASTIC_METHODS, ELASTIC_STEPS, parse_elastic_args, shrink_or_grow  # noqa: E402

ARGS = parse_elastic_args()
METHODS = ELASTIC_METHODS


def local_inputs(step: int, rank: int):
    g = tf.random.Generator.from_seed(100 * step + rank)
    return g.normal((8, 6)), g.normal((8, 3))


class KerasModelState(hvd.elastic.ObjectState):
    """Horovod's TensorFlowKerasState with the weights broadcast as one object: Horovod 0.28.1's
    own (broadcast_variables) hangs in its first sync after a reset on this TensorFlow, with or
    without grace."""

    def __init__(self, model, **kwargs):
        self.model = model
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, weights=model.get_weights(),
                         **kwargs)

    def save(self):
        self.weights = self.model.get_weights()
        super().save()

    def restore(self):
        super().restore()
        self.model.set_weights(self.weights)

    def sync(self):
        self.weights = self.model.get_weights()
        super().sync()
        self.model.set_weights(self.weights)


def main():
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3)])
    model.build((None, 6))
    optimizer = tf.keras.optimizers.legacy.SGD(0.1)
    compression = METHODS[ARGS.method]()

    def loss_of(x, y):
        return tf.reduce_mean(tf.square(model(x) - y))

    traced_for = []  # the world size of each trace (Python in a tf.function runs when it is traced)

    @tf.function
    def train_step(x, y):
        traced_for.append(hvd.size())
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    def held():
        """This rank's memories, flat in the variables' order: error feedback e, the owners' o (of
        the averaged gradient); zeros where the method keeps none."""
        saved = grace.tensorflow.exchange_for(compression).exchange.state_dict()
        return [tf.concat([tf.reshape(saved[table].get(v.name.removesuffix(":0"), tf.zeros_like(v)), (-1,))
                           for v in model.trainable_variables], 0) for table in ("memory", "owner")]

    def total(x, name):
        return hvd.allreduce(x, op=hvd.Sum, name=name)

    state = KerasModelState(model, step=0, failed_once=False, log=[])

    @hvd.elastic.run
    def train(state):
        while state.step < ELASTIC_STEPS:
            step, rank, size = state.step, hvd.rank(), hvd.size()
            shrink_or_grow(state, ARGS, step, rank, size)
            x, y = local_inputs(step, rank)
            with tf.GradientTape() as tape:
                loss = loss_of(x, y)
            own = tape.gradient(loss, model.trainable_variables)
            e_old, o_old = held()
            reduced = train_step(x, y)
            # no mass lost (as in torch_elastic.py): result + sum(e)/N + sum(o) after the step =
            # (sum(g) + sum(e))/N + sum(o) before it, the owners' hand-over in a new world included
            e_new, o_new = held()
            result = tf.concat([tf.reshape(r, (-1,)) for r in reduced], 0)
            g = tf.concat([tf.reshape(t, (-1,)) for t in own], 0)
            after = result + total(e_new, "check.e_new") / size + total(o_new, "check.o_new")
            before = (total(g, "check.g") + total(e_old, "check.e_old")) / size + total(o_old, "check.o_old")
            mass = float(tf.reduce_max(tf.abs(after - before)))
            mean = [tf.reduce_mean(hvd.allgather(g[None], name=f"check.grad.{i}"), 0) for i, g in enumerate(own)]
            error = max(float(tf.reduce_max(tf.abs(r - m))) for r, m in zip(reduced, mean))
            params = tf.concat([tf.reshape(v, (-1,)) for v in model.trainable_variables], 0)
            spread = float(tf.reduce_max(tf.abs(hvd.allgather(params[None], name="check.params") - params)))
            state.log.append({"step": step, "size": size, "error": error, "spread": spread, "mass": mass,
                              "traced_for": traced_for[-1], "traces": len(traced_for)})
            state.step += 1
            if size == 1:
                state.failed_once = True
            state.commit()

    train(state)
    if hvd.rank() == 0:
        ARGS.out.mkdir(parents=True, exist_ok=True)
        steps_state = grace.tensorflow.exchange_for(compression).exchange.state_dict()["steps"]
        (ARGS.out / f"{ARGS.method}.json").write_text(json.dumps(
            {"log": state.log, "steps": {k: int(v) for k, v in steps_state.items()}}))


if __name__ == "__main__":
    main()
