"""Worker: ranks that would silently disagree, through the stock Horovod TensorFlow API.

    horovodrun -np 2 -H localhost:2 --gloo python tensorflow_agreement.py --out DIR

Horovod's TensorFlow recipe resumes from a checkpoint that rank 0 alone restores, and
broadcasts the variables at the end of the first batch (``hvd.broadcast_variables`` inside the
traced step, ``first_batch=True``). Each scenario saves what every rank saw.
"""
import os
import pickle

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import grace  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import parse_out, save_json  # noqa: E402

SHAPES = {"w1": (8, 16), "b1": (16,), "w2": (16, 3)}


def model():
    rng = np.random.default_rng(0)
    return [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.3, name=name)
            for name, shape in SHAPES.items()]


def make_step(params, compression):
    @tf.function
    def step(x, y, first_batch):
        with tf.GradientTape() as tape:
            hidden = tf.tanh(x @ params[0] + params[1])
            loss = tf.reduce_mean((hidden @ params[2] - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for p, g in zip(params, tape.gradient(loss, params)):
            p.assign_sub(0.1 * g)
        if first_batch:  # Horovod's recipe: rank 0's variables, once the first step ran
            hvd.broadcast_variables(params, root_rank=0)
        return loss

    return step


def train(step, steps: int, first: int = 0):
    for s in range(first, first + steps):
        rng = np.random.default_rng(1000 * hvd.rank() + s)
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = rng.standard_normal((16, 3)).astype(np.float32)
        step(tf.constant(x), tf.constant(y), s == first)


def first_step_error(compression) -> str:
    try:
        train(make_step(model(), compression), 1)
    except Exception as error:  # noqa: BLE001  (what the user sees, whatever its type)
        return str(error)
    return ""


def resume(make, restoring_rank: int = 0) -> dict:
    """Only ``restoring_rank`` restores rank 0's checkpoint (Horovod's recipe: rank 0)."""
    params, compression = model(), make()
    train(make_step(params, compression), 3)
    saved = {"weights": [p.numpy() for p in params],
             "grace": grace.tensorflow.exchange_for(compression).exchange.state_dict()}
    saved = pickle.loads(hvd.broadcast_object(pickle.dumps(saved), 0, name="checkpoint"))  # rank 0's file
    params, compression = model(), make()  # a new process would start like this
    if hvd.rank() == restoring_rank:
        for p, w in zip(params, saved["weights"]):
            p.assign(w)
        grace.tensorflow.exchange_for(compression).exchange.load_state_dict(saved["grace"])
    try:
        train(make_step(params, compression), 3, first=3)
    except Exception as error:  # noqa: BLE001
        return {"error": str(error)}
    state = grace.tensorflow.exchange_for(compression).exchange.state_dict()
    return {"error": "", "steps": {name: int(v) for name, v in state["steps"].items()},
            "memory": sorted(state["memory"]), "params": [p.numpy().ravel().tolist() for p in params]}


def main():
    out = parse_out()
    hvd.init()
    rank = hvd.rank()
    results = {
        "ratio": first_step_error(grace.topk(0.1 if rank == 0 else 0.2)),
        "seed": first_step_error(grace.randomk(0.25, seed=rank)),
        "same": first_step_error(grace.topk(0.1)),
        "resume_randomk": resume(lambda: grace.randomk(0.25)),
        "resume_randomk_per_tensor": resume(lambda: grace.randomk(0.25, bucket_mb=0)),
        "resume_powersgd": resume(lambda: grace.powersgd(1)),
        # rank 0 has no step counters to hand over: still an error
        "resume_on_rank_1_only": resume(lambda: grace.randomk(0.25), restoring_rank=1),
    }
    save_json(out, rank, results)


if __name__ == "__main__":
    main()
