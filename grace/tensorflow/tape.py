"""``hvd.DistributedGradientTape`` for grace methods: Horovod's own tape, grace's reduction."""
from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import Adasum, Average, Sum, global_process_set

from grace.horovod_common import check_horovod_arguments
from grace.tensorflow.gradients import exchange_for


KERAS_3_MESSAGE = (
    "Horovod's TensorFlow code needs Keras 2 variables (it calls Variable.ref(), which Keras 3 "
    "variables lack). Install tf-keras and set TF_USE_LEGACY_KERAS=1 in the environment before "
    "TensorFlow is imported (then tf.keras is Keras 2)."
)


def check_arguments(compression, op, groups=None, num_groups=0):
    check_horovod_arguments(compression, op, Average, Sum, Adasum, groups, num_groups)


def _checked_sources(gradient):
    """The tape's ``gradient``, saying what to do about Keras 3 variables before Horovod's own
    AttributeError ('Variable' object has no attribute 'ref')."""
    def checked(target, sources, *args, **kwargs):
        keras_3 = [s for s in tf.nest.flatten(sources) if not hasattr(s, "ref")]
        if keras_3:
            raise RuntimeError(f"{KERAS_3_MESSAGE} Got {type(keras_3[0]).__module__}.{type(keras_3[0]).__name__} "
                               f"({getattr(keras_3[0], 'path', getattr(keras_3[0], 'name', '?'))}).")
        return gradient(target, sources, *args, **kwargs)

    return checked


def DistributedGradientTape(horovod_tape, gradtape, device_dense='', device_sparse='', compression=None,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's tape (``horovod_tape``: the original factory) reducing with ``compression``."""
    check_arguments(compression, op, groups, num_groups)
    tape = horovod_tape(gradtape, device_dense, device_sparse, Compression.none, sparse_as_dense, op,
                        gradient_predivide_factor, process_set=process_set,
                        scale_local_gradients=scale_local_gradients)
    tape._allreduce_grads = exchange_for(compression, op, sparse_as_dense, process_set)
    tape.gradient = _checked_sources(tape.gradient)
    return tape
