"""The Horovod TensorFlow adapter: ``hvd.DistributedGradientTape`` and Keras's
``DistributedOptimizer`` carrying grace methods. Imports horovod.tensorflow, never horovod.torch.

The adapter's names load on first use: importing this package imports no Horovod module."""
import importlib

_EXPORTS = {"GradientExchange": "gradients", "exchange_for": "gradients",
            "VariableStore": "state", "VariableWireStats": "state"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grace.tensorflow' has no attribute {name!r}")
    return getattr(importlib.import_module(f"grace.tensorflow.{_EXPORTS[name]}"), name)
