"""grace on PyTorch: Horovod's optimizer (``grace.torch.DistributedOptimizer``) and a DDP
communication hook (``grace.torch.ddp``).

Each is loaded on first use, so that ``import grace.torch.ddp`` imports no Horovod module.
"""
import importlib

__all__ = ["DistributedOptimizer", "ddp"]


def __getattr__(name):
    if name == "DistributedOptimizer":
        import horovod.torch  # noqa: F401  (installs grace's route through hvd.DistributedOptimizer)

        from grace.torch.optimizer import DistributedOptimizer

        return DistributedOptimizer
    if name == "ddp":
        return importlib.import_module("grace.torch.ddp")
    raise AttributeError(f"module 'grace.torch' has no attribute {name!r}")
