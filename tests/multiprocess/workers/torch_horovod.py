"""Worker: grace through the stock ``hvd.DistributedOptimizer`` on PyTorch.

    horovodrun -np 3 -H localhost:3 --gloo python torch_horovod.py --out DIR
    mpirun -np 2 python torch_horovod.py --out DIR
"""
import io

import horovod.torch as hvd  # the user's two lines, in this order here ...
import grace  # noqa: F401   (... and in the other order in the training test)
import torch
from common import (ALLTOALL_VARIANTS, PARAMS, STEPS, VARIANTS, gradient, names, parse_args, plans_for, save,
                    state_arrays)
from horovod.torch import mpi_ops

CALLS = [0]  # collectives launched, counted at Horovod's own entry points


def counted(collective):
    def call(*args, **kwargs):
        CALLS[0] += 1
        return collective(*args, **kwargs)

    return call


for _name in ("allreduce_async", "grouped_allreduce_async", "allreduce_async_", "grouped_allreduce_async_",
              "allgather_async", "broadcast_async", "alltoall_async"):
    setattr(mpi_ops, _name, counted(getattr(mpi_ops, _name)))


def build(variant, values, state=None):
    params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
    optimizer = torch.optim.SGD(params, lr=0.0)
    kwargs = dict(compression=variant.make(), backward_passes_per_step=variant.passes,
                  op=hvd.Sum if variant.op == "sum" else hvd.Average)
    if variant.named:
        kwargs["named_parameters"] = list(zip(names(variant), params))
    optimizer = hvd.DistributedOptimizer(optimizer, **kwargs)
    if state is not None:
        optimizer.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
    return params, optimizer


def run(label, variant):
    keys = names(variant)
    params, optimizer = build(variant, [torch.zeros(shape).numpy() for _, shape, _ in PARAMS])
    results = {}
    for step in range(STEPS):
        optimizer.zero_grad()
        calls = CALLS[0]
        for b in range(variant.passes):
            loss = sum((p * torch.from_numpy(gradient(hvd.rank(), step, i, b))).sum()
                       for i, p in enumerate(params))
            loss.backward()
        optimizer.synchronize()
        results[f"calls/{step}"] = CALLS[0] - calls
        for name, p in zip(keys, params):
            results[f"grad/{name}/{step}"] = p.grad.numpy().copy()
        results[f"bytes/{step}"] = optimizer.grace_stats.last_step_bytes
        with optimizer.skip_synchronize():
            optimizer.step()
        if step == variant.checkpoint_after:  # through bytes, into a brand-new optimizer
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            params, optimizer = build(variant, [p.detach().numpy() for p in params], buffer.getvalue())
    results.update(state_arrays(optimizer.state_dict()["grace"], lambda t: t.numpy()))
    return results


def main():
    args = parse_args()
    hvd.init()
    for label in args.variants:
        variant = {**VARIANTS, **ALLTOALL_VARIANTS}[label]
        with plans_for(variant):
            save(args.out, label, hvd.rank(), run(label, variant))


if __name__ == "__main__":
    main()
