"""Worker: the bytes each rank receives per step, counted at Horovod's own entry points, for some
methods under each communicator (a small model, one bucket).

    horovodrun -np 4 -H localhost:4 --gloo python torch_traffic.py --out DIR
"""
import horovod.torch as hvd
import grace  # noqa: F401
import torch
import argparse
from pathlib import Path

from common import TRAFFIC_METHODS, save_json
from horovod.torch import mpi_ops

COMMUNICATORS = ("allgather", "alltoall", "auto")
RECEIVED = [0]
_LAUNCHED = {}


def counted(name):
    launch = getattr(mpi_ops, name)

    def call(tensor, *args, **kwargs):
        handle = launch(tensor, *args, **kwargs)
        _LAUNCHED[handle] = (name, tensor.numel() * tensor.element_size())
        return handle

    return call


def received_by(handle, output):
    """Bytes that came from other ranks: an allgather's output less this rank's own part, an
    alltoall's less the part it sent itself; a ring allreduce's 2 (N-1)/N of the tensor."""
    name, sent = _LAUNCHED.pop(handle)
    n = hvd.size()
    if name == "alltoall_async":
        out, splits = output
        return (out.numel() - int(splits[hvd.rank()])) * out.element_size()
    if name == "allgather_async":
        return output.numel() * output.element_size() - sent
    return int(2 * (n - 1) / n * sent)


_synchronize = mpi_ops.synchronize


def synchronize(handle):
    output = _synchronize(handle)
    if handle in _LAUNCHED:
        RECEIVED[0] += received_by(handle, output)
    return output


for _name in ("allgather_async", "alltoall_async", "allreduce_async", "grouped_allreduce_async"):
    setattr(mpi_ops, _name, counted(_name))
mpi_ops.synchronize = synchronize


def run(make, communicator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(), compression=make(communicator))
    generator = torch.Generator().manual_seed(hvd.rank())
    received = []
    for _ in range(3):
        x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        optimizer.zero_grad()
        RECEIVED[0] = 0
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        received.append(RECEIVED[0])
    plans = optimizer._grace.bucket_plans()
    return {"received": received, "buckets": [plan.bucket.numel for plan in plans.values()],
            "plans": [plan.name for plan in plans.values()]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", nargs="+", default=list(TRAFFIC_METHODS), choices=list(TRAFFIC_METHODS))
    args = parser.parse_args()
    hvd.init()
    results = {f"{method}/{c}": run(TRAFFIC_METHODS[method], c) for method in args.methods for c in COMMUNICATORS}
    save_json(args.out, hvd.rank(), results)


if __name__ == "__main__":
    main()
