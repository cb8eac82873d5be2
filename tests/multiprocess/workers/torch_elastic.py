"""Worker: Horovod elastic training (``hvd.elastic.run``, ``TorchState``) with grace, while
the world shrinks from 2 ranks to 1 and grows back to 2.

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER --gloo \\
        python torch_elastic.py --out DIR --hosts HOSTS_FILE --grow-host HOST --method none

The process on the second host exits at step FAIL_AT (its host is then left out); at step
GROW_AT the first rank lists a third host, and a new process joins. Every step checks the
averaged gradient against the mean of all current ranks' own gradients, gathered by Horovod's
plain allgather (method 'none'), that every rank holds the same parameters, and that no
gradient mass is lost: what was delivered plus what the memories hold is what came in.
"""
import json
from copy import deepcopy

import horovod.torch as hvd
import torch
from common import ELASTIC_METHODS, ELASTIC_STEPS, parse_elastic_args, shrink_or_grow

ARGS = parse_elastic_args()
METHODS = ELASTIC_METHODS


def local_gradient_inputs(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def own_gradients(model, x, y):
    """This rank's gradients, from a copy of the model that no optimizer hooks: the exchange
    averages .grad in place as soon as backward hands it over (as Horovod's allreduce does),
    so .grad read after backward may already be the average."""
    replica = deepcopy(model)
    loss = torch.nn.functional.mse_loss(replica(x), y)
    return torch.autograd.grad(loss, list(replica.parameters()))


def held(optimizer, model):
    """This rank's error-feedback memory and owner memory (the two-phase exchange's), flat over
    the parameters, zeros where it keeps none."""
    saved = optimizer.state_dict()["grace"]
    return [torch.cat([saved.get(table, {}).get(name, torch.zeros_like(p)).flatten()
                       for name, p in model.named_parameters()]) for table in ("memory", "owner")]


def total(x, name):
    return hvd.allreduce(x, op=hvd.Sum, name=name)


@hvd.elastic.run
def train(state):
    log = state.log
    while state.step < ELASTIC_STEPS:
        step, rank, size = state.step, hvd.rank(), hvd.size()
        shrink_or_grow(state, ARGS, step, rank, size)
        x, y = local_gradient_inputs(step, rank)
        own = own_gradients(state.model, x, y)
        e_old, o_old = held(state.optimizer, state.model)  # (in this world: after a sync, after a rank left)
        state.optimizer.zero_grad()
        torch.nn.functional.mse_loss(state.model(x), y).backward()
        state.optimizer.synchronize()
        mean = [hvd.allgather(g[None], name=f"check.grad.{i}").mean(0) for i, g in enumerate(own)]
        error = max(float((p.grad - m).abs().max()) for p, m in zip(state.model.parameters(), mean))
        with state.optimizer.skip_synchronize():
            state.optimizer.step()
        # no mass lost: result + sum(e)/N + sum(o) after the step = (sum(g) + sum(e))/N + sum(o) before it
        # (o: the owners' memory, of the averaged gradient; the owners' hand-over after a change moves it)
        e_new, o_new = held(state.optimizer, state.model)
        result = torch.cat([p.grad.flatten() for p in state.model.parameters()])
        g = torch.cat([t.flatten() for t in own])
        after = result + total(e_new, "check.e_new") / size + total(o_new, "check.o_new")
        before = (total(g, "check.g") + total(e_old, "check.e_old")) / size + total(o_old, "check.o_old")
        mass = float((after - before).abs().max())
        params = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        spread = float((hvd.allgather(params[None], name="check.params") - params).abs().max())
        log.append({"step": step, "size": size, "error": error, "spread": spread, "mass": mass})
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
