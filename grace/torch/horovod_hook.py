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
  broadcast (Horovod fills in a joined rank's part of allreduce only).
"""
import functools
import inspect
import sys

from grace.core.compression import GradientCompression


def install(hvd_torch) -> None:
    original = hvd_torch.DistributedOptimizer
    if hasattr(original, "__grace_original__"):
        return
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

    from horovod.torch import functions

    original_broadcast = functions.broadcast_optimizer_state

    @functools.wraps(original_broadcast)
    def broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs):
        original_broadcast(optimizer, root_rank, *args, **kwargs)
        exchange = getattr(optimizer, "_grace", None)
        if exchange is not None:
            shared = hvd_torch.broadcast_object(exchange.shared_state(), root_rank,
                                                name="grace.shared_state",
                                                process_set=exchange.communicator.process_set)
            exchange.load_shared_state(shared)

    original_join = hvd_torch.join

    @functools.wraps(original_join)
    def join(*args, **kwargs):
        from grace.core.compressor import Collective
        from grace.torch.optimizer import LIVE

        for optimizer in list(LIVE):
            compression = optimizer._grace.compression
            if compression.collective is not Collective.ALLREDUCE:
                raise RuntimeError(
                    f"grace: hvd.join() cannot be used with {compression!r}: Horovod fills in a joined rank's "
                    f"part of an allreduce only, and this method exchanges by {compression.collective.value}. "
                    "Give every rank the same number of steps, or use an allreduce method (none, fp16, randomk, "
                    "powersgd, or communicator='allreduce' where the method allows it)")
        return original_join(*args, **kwargs)

    join.__grace_original__ = original_join
    hvd_torch.join = join
    broadcast_optimizer_state.__grace_original__ = original_broadcast
    # where users and Horovod's elastic TorchState (which imported it by name) find it
    for module in (functions, hvd_torch, sys.modules.get("horovod.torch.elastic.state")):
        if module is not None and getattr(module, "broadcast_optimizer_state", None) is original_broadcast:
            module.broadcast_optimizer_state = broadcast_optimizer_state
