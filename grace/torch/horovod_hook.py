"""Route ``hvd.DistributedOptimizer(..., compression=<grace method>)`` to grace.

The only change grace makes to Horovod's PyTorch namespace: ``horovod.torch.DistributedOptimizer``
becomes a function that hands grace compressions to ``grace.torch.DistributedOptimizer`` and
everything else (``hvd.Compression.fp16``, ``none``, Adasum, ...) to Horovod's original, untouched.
"""
import functools
import inspect

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
