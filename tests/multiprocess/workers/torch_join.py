"""Worker: ``hvd.join()`` with grace: rank 1 stops after one step, rank 0 goes on for three.

    horovodrun -np 2 -H localhost:2 --gloo python torch_join.py --out DIR

For an allreduce method the result must equal Horovod's own optimizer's under the same join;
an allgather method must be refused with a clear error on the rank that joins. Over two
epochs, the first uneven (and one in which a rank joins before its first step), the replicas
must still agree at the end of the second: the ranks' draws (random-k's indices, PowerSGD's Q)
agree again after the join.
"""
import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import grace
import torch


def train(compression):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    kwargs = {} if compression is None else {"compression": compression}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kwargs)
    g = torch.Generator().manual_seed(hvd.rank())
    try:
        for _ in range(3 if hvd.rank() == 0 else 1):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            opt.step()
        hvd.join()
    except RuntimeError as error:  # (rank 0 sees Horovod shut down once rank 1 has stopped)
        return str(error)
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def two_epochs(compression, first_epoch_steps):
    """Epoch 1: ``first_epoch_steps[rank]`` steps, join, parameters broadcast; epoch 2: two steps
    on every rank, join. This rank's parameters and step counters at the end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for epoch, steps in enumerate([first_epoch_steps[hvd.rank()], 2]):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
        hvd.join()
        if epoch == 0:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return {"parameters": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "steps": {name: int(step) for name, step in opt._grace.steps.items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    hvd.init()
    results = {"horovod": train(None), "none": train(grace.none()),
               "randomk": train(grace.randomk(1.0, memory="none"))}
    for label, compression in [("randomk", grace.randomk(0.25)), ("powersgd", grace.powersgd(1))]:
        results[f"{label} uneven"] = two_epochs(compression, [3, 1])
        results[f"{label} joined before its first step"] = two_epochs(compression, [2, 0])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(results))
    results["topk"] = train(grace.topk(0.5))  # last: it ends the job
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
