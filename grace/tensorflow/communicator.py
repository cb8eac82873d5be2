"""The collective primitives on Horovod's TensorFlow ops (eager or inside tf.function).

TensorFlow runs a traced step's ops as their inputs become ready, so the primitives return
their result at once; ``wait`` only hands it over.
"""
import re

import tensorflow as tf
from horovod.tensorflow import mpi_ops

from grace.core.communicator import ProcessSetCommunicator


def _op_name(kind: str, name: str) -> str:
    """Horovod matches collectives across ranks by name; TensorFlow allows [A-Za-z0-9_.-/].
    The kind leads, as in Horovod's own names ('HorovodAllgather_...'): Horovod's elastic
    training recognises a failed collective, and resets instead of stopping, by that word."""
    return f"Horovod{kind}_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


class HorovodCommunicator(ProcessSetCommunicator):
    def __init__(self, process_set=mpi_ops.global_process_set):
        super().__init__(process_set)

    def allreduce_async(self, tensor, name):
        if tensor.dtype == tf.bfloat16:  # summed in float32, as the other backends do
            total = mpi_ops._allreduce(tf.cast(tensor, tf.float32), name=_op_name("Allreduce", name), op=mpi_ops.Sum,
                                       ignore_name_scope=True, process_set=self.process_set)
            return lambda: tf.cast(total, tf.bfloat16)
        total = mpi_ops._allreduce(tensor, name=_op_name("Allreduce", name), op=mpi_ops.Sum, ignore_name_scope=True,
                                   process_set=self.process_set)
        return lambda: total

    def allgather_async(self, tensor, name):
        wire = tf.bitcast(tensor, tf.int16) if tensor.dtype == tf.bfloat16 else tensor
        gathered = mpi_ops.allgather(wire, name=_op_name("Allgather", name), ignore_name_scope=True,
                                     process_set=self.process_set)
        return lambda: tf.bitcast(gathered, tf.bfloat16) if tensor.dtype == tf.bfloat16 else gathered

    def alltoall_async(self, tensor, splits, name):
        received, _ = mpi_ops.alltoall(tensor, splits=tf.cast(tf.stack(list(splits)), tf.int32),
                                       name=_op_name("Alltoall", name), ignore_name_scope=True,
                                       process_set=self.process_set)
        return lambda: received

    def broadcast_async(self, tensor, root, name):
        wire = tf.bitcast(tensor, tf.int16) if tensor.dtype == tf.bfloat16 else tensor
        received = mpi_ops.broadcast(wire, root_rank=root, name=_op_name("Broadcast", name), ignore_name_scope=True,
                                     process_set=self.process_set)
        return lambda: tf.bitcast(received, tf.bfloat16) if tensor.dtype == tf.bfloat16 else received
