"""Worker: grace averages over the optimizer's process set, not over the whole job.

    horovodrun -np 3 -H localhost:3 --gloo python torch_process_set.py --out DIR

Ranks 0 and 1 form a process set and exchange top-k payloads in it; rank 2 stays out.
"""
import horovod.torch as hvd
import grace
import torch
from common import PARAMS, STEPS, VARIANTS, local_input, names, parse_args, save, state_arrays

MEMBERS = [0, 1]


def main():
    args = parse_args()
    pair = hvd.ProcessSet(MEMBERS)
    hvd.init(process_sets=[pair])
    hvd.barrier()  # every rank has registered the process set
    if hvd.rank() in MEMBERS:
        run(args, pair)
    hvd.barrier()  # rank 2 stays up: Horovod stops everywhere once any rank shuts down


def run(args, pair):
    variant = VARIANTS["topk"]
    params = [torch.nn.Parameter(torch.zeros(shape)) for _, shape, _ in PARAMS]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), compression=variant.make(),
                                         named_parameters=list(zip(names(variant), params)),
                                         process_set=pair)
    results = {}
    for step in range(STEPS):
        optimizer.zero_grad()
        sum((p * torch.from_numpy(local_input(variant, hvd.rank(), step, i))).sum()
            for i, p in enumerate(params)).backward()
        optimizer.step()
        for name, p in zip(names(variant), params):
            results[f"grad/{name}/{step}"] = p.grad.numpy().copy()
        results[f"bytes/{step}"] = optimizer.grace_stats.last_step_bytes
    results.update(state_arrays(optimizer.state_dict()["grace"], lambda t: t.numpy()))
    save(args.out, "topk_process_set", pair.rank(), results)


if __name__ == "__main__":
    main()
