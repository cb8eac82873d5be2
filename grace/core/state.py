"""Where an exchange keeps its per-tensor state: memory, compressor state and step counters.

``StateStore`` keeps plain values in dicts (NumPy, PyTorch). A toolkit whose training steps are
traced into graphs subclasses it to keep each value in variables created once, on first use,
from the ``init`` the memory or compressor provides (``grace.tensorflow.VariableStore``).
A value of None means "no state" and is never stored.

A bucket with one flat memory keeps its values under its own key; they are saved per gradient
name (``by_name``) and taken back per bucket (``gather``), so a checkpoint loads under any bucket
size.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict

from grace.core.buffers import flat_concat
from grace.core.memory import stored
from grace.core.tensors import backend_for

TABLES = ("memory", "state", "steps", "owner")  # owner: the two-phase exchange's memory of its shard


class StateStore:
    def __init__(self):
        self.tables: Dict[str, Dict[str, Any]] = {table: {} for table in TABLES}

    def get(self, table: str, name: str, init: Callable[[Any], Any], like) -> Any:
        """The value of ``name``; on first use ``init(template)``, where the template is a
        tensor with the shape and dtype of ``like``."""
        values = self.tables[table]
        if name not in values:
            self.set(table, name, init(like))
        return values.get(name)

    def value(self, table: str, name: str) -> Any:
        """The current value of ``name`` (None where it has none), unchanged by later calls of ``set``."""
        return self.tables[table].get(name)

    def values(self, table: str, names) -> list:
        """``value`` of each of ``names``."""
        return list(map(self.tables[table].get, names))

    def set(self, table: str, name: str, value) -> None:
        if value is None:
            self.tables[table].pop(name, None)
        else:
            self.tables[table][name] = value

    def set_many(self, table: str, names, values) -> None:
        for name, value in zip(names, values):
            self.set(table, name, value)

    def eager(self):
        """A context in which values are read and stored at once (not traced into a graph)."""
        return contextlib.nullcontext()

    def state_dict(self) -> Dict[str, Dict[str, Any]]:
        return {table: dict(values) for table, values in self.tables.items()}

    def load_state_dict(self, state: Dict[str, Dict[str, Any]]) -> None:
        for table in TABLES:
            self.tables[table] = {}
            for name, value in state.get(table, {}).items():
                self.set(table, name, value)


def state_view(value, segment):
    """A segment's part of a flat state value (a tensor, or a tuple of them), in its shape."""
    if isinstance(value, tuple):
        return tuple(state_view(t, segment) for t in value)
    return backend_for(value).reshape(value[segment.offset:segment.offset + segment.numel], segment.shape)


def copied(value):
    """A copy of a state value (a tensor, a tuple of them, or None; a deferred state made)."""
    if value is None:
        return None
    value = stored(value)
    xp = backend_for(value[0] if isinstance(value, tuple) else value)
    return tuple(xp.copy(t) for t in value) if isinstance(value, tuple) else xp.copy(value)


def by_name(table: str, values: Dict[str, Any], buckets: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` with each bucket's entry split into its gradients' (a step counter is each
    gradient's; a flat memory is cut per segment; a deferred state is made)."""
    out = {}
    for key, value in values.items():
        bucket = buckets.get(key)
        if bucket is None:
            out[key] = stored(value)
        else:
            out.update((s.name, value if table == "steps" else state_view(value, s)) for s in bucket.segments)
    return out


def gather(bucket, tables: Dict[str, Dict[str, Any]], memory, xp, like, flat_memory: bool) -> Dict[str, Any]:
    """Pop the per-name steps (and, for a bucket with a flat memory, the memories) of
    ``bucket``'s gradients from ``tables``; the bucket's own values: its step (the largest),
    its flat memory (a gradient without one starts from ``memory``'s init)."""
    out = {}
    steps = [tables["steps"].pop(name) for name in bucket.names if name in tables["steps"]]
    if steps:
        out["steps"] = max(int(s) for s in steps)
    for table, init in (("memory", memory.init), ("owner", lambda xp, t: t)):
        values = tables[table]
        if flat_memory and any(name in values for name in bucket.names):
            parts = []
            for s in bucket.segments:
                value = values.pop(s.name, None)
                parts.append(init(xp, xp.zeros(s.numel, bucket.dtype, like=like)) if value is None else stored(value))
            out[table] = (tuple(flat_concat(xp, list(c)) for c in zip(*parts)) if isinstance(parts[0], tuple)
                          else flat_concat(xp, parts))
    return out


def release(old, store: StateStore) -> None:
    """Bucket ``old`` hands its step counter and memory back per gradient name (its layout
    ended: DDP rebuilt its buckets, another plan took its gradients, or the world changed size).
    Per-bucket compressor state (``scope='bucket'``) belongs to the old layout and ends with it.
    Stored through ``store`` (TensorFlow keeps each in a variable; call it eagerly)."""
    tables = store.tables
    for table in ("steps", "memory", "owner"):
        value = tables[table].pop(old.key, None)
        if value is not None:
            for s in old.segments:
                store.set(table, s.name, value if table == "steps" else copied(state_view(value, s)))
    tables["state"].pop(old.key, None)
