"""Route ``hvd.DistributedOptimizer(..., compression=<grace method>)`` to grace.

The changes grace makes to Horovod's PyTorch namespace:
- ``horovod.torch.DistributedOptimizer`` becomes a function that hands grace compressions to
  ``grace.torch.DistributedOptimizer`` and everything else (``hvd.Compression.fp16``, ``none``,
  Adasum, ...) to Horovod's original, untouched;
- ``broadcast_optimizer_state`` (in ``horovod.torch`` and where Horovod's elastic state uses
  it) runs Horovod's original, then, for a grace optimizer, also broadcasts what all ranks
  must share (step counters, PowerSGD's Q), so that Horovod's resume recipe (rank 0 loads,
  then broadcasts) and an elastic reset leave no rank behind;
- ``horovod.torch.join`` refuses clearly while a grace optimizer exchanges by allgather or
  broadcast (Horovod fills in a joined rank's part of allreduce only); once every rank has
  joined, each grace optimizer takes the step counters and shared state of the rank that
  joined last (the others skipped steps: their draws would no longer agree).
"""
import functools
import inspect
import sys

import torch

from grace.core.compression import GradientCompression

_HOST = torch.zeros(0)  # where grace's shared state travels: host tensors


def install(hvd_torch) -> None:
    if hasattr(hvd_torch.DistributedOptimizer, "__grace_original__"):
        return
    _wrap_optimizer(hvd_torch)
    _wrap_join(hvd_torch)
    _wrap_broadcast(hvd_torch)


def _wrap_optimizer(hvd_torch) -> None:
    """``hvd.DistributedOptimizer`` hands a grace compression to grace's optimizer."""
    original = hvd_torch.DistributedOptimizer
    signature = inspect.signature(original)

    @functools.wraps(original)
    def DistributedOptimizer(*args, **kwargs):
        compression = signature.bind(*args, **kwargs).arguments.get("compression")
        if isinstance(compression, GradientCompression):
            from grace.torch.optimizer import DistributedOptimizer as grace_optimizer

            return grace_optimizer(*args, **kwargs)
        return original(*args, **kwargs)

    DistributedOptimizer.__grace_original__ = original
    hvd_torch.DistributedOptimizer = DistributedOptimizer


def _wrap_broadcast(hvd_torch) -> None:
    """``hvd.broadcast_optimizer_state`` also carries grace's shared state (step counters)."""
    from horovod.torch import functions

    original_broadcast = functions.broadcast_optimizer_state

    @functools.wraps(original_broadcast)
    def broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs):
        original_broadcast(optimizer, root_rank, *args, **kwargs)
        exchange = getattr(optimizer, "_grace", None)
        if exchange is not None:
            exchange.adopt_shared_state(root_rank, _HOST)

    broadcast_optimizer_state.__grace_original__ = original_broadcast
    # where users and Horovod's elastic TorchState (which imported it by name) find it
    for module in (functions, hvd_torch, sys.modules.get("horovod.torch.elastic.state")):
        if module is not None and getattr(module, "broadcast_optimizer_state", None) is original_broadcast:
            module.broadcast_optimizer_state = broadcast_optimizer_state


def _wrap_join(hvd_torch) -> None:
    """``hvd.join()`` refuses methods it cannot serve, then syncs step counters from the last rank."""
    original_join = hvd_torch.join

    @functools.wraps(original_join)
    def join(*args, **kwargs):
        from grace.core.compressor import Collective
        from grace.torch.optimizer import made_optimizers

        optimizers, made = made_optimizers()
        for _, optimizer in optimizers:
            compression = optimizer._grace.compression
            if compression.collective is not Collective.ALLREDUCE:
                raise RuntimeError(
                    f"grace: hvd.join() cannot be used with {compression!r}: Horovod fills in a joined rank's "
                    f"part of an allreduce only, and this method exchanges by {compression.collective.value}. "
                    "Give every rank the same number of steps, or use an allreduce method (none, fp16, randomk, "
                    "powersgd, or communicator='allreduce' where the method allows it)")
        last = original_join(*args, **kwargs)
        # the optimizers alive on every rank (of the global set) take the last rank's counters
        alive = torch.zeros(made, dtype=torch.int64)
        alive[[i for i, optimizer in optimizers if optimizer._grace.communicator.process_set.process_set_id == 0]] = 1
        alive = hvd_torch.allreduce(alive, op=hvd_torch.Sum, name="grace.join.alive") if made else alive
        for i, optimizer in optimizers:
            if alive[i] == hvd_torch.size():
                optimizer._grace.after_join(last, _HOST, name=f"grace.join.{i}")
        return last

    join.__grace_original__ = original_join
    hvd_torch.join = join
