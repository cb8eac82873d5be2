"""Training steps through the stock ``hvd.DistributedOptimizer``: Horovod alone against grace.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/bench_horovod_step.py [--model mlp48]
        [--methods none topk] [--steps 20] [--bucket-mb 25]

Each rank trains the model of ``bench_step.py`` on synthetic data. Per configuration (Horovod's
own uncompressed and fp16 allreduce, then each grace method in buckets and per tensor) it
prints the median step time (forward, backward, exchange, SGD update) after three warm-up
steps, how that compares with Horovod's uncompressed step, and the Horovod collectives per
step, counted at Horovod's entry points (grace's async ops and Horovod's own allreduce).
"""
from __future__ import annotations

import statistics
import time

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops, optimizer as horovod_optimizer

import grace

from grace.bench.bench_step import METHODS, build
from grace.bench.common import help_parser

CALLS = [0]


def counted(collective):
    def call(*args, **kwargs):
        CALLS[0] += 1
        return collective(*args, **kwargs)

    return call


for _module, _names in ((mpi_ops, ("allreduce_async", "grouped_allreduce_async", "allreduce_async_",
                                   "grouped_allreduce_async_", "allgather_async", "broadcast_async")),
                        (horovod_optimizer, ("allreduce_async_", "grouped_allreduce_async_"))):
    for _name in _names:
        setattr(_module, _name, counted(getattr(_module, _name)))


def run(model: str, compression, steps: int):
    """(median step seconds, collectives per step)."""
    torch.manual_seed(0)
    net, x, y, loss = build(model, "cpu")
    torch.manual_seed(1 + hvd.rank())  # each rank its own batch
    x = torch.randn_like(x) if x.is_floating_point() else x
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3),
                                   named_parameters=net.named_parameters(), compression=compression)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    times, calls = [], []
    for i in range(3 + steps):
        hvd.barrier()
        start, before = time.perf_counter(), CALLS[0]
        opt.zero_grad()
        loss(net(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
            calls.append(CALLS[0] - before)
    return statistics.median(times), max(calls)


def main():
    parser = help_parser(__doc__)
    parser.add_argument("--model", default="mlp48", help="the model trained (bench_step's)")
    parser.add_argument("--methods", nargs="+", default=["none", "topk"], choices=sorted(METHODS),
                        help="the methods timed")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="grace's bucket cap, in MB")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    configs = [("horovod none", hvd.Compression.none), ("horovod fp16", hvd.Compression.fp16)]
    for method in args.methods:
        configs.append((f"grace {method} bucketed", grace.create(method, **METHODS[method], bucket_mb=args.bucket_mb)))
        configs.append((f"grace {method} per tensor", grace.create(method, **METHODS[method], bucket_mb=0)))
    results = [(label, *run(args.model, compression, args.steps)) for label, compression in configs]
    if hvd.rank() == 0:
        base = results[0][1]
        print(f"{args.model}, {hvd.size()} ranks, median of {args.steps} steps")
        print(f"{'configuration':<28} {'step ms':>8} {'vs horovod none':>16} {'calls/step':>11}")
        for label, seconds, calls in results:
            print(f"{label:<28} {1e3 * seconds:>8.1f} {seconds / base:>15.2f}x {calls:>11}")


if __name__ == "__main__":
    main()
