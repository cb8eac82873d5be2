"""Route Horovod's TensorFlow entry points to grace when given a grace compression.

``horovod.tensorflow.DistributedGradientTape`` and ``horovod.tensorflow.keras.DistributedOptimizer``
become functions that hand grace compressions to grace (which builds Horovod's own object with
``Compression.none`` and replaces only its gradient reduction) and everything else to
Horovod's original, untouched. Horovod's elastic state objects also save, restore and sync
grace's state. Nothing here imports horovod.torch or torch.
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
    _keep_with_elastic_states()
    _reset_on_every_failed_collective()


def _keep_with_elastic_states() -> None:
    """Horovod's elastic state objects (all ``ObjectState``s) keep grace's state with theirs: a
    commit saves it, a reset restores it (a failed step leaves no trace, as in PyTorch's
    TorchState, which saves the optimizer's state_dict), a sync broadcasts rank 0's shared
    state (step counters, PowerSGD's Q) when the world changes, and a reset has the steps traced
    in the old world traced again."""
    from horovod.common.elastic import ObjectState

    # (reset: after Horovod's own, before the user's reset callbacks)
    extra = {"save": "save_states", "restore": "restore_states", "sync": "sync_shared_state", "reset": "follow_world"}
    for method, then in extra.items():
        original = getattr(ObjectState, method)
        if hasattr(original, "__grace_original__"):
            continue

        def wrapped(self, _original=original, _then=then):
            _original(self)
            # (grace.tensorflow.gradients imports horovod.tensorflow, whose import runs this: look it up late)
            getattr(importlib.import_module("grace.tensorflow.gradients"), _then)()

        wrapped.__grace_original__ = original
        setattr(ObjectState, method, functools.wraps(original)(wrapped))


def _reset_on_every_failed_collective() -> None:
    """Horovod's TensorFlow ``elastic.run`` resets after a failed collective only where the error
    names an allreduce, allgather or broadcast, and on any other ``UnknownError`` ends the training
    function as if it had returned: a rank lost during an alltoall (grace's two phases) would end
    training early with no error. This ``run`` resets after any failed Horovod collective and lets
    every other error through."""
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError
    from horovod.tensorflow import elastic

    original = elastic.run
    if hasattr(original, "__grace_original__"):
        return

    def run(func):
        def wrapper(state, *args, **kwargs):
            try:
                return func(state, *args, **kwargs)
            except tf.errors.UnknownError as e:
                if any(f"Horovod{kind}" in e.message for kind in _COLLECTIVES):
                    raise HorovodInternalError(e) from e
                raise
        return run_fn(wrapper, elastic._reset)

    run.__grace_original__ = original
    elastic.run = functools.wraps(original)(run)


_COLLECTIVES = ("Allreduce", "Allgather", "Broadcast", "Alltoall", "Reducescatter")


def install_keras(hvd_keras) -> None:
    """For horovod.tensorflow.keras."""
    _route(hvd_keras, "DistributedOptimizer", "grace.tensorflow.keras.DistributedOptimizer")
