"""Route Horovod's TensorFlow entry points to grace when given a grace compression.

``horovod.tensorflow.DistributedGradientTape`` and ``horovod.tensorflow.keras.DistributedOptimizer``
become functions that hand grace compressions to grace (which builds Horovod's own object with
``Compression.none`` and replaces only its gradient reduction) and everything else to
Horovod's original, untouched. Nothing here imports horovod.torch or torch.
"""
import functools
import importlib
import inspect

import tensorflow as tf

from grace.core.compression import GradientCompression


def _route(module, attribute: str, grace_factory_path: str) -> None:
    original = getattr(module, attribute)
    if hasattr(original, "__grace_original__"):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    @tf.autograph.experimental.do_not_convert  # called inside tf.function steps: plain Python, no graph
    def routed(*args, **kwargs):
        if isinstance(signature.bind(*args, **kwargs).arguments.get("compression"), GradientCompression):
            module_path, name = grace_factory_path.rsplit(".", 1)
            return getattr(importlib.import_module(module_path), name)(original, *args, **kwargs)
        return original(*args, **kwargs)

    routed.__grace_original__ = original
    setattr(module, attribute, routed)


def install(hvd_tf) -> None:
    """For horovod.tensorflow."""
    _route(hvd_tf, "DistributedGradientTape", "grace.tensorflow.tape.DistributedGradientTape")


def install_keras(hvd_keras) -> None:
    """For horovod.tensorflow.keras."""
    _route(hvd_keras, "DistributedOptimizer", "grace.tensorflow.keras.DistributedOptimizer")
