"""Where an exchange keeps its per-tensor state: memory, compressor state and step counters.

``StateStore`` keeps plain values in dicts (NumPy, PyTorch). A toolkit whose training steps are
traced into graphs subclasses it to keep each value in variables created once, on first use,
from the ``init`` the memory or compressor provides (``grace.tensorflow.VariableStore``).
A value of None means "no state" and is never stored.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict

TABLES = ("memory", "state", "steps")


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
        """The current value of ``name`` (None where it has none), unchanged by later ``set``s."""
        return self.tables[table].get(name)

    def set(self, table: str, name: str, value) -> None:
        if value is None:
            self.tables[table].pop(name, None)
        else:
            self.tables[table][name] = value

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
