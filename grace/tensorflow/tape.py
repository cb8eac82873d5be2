"""``hvd.DistributedGradientTape`` for grace methods: Horovod's own tape, grace's reduction."""
from __future__ import annotations

from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import Adasum, Average, Sum, global_process_set

from grace.horovod_common import check_horovod_arguments
from grace.tensorflow.gradients import exchange_for


def check_arguments(compression, op, groups=None, num_groups=0):
    check_horovod_arguments(compression, op, Average, Sum, Adasum, groups, num_groups)


def DistributedGradientTape(horovod_tape, gradtape, device_dense='', device_sparse='', compression=None,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's tape (``horovod_tape``: the original factory) reducing with ``compression``."""
    check_arguments(compression, op, groups, num_groups)
    tape = horovod_tape(gradtape, device_dense, device_sparse, Compression.none, sparse_as_dense, op,
                        gradient_predivide_factor, process_set=process_set,
                        scale_local_gradients=scale_local_gradients)
    tape._allreduce_grads = exchange_for(compression, op, sparse_as_dense, process_set)
    return tape
