"""Whole DDP training steps on real models, per communication hook: DDP without a hook,
PyTorch's fp16 and PowerSGD hooks, and grace's hook for each method, in one run.

    python scripts/bench_ddp_step.py --device cuda                        # a world of one, NCCL
    python scripts/bench_ddp_step.py --device cuda --world 2 --backend gloo   # 2 processes, one GPU
    python scripts/bench_ddp_step.py --device cpu --models mlp48 --iters 5    # Gloo on a CPU

A step is forward, backward (DDP runs the hook on each bucket as backward fills it, and waits
for them all at its end) and the optimizer's step; the median over ``--iters`` steps after
three warm-up steps (PyTorch's PowerSGD compresses from the third), with a device sync around
each, as the slowest rank saw it. ``vs DDP`` is the step time over DDP's without a hook, so
the hook's own cost per step is ``step - DDP step``. Models and inputs: grace.bench.bench_step.
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import grace
import grace.torch.ddp
from grace.bench.common import help_parser, write_results
from grace.bench.bench_step import METHODS, build, timed
from grace.bench.ddp_baselines import DDPHook

BASELINES = {"DDP": ("allreduce", 1), "DDP fp16_compress_hook": ("fp16", 1),
             "DDP powerSGD_hook(1)": ("powersgd", 1), "DDP powerSGD_hook(4)": ("powersgd", 4)}
DEFAULT_METHODS = ["none", "fp16", "topk", "randomk", "signsgd", "qsgd", "powersgd"]


def step_seconds(model: str, hook: str, args, rank: int) -> dict:
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    torch.manual_seed(0)
    net, x, y, loss = build(model, args.device)
    net, x, y = net.to(device), x.to(device), y.to(device)
    baseline = DDPHook(*BASELINES[hook]) if hook in BASELINES else None
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                  **(baseline.ddp_options if baseline else {}))
    if baseline:
        baseline(ddp)
        nbytes = baseline.bytes_per_step
    else:
        state = grace.torch.ddp.register(ddp, grace.create(hook, **METHODS[hook]))
        nbytes = lambda: state.stats.last_step_bytes  # noqa: E731
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss(ddp(x), y).backward()
        optimizer.step()

    seconds = timed(step, args.device, args.iters, warmup=3)
    slowest = torch.tensor(seconds, device=device if args.backend == "nccl" else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"step_ms": 1e3 * slowest.item(), "bytes": int(nbytes()),
            "tensors": sum(1 for p in net.parameters() if p.requires_grad),
            "parameters": sum(p.numel() for p in net.parameters() if p.requires_grad)}


def worker(rank: int, args) -> None:
    dist.init_process_group(args.backend, rank=rank, world_size=args.world,
                            init_method=f"file://{args.out.resolve()}/.rendezvous")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        if rank == 0:
            print(f"\n{model} on {args.device}, {args.world} rank(s) over {args.backend}")
            print(f"{'hook':<24} {'step ms':>9} {'vs DDP':>8} {'bytes/step':>12}", flush=True)
        base = None
        for hook in [*BASELINES, *args.methods]:
            row = {"model": model, "device": args.device, "backend": args.backend, "world": args.world,
                   "hook": hook if hook in BASELINES else f"grace {hook}", **step_seconds(model, hook, args, rank)}
            base = base or row["step_ms"]
            row["vs_ddp"] = row["step_ms"] / base
            rows.append(row)
            if rank == 0:
                print(f"{row['hook']:<24} {row['step_ms']:>9.1f} {row['vs_ddp']:>7.2f}x {row['bytes']:>12,}", flush=True)
    if rank == 0:
        path = write_results(rows, args.out, f"bench_ddp_step_{args.device}_{args.backend}_{args.world}",
                             {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                             methods=METHODS)
        print(f"\nwrote {path}")
    gc.collect()  # the DDP models sit in reference cycles: free them while the process group lives
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet50"], help="the models trained (bench_step's)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS),
                        help="grace's methods timed beside DDP's own hooks")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models train")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--world", type=int, default=1, help="processes on this machine (sharing its GPUs)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per hook")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_ddp_step"), help="where the results go")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ".rendezvous").unlink(missing_ok=True)
    mp.spawn(worker, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    main()
