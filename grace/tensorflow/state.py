"""Exchange state in tf.Variables, so that a step traced by tf.function carries it forward.

Each value (a residual, DGC's (u, v), PowerSGD's Q, a step counter) becomes variables created
once, on first use, under ``tf.init_scope`` (so also when that first use is inside a trace),
initialised from the memory's or compressor's ``init``; later writes are ``assign``s.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from grace.core.state import TABLES, StateStore


def _variable(value):
    value = tf.convert_to_tensor(value, dtype=tf.int64 if isinstance(value, int) else None)
    return tf.Variable(value, trainable=False, shape=value.shape)


class VariableStore(StateStore):
    def get(self, table, name, init, like):
        variables = self.tables[table]
        if name not in variables:
            with tf.init_scope():  # out of any trace: variables must be created eagerly
                template = tf.zeros(like.shape, like.dtype)
                value = init(template)
                if value is None:
                    return None
                variables[name] = tf.nest.map_structure(_variable, value)
        return tf.nest.map_structure(lambda v: v.read_value(), variables[name])

    def value(self, table, name):
        variables = self.tables[table].get(name)
        return None if variables is None else tf.nest.map_structure(lambda v: v.read_value(), variables)

    def values(self, table, names):
        return [self.value(table, name) for name in names]

    def set(self, table, name, value):
        variables = self.tables[table]
        if value is None:
            if name in variables:  # e.g. a memory that keeps nothing this step: forget it
                tf.nest.map_structure(lambda v: v.assign(tf.zeros_like(v)), variables[name])
            return
        if name not in variables:
            with tf.init_scope():
                variables[name] = tf.nest.map_structure(_variable, value)
            return
        tf.nest.map_structure(lambda v, x: v.assign(tf.cast(x, v.dtype)), variables[name], value)

    def eager(self):
        return tf.init_scope()

    @property
    def variables(self):
        """Every variable, for a tf.train.Checkpoint or a Keras model's weights."""
        return [v for table in TABLES for value in self.tables[table].values() for v in tf.nest.flatten(value)]

    def state_dict(self):
        return {table: {name: tf.nest.map_structure(lambda v: v.numpy(), value)
                        for name, value in self.tables[table].items()} for table in TABLES}

    def load_state_dict(self, state):
        for table in TABLES:
            for name, value in state.get(table, {}).items():
                self.set(table, name, tf.nest.map_structure(np.asarray, value))


class VariableWireStats:
    """``grace.WireStats`` kept in int64 variables, updated by the traced step itself."""

    _FIELDS = ("steps", "bytes_sent", "dense_bytes", "last_step_bytes", "last_step_dense_bytes",
               "step_bytes", "step_dense_bytes")

    def __init__(self):
        with tf.init_scope():
            self._v = {f: tf.Variable(0, dtype=tf.int64, trainable=False) for f in self._FIELDS}
        self.plans = {}  # bucket key -> its plan, as grace.WireStats.plans

    def add(self, nbytes, dense_bytes) -> None:
        self._v["step_bytes"].assign_add(tf.cast(nbytes, tf.int64))
        self._v["step_dense_bytes"].assign_add(tf.cast(dense_bytes, tf.int64))

    def end_step(self) -> None:
        v = self._v
        v["steps"].assign_add(1)
        v["last_step_bytes"].assign(v["step_bytes"])
        v["last_step_dense_bytes"].assign(v["step_dense_bytes"])
        v["bytes_sent"].assign_add(v["step_bytes"])
        v["dense_bytes"].assign_add(v["step_dense_bytes"])
        v["step_bytes"].assign(0)
        v["step_dense_bytes"].assign(0)

    def __getattr__(self, field):
        if field.startswith("_") or field not in self._FIELDS:
            raise AttributeError(field)
        return int(self._v[field].numpy())

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")
