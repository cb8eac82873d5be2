"""Fast-path objects registered per class and found along a class's bases: the table behind
``kernels_for`` / ``kernels_of`` (methods) and ``feedback_for`` / ``feedback_of`` (memories)."""
from __future__ import annotations

from typing import Callable, Dict


class ByClass:
    def __init__(self, default: Callable):
        self.default = default  # what a class with nothing registered gets
        self._registered: Dict[type, Callable] = {}

    def register(self, *classes):
        """A decorator: the decorated class serves ``classes`` (and their subclasses, unless
        they have their own)."""
        def register(cls):
            for registered in classes:
                self._registered[registered] = cls
            return cls
        return register

    def of(self, obj):
        """The object serving ``obj``: the one registered for its class or nearest base, made
        for ``obj``."""
        cls = next((self._registered[c] for c in type(obj).__mro__ if c in self._registered), self.default)
        return cls(obj)
