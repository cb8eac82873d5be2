"""The function Horovod's TensorFlow tape and Keras optimizer call to reduce gradients.

Horovod builds both around ``_allreduce_grads(grads, vars, use_generic_names=False)``, which
returns the reduced gradients in order. grace builds them with ``Compression.none`` and puts
a ``GradientExchange`` in that slot: the GRACE pipeline with the method's own collective, its
state in tf.Variables keyed by the variable's name (stable across steps and traces).
"""
from __future__ import annotations

import weakref

import tensorflow as tf
from horovod.tensorflow import mpi_ops

from grace.core.compression import GradientCompression
from grace.core.exchange import Exchange
from grace.tensorflow.communicator import HorovodCommunicator
from grace.tensorflow.state import VariableStore, VariableWireStats


class GradientExchange:
    def __init__(self, compression: GradientCompression, op=mpi_ops.Average, sparse_as_dense=False,
                 process_set=mpi_ops.global_process_set):
        self.exchange = Exchange(compression, HorovodCommunicator(process_set), average=op == mpi_ops.Average,
                                 store=VariableStore(), stats=VariableWireStats())
        self.sparse_as_dense = sparse_as_dense

    @property
    def stats(self):
        return self.exchange.stats

    @property
    def variables(self):
        """The state variables (memory, compressor state, step counters), for checkpoints."""
        return self.exchange.store.variables

    def __call__(self, grads, variables=None, use_generic_names=False):
        names = [f"grad_{i}" if use_generic_names or variables is None else v.name.removesuffix(":0")
                 for i, v in enumerate(variables or grads)]
        dense = {}
        for name, grad in zip(names, grads):
            if grad is None:  # no gradient for this variable on this rank: Horovod's rule too
                continue
            if isinstance(grad, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(f"grace cannot compress the sparse gradient of {name!r}; "
                                     "pass sparse_as_dense=True")
                grad = tf.convert_to_tensor(grad)
            if name in dense:  # they would share one memory: silently wrong gradients
                raise ValueError(f"two variables are named {name!r}: grace keeps error-feedback state per "
                                 "variable name, so give each variable a unique name (tf.Variable(..., name=...))")
            dense[name] = grad
        if not self.exchange.compression.bucket_mb:
            started = {name: self.exchange.start(name, grad) for name, grad in dense.items()}
            reduced = {name: self.exchange.finish(p) for name, p in started.items()}
            self.exchange.stats.end_step()
        else:  # buckets planned in backward order: the last variables first
            reduced = self.exchange.exchange(dict(reversed(list(dense.items()))))
        return [reduced.get(name) if grad is not None else None for name, grad in zip(names, grads)]


_TAPE_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def exchange_for(compression: GradientCompression, op=mpi_ops.Average, sparse_as_dense=False,
                 process_set=mpi_ops.global_process_set) -> GradientExchange:
    """The exchange that the tapes built with ``compression`` share: a tape is usually made
    anew every step, so the state lives with the compression object. Create the compression
    once, outside the training step."""
    per_compression = _TAPE_EXCHANGES.setdefault(compression, {})
    key = (process_set.process_set_id, op, sparse_as_dense)
    if key not in per_compression:
        per_compression[key] = GradientExchange(compression, op, sparse_as_dense, process_set)
    return per_compression[key]
