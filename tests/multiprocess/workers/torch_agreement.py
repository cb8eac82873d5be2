"""Worker: ranks that would silently disagree, through the stock Horovod PyTorch API.

    horovodrun -np 2 -H localhost:2 --gloo python torch_agreement.py --out DIR

Each scenario saves what every rank saw: the error it raised, or its parameters.
"""
import io

import horovod.torch as hvd
import grace
import torch
from common import parse_out, save_json


def model(extra: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    if extra:
        layers.append(torch.nn.Linear(3, 3))
    return torch.nn.Sequential(*layers)


def optimizer_for(net, compression):
    return hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                    named_parameters=net.named_parameters(), compression=compression)


def train(net, opt, steps: int, first: int = 0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x)[:, :3], y).backward()
        opt.step()


def first_step_error(net, compression) -> str:
    try:
        train(net, optimizer_for(net, compression), 1)
    except RuntimeError as error:
        return str(error)
    return ""


def resume(broadcast: bool, make) -> dict:
    """Horovod's recipe: rank 0 alone loads its checkpoint, then (or not) broadcasts."""
    net = model()
    opt = optimizer_for(net, make())
    train(net, opt, 3)
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    saved = hvd.broadcast_object(buffer.getvalue(), 0, name="checkpoint")  # rank 0's file
    net = model()
    opt = optimizer_for(net, make())
    if hvd.rank() == 0:
        checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    if broadcast:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    try:
        train(net, opt, 3, first=3)
    except RuntimeError as error:
        return {"error": str(error)}
    steps = {name: int(v) for name, v in opt.state_dict()["grace"]["steps"].items()}
    return {"error": "", "steps": steps, "params": [p.detach().flatten().tolist() for p in net.parameters()]}


def main():
    out = parse_out()
    hvd.init()
    rank = hvd.rank()
    results = {
        "ratio": first_step_error(model(), grace.topk(0.01 if rank == 0 else 0.02)),
        "seed": first_step_error(model(), grace.randomk(0.1, seed=rank)),
        "bucket_mb": first_step_error(model(), grace.topk(0.01, bucket_mb=25 if rank == 0 else 0)),
        "tensors": first_step_error(model(extra=rank == 1), grace.topk(0.01)),
        "same": first_step_error(model(), grace.topk(0.01)),
        "resume_randomk": resume(True, lambda: grace.randomk(0.25)),
        "resume_powersgd": resume(True, lambda: grace.powersgd(1)),
        "resume_without_broadcast": resume(False, lambda: grace.randomk(0.25)),
    }
    save_json(out, rank, results)


if __name__ == "__main__":
    main()
