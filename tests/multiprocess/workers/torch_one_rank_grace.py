"""Worker: rank 0 trains with a grace method, the others with Horovod's own optimizer (or, with
``--ddp``, grace's DDP hook on rank 0 only and DDP's own allreduce elsewhere). Such a job can
never finish: the grace rank waits in a collective the others never make. It must say so.

    horovodrun -np 2 -H localhost:2 --gloo python torch_one_rank_grace.py
    torchrun --standalone --nproc-per-node 2 torch_one_rank_grace.py --ddp
"""
import argparse
import os

import grace
import torch


def horovod():
    import horovod.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 2)
    compression = grace.topk(0.5) if hvd.rank() == 0 else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()


def ddp():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import grace.torch.ddp

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    if dist.get_rank() == 0:
        grace.torch.ddp.register(model, grace.topk(0.5))
    model(torch.randn(8, 4)).pow(2).mean().backward()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", action="store_true")
    ddp() if parser.parse_args().ddp else horovod()
    print(f"rank {os.environ.get('RANK', '?')} finished", flush=True)
