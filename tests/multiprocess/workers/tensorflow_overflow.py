"""Worker: an inf in one rank's gradient, through ``hvd.DistributedGradientTape`` in tf.function.

    horovodrun -np 2 -H localhost:2 --gloo python tensorflow_overflow.py --out DIR --variants topk ...

Per variant, two runs: "faulty" (the last rank's first gradient holds an inf at step
OVERFLOW_STEP) and "skipped" (that step left out). Both use one traced step each.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import grace  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import PARAMS, VARIANTS, local_input, names, parse_args, save, state_arrays  # noqa: E402

STEPS, OVERFLOW_STEP = 4, 1


def run(variant, faulty: bool) -> dict:
    keys = names(variant)
    params = [tf.Variable(tf.zeros(shape), name=name) for name, (_, shape, _) in zip(keys, PARAMS)]
    compression = variant.make()

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(p * g) for p, g in zip(params, inputs)])
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, params)

    results = {}
    for s in range(STEPS):
        if s == OVERFLOW_STEP and not faulty:
            continue
        inputs = [local_input(variant, hvd.rank(), s, i) for i in range(len(PARAMS))]
        if s == OVERFLOW_STEP and hvd.rank() == hvd.size() - 1:
            inputs[0] = inputs[0].copy()
            inputs[0].flat[3] = np.inf
        grads = step([tf.constant(x) for x in inputs])
        results[f"finite/{s}"] = np.asarray([bool(np.isfinite(g.numpy()).all()) for g in grads])
        for name, g in zip(keys, grads):
            results[f"grad/{name}/{s}"] = g.numpy()
        state = grace.tensorflow.exchange_for(compression).exchange.state_dict()
        results.update({f"state{s}/{k}": v for k, v in state_arrays(state, lambda a: a).items()})
        results.update({f"state{s}/steps/{k}": np.asarray(v) for k, v in state["steps"].items()})
    return results


def main():
    args = parse_args()
    hvd.init()
    for label in args.variants:
        for kind in ("faulty", "skipped"):
            save(args.out, f"{label}.{kind}", hvd.rank(), run(VARIANTS[label], kind == "faulty"))


if __name__ == "__main__":
    main()
