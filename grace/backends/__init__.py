"""Backends: the small set of array operations the methods are written against.

Each backend implements the same operations (see ``numpy_backend.NumpyBackend``, the reference)
and nothing method-specific. They are registered here with the core's table
(``grace.core.tensors``), each made the first time one of its toolkit's tensors shows up, so
``import grace`` imports no toolkit.
"""
from __future__ import annotations

import importlib

from grace.core.tensors import backend_for, get_backend, register_backend

__all__ = ["backend_for", "get_backend"]


def _maker(module: str, cls: str):
    return lambda: getattr(importlib.import_module(module), cls)()


for _name, _module, _cls in (("numpy", "grace.backends.numpy_backend", "NumpyBackend"),
                             ("torch", "grace.backends.torch_backend", "TorchBackend"),
                             ("tensorflow", "grace.backends.tensorflow_backend", "TensorflowBackend")):
    register_backend(_name, _maker(_module, _cls))
