"""Worker: grace as PyTorch DDP's communication hook, over Gloo, without Horovod.

    torchrun --standalone --nproc-per-node 3 torch_ddp.py --out DIR [--variants ...]
"""
import contextlib
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from common import (ALLTOALL_VARIANTS, DDP_VARIANTS, PARAMS, STEPS, gradient, names, parse_args, plans_for, save,
                    state_arrays)
from torch.nn.parallel import DistributedDataParallel

import grace.torch.ddp


class Params(torch.nn.Module):
    """The parameters of PARAMS under their names; forward(grads) = sum(p * grad), so that
    backward hands each parameter its given gradient."""

    def __init__(self, values):
        super().__init__()
        self.layer = torch.nn.Module()
        for (name, _, _), value in zip(PARAMS, values):
            owner, attr = (self.layer, name.split(".")[1]) if name.startswith("layer.") else (self, name)
            owner.register_parameter(attr, torch.nn.Parameter(torch.from_numpy(value.copy())))

    def forward(self, grads):
        return sum((p * grads[name]).sum() for name, p in self.named_parameters() if name in grads)


def build(variant, values, state=None):
    options = dict(variant.ddp)
    if options.get("process_group") == "new":  # a group of its own, over every rank
        options["process_group"] = dist.new_group(list(range(dist.get_world_size())))
    model = DistributedDataParallel(Params(values), find_unused_parameters=bool(variant.unused), **options)
    hook_state = grace.torch.ddp.register(model, variant.make())
    if state is not None:
        hook_state.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
    return model, hook_state


def run(label, variant):
    rank, keys = dist.get_rank(), names(variant)
    model, state = build(variant, [torch.zeros(shape).numpy() for _, shape, _ in PARAMS])
    results = {}
    for step in range(STEPS):
        model.zero_grad(set_to_none=False)
        for b in range(variant.passes):  # gradient accumulation: all passes but the last without sync
            grads = {name: torch.from_numpy(gradient(rank, step, i, b)) for i, name in enumerate(keys)
                     if not (rank == 0 and name in variant.unused)}
            with model.no_sync() if b < variant.passes - 1 else contextlib.nullcontext():
                model(grads).backward()
        params = dict(model.module.named_parameters())
        for name in keys:
            grad = params[name].grad
            results[f"grad/{name}/{step}"] = (grad if grad is not None else torch.zeros_like(params[name])).numpy().copy()
        results[f"bytes/{step}"] = state.stats.last_step_bytes
        if variant.make().collective is grace.Collective.ALLTOALL:  # DDP's buckets: what the shards are cut from
            results[f"layout/{step}"] = np.array([f"{key}|{','.join(plan.bucket.names)}"
                                                  for key, plan in state.exchange.bucket_plans().items()])
        if step == variant.checkpoint_after:  # through bytes, into a brand-new model and hook
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            model, state = build(variant, [params[name].detach().numpy() for name in keys], buffer.getvalue())
    results.update(state_arrays(state.state_dict(), lambda t: t.numpy()))
    assert "horovod" not in sys.modules and not any(m.startswith("horovod.") for m in sys.modules)
    return results


def main():
    args = parse_args(DDP_VARIANTS)
    dist.init_process_group("gloo")
    for label in args.variants:
        variant = {**DDP_VARIANTS, **ALLTOALL_VARIANTS}[label]
        with plans_for(variant):
            save(args.out, label, dist.get_rank(), run(label, variant))
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a Gloo thread still dropping the step's last finished
    # work (its tensors are Python objects) aborts the process if Python is finalizing meanwhile.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
