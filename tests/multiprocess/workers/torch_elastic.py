"""Worker: Horovod elastic training (``hvd.elastic.run``, ``TorchState``) with grace, while
the world shrinks from 2 ranks to 1 and grows back to 2.

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER --gloo \\
        python torch_elastic.py --out DIR --hosts HOSTS_FILE --grow-host HOST --method none

The process on the second host exits at step FAIL_AT (its host is then left out); at step
GROW_AT the first rank lists a third host, and a new process joins. Every step checks the
averaged gradient against the mean of all current ranks' own gradients, gathered by Horovod's
plain allgather (method 'none'), and that every rank holds the same parameters.
"""
import argparse
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import grace
import torch

STEPS, FAIL_AT, GROW_AT = 12, 4, 8
METHODS = {"none": grace.none, "topk": lambda: grace.topk(0.25), "randomk": lambda: grace.randomk(0.25)}


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hosts", type=Path, required=True)
    parser.add_argument("--grow-host", required=True)
    parser.add_argument("--method", choices=METHODS, required=True)
    return parser.parse_args()


ARGS = parse()


def local_gradient_inputs(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


@hvd.elastic.run
def train(state):
    log = state.log
    while state.step < STEPS:
        step, rank, size = state.step, hvd.rank(), hvd.size()
        if step == FAIL_AT and size == 2 and rank == 1 and not state.failed_once:
            os._exit(1)  # this process dies; its host leaves the job
        if step == GROW_AT and size == 1:
            if rank == 0:
                ARGS.hosts.write_text(ARGS.hosts.read_text() + f"{ARGS.grow_host}:1\n")
            while True:  # until Horovod sees the new host (it interrupts this loop)
                time.sleep(0.5)
                state.check_host_updates()
        x, y = local_gradient_inputs(step, rank)
        state.optimizer.zero_grad()
        torch.nn.functional.mse_loss(state.model(x), y).backward()
        own = [p.grad.clone() for p in state.model.parameters()]
        state.optimizer.synchronize()
        mean = [hvd.allgather(g[None], name=f"check.grad.{i}").mean(0) for i, g in enumerate(own)]
        error = max(float((p.grad - m).abs().max()) for p, m in zip(state.model.parameters(), mean))
        with state.optimizer.skip_synchronize():
            state.optimizer.step()
        params = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        spread = float((hvd.allgather(params[None], name="check.params") - params).abs().max())
        log.append({"step": step, "size": size, "error": error, "spread": spread})
        state.step += 1
        if size == 1:
            state.failed_once = True
        state.commit()


def main():
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=METHODS[ARGS.method]())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, failed_once=False, log=[])
    train(state)
    if hvd.rank() == 0:
        ARGS.out.mkdir(parents=True, exist_ok=True)
        steps = {str(k): int(v) for k, v in optimizer.state_dict()["grace"]["steps"].items()}
        (ARGS.out / f"{ARGS.method}.json").write_text(json.dumps({"log": state.log, "steps": steps}))


if __name__ == "__main__":
    main()
