"""Worker: Horovod's mixed-precision recipe with a loss scaler, and an overflow on one rank.

    horovodrun -np 2 -H localhost:2 --gloo python torch_amp.py --out DIR --variants topk ...

Per variant, two runs of a small model from the same start:
- "faulty": at step OVERFLOW_STEP the last rank's gradient of one weight gets an inf;
- "skipped": that step's batch is left out, and the scale is halved there by hand.
Horovod's recipe: synchronize, unscale, step under skip_synchronize, update.
"""
import io

import horovod.torch as hvd
import grace  # noqa: F401
import numpy as np
import torch
from common import VARIANTS, parse_args, plans_for, save, state_arrays

STEPS, OVERFLOW_STEP, SCALE = 6, 2, 1024.0


def batch(rank: int, step: int):
    rng = np.random.default_rng([rank, step])
    return torch.from_numpy(rng.standard_normal((16, 10), dtype=np.float32)), \
        torch.from_numpy(rng.standard_normal((16, 4), dtype=np.float32))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def grace_state(optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict()["grace"], buffer)
    return buffer.getvalue()


def train(variant, faulty: bool) -> dict:
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=net.named_parameters(), compression=variant.make())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10_000)
    weight = net[0].weight
    results, states = {}, {}
    for step in range(STEPS):
        if step == OVERFLOW_STEP and not faulty:  # as if this step had never been
            scaler.update(SCALE / 2)
            continue
        hook = None
        if faulty and step == OVERFLOW_STEP and hvd.rank() == hvd.size() - 1:
            hook = weight.register_hook(lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])),
                                                              torch.tensor(float("inf"))))
        x, y = batch(hvd.rank(), step)
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        results[f"finite/{step}"] = np.asarray([bool(torch.isfinite(p.grad).all()) for p in net.parameters()])
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        results[f"scale/{step}"] = np.asarray(scaler.get_scale())
        if hook is not None:
            hook.remove()
        states[step] = optimizer.state_dict()["grace"]
    results.update({f"param/{name}": p.detach().numpy().copy() for name, p in net.named_parameters()})
    for step in (OVERFLOW_STEP - 1, OVERFLOW_STEP):
        if step in states:
            results.update({f"step{step}/{k}": v for k, v in
                            state_arrays(states[step], lambda t: t.numpy().copy()).items()})
            results.update({f"step{step}/steps/{name}": np.asarray(int(v)) for name, v in states[step]["steps"].items()})
    return results


def main():
    args = parse_args()
    hvd.init()
    for label in args.variants:
        for run in ("faulty", "skipped"):
            with plans_for(VARIANTS[label]):
                save(args.out, f"{label}.{run}", hvd.rank(), train(VARIANTS[label], run == "faulty"))


if __name__ == "__main__":
    main()
