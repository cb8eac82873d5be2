"""Worker: grace through the stock ``hvd.DistributedGradientTape`` on TensorFlow, inside
tf.function (eagerly for variants that ask for it).

    horovodrun -np 3 -H localhost:3 --gloo python tensorflow_horovod.py --out DIR

This process never imports torch or horovod.torch (a test checks it).
"""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import grace  # noqa: E402  (the user's two lines, in this order here)
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import (ALLTOALL_VARIANTS, PARAMS, STEPS, VARIANTS, local_input, names, parse_args, save,  # noqa: E402
                    state_arrays)


def run(label, variant):
    keys = names(variant)
    params = [tf.Variable(tf.zeros(shape), name=name) for name, (_, shape, _) in zip(keys, PARAMS)]
    op = hvd.Sum if variant.op == "sum" else hvd.Average

    def make_step(compression):
        def step(inputs):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(p * g) for p, g in zip(params, inputs)])
            tape = hvd.DistributedGradientTape(tape, compression=compression, op=op)
            return tape.gradient(loss, params)

        return step if variant.eager else tf.function(step)

    compression = variant.make()
    step = make_step(compression)
    results = {}
    for s in range(STEPS):
        inputs = [tf.constant(local_input(variant, hvd.rank(), s, i)) for i in range(len(PARAMS))]
        for name, g in zip(keys, step(inputs)):
            results[f"grad/{name}/{s}"] = g.numpy()
        results[f"bytes/{s}"] = grace.tensorflow.exchange_for(compression, op).stats.last_step_bytes
        if s == variant.checkpoint_after:  # a brand-new compression restored from the saved state
            state = grace.tensorflow.exchange_for(compression, op).exchange.state_dict()
            compression = variant.make()
            grace.tensorflow.exchange_for(compression, op).exchange.load_state_dict(state)
            step = make_step(compression)  # a traced step keeps the compression it was traced with
    results.update(state_arrays(grace.tensorflow.exchange_for(compression, op).exchange.state_dict(),
                                lambda a: a))
    return results


def horovod_own_averaging():
    """Horovod's own tape (no grace compression) in the same process: plain averaging."""
    w = tf.Variable(tf.zeros(4), name="plain")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(hvd.rank() + 1))
    grad = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]
    return {"grad": grad.numpy()}


def main():
    args = parse_args()
    hvd.init()
    save(args.out, "horovod_own", hvd.rank(), horovod_own_averaging())
    for label in args.variants:
        save(args.out, label, hvd.rank(), run(label, {**VARIANTS, **ALLTOALL_VARIANTS}[label]))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("horovod.torch"))
    assert not leaked, f"a TensorFlow process imported {leaked}"


if __name__ == "__main__":
    main()
