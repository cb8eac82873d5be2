"""``horovod.tensorflow.keras.DistributedOptimizer`` for grace methods (Keras 2, tf-keras)."""
from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import Average, global_process_set

from grace.tensorflow.gradients import GradientExchange
from grace.tensorflow.tape import KERAS_3_MESSAGE, check_arguments


def check_keras_2(optimizer) -> None:
    """A clear error at construction instead of an AttributeError deep in Horovod."""
    version = getattr(getattr(tf, "keras", None), "__version__", "")
    if version.startswith("3") or type(optimizer).__module__.startswith("keras."):
        raise RuntimeError(f"{KERAS_3_MESSAGE} Got {type(optimizer).__module__}.{type(optimizer).__name__} "
                           f"with tf.keras {version or 'unknown'}.")


def DistributedOptimizer(horovod_optimizer, optimizer, name=None, device_dense='', device_sparse='',
                         compression=None, sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's Keras optimizer (``horovod_optimizer``: the original factory) reducing with
    ``compression``. The exchange's state variables are ``optimizer.grace.variables``."""
    check_keras_2(optimizer)
    check_arguments(compression, op, groups, num_groups)
    if backward_passes_per_step != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported with a grace compression in "
                         "Keras yet: Horovod's aggregation helper holds its own reference to the reduction")
    distributed = horovod_optimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                    compression=Compression.none, sparse_as_dense=sparse_as_dense,
                                    gradient_predivide_factor=gradient_predivide_factor, op=op,
                                    process_set=process_set, scale_local_gradients=scale_local_gradients)
    distributed.grace = GradientExchange(compression, op, sparse_as_dense, process_set)
    distributed._allreduce_grads = distributed.grace
    return distributed
