"""Backends: the small set of array operations the methods are written against.

Each backend implements the same operations (see ``numpy_backend.NumpyBackend``, the reference)
and nothing method-specific. ``backend_for(x)`` picks one from the tensor's type, importing a
toolkit only when one of its tensors shows up, so ``import grace`` imports no toolkit.
"""
from __future__ import annotations

import importlib

_BY_MODULE = {
    "numpy": ("grace.backends.numpy_backend", "NumpyBackend"),
    "torch": ("grace.backends.torch_backend", "TorchBackend"),
    "tensorflow": ("grace.backends.tensorflow_backend", "TensorflowBackend"),
}
_loaded = {}


def get_backend(name: str):
    """The backend named 'numpy', 'torch' or 'tensorflow'."""
    if name not in _loaded:
        if name not in _BY_MODULE:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(_BY_MODULE)}")
        module, cls = _BY_MODULE[name]
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


_BY_TYPE: dict = {}  # tensor type -> its backend: asked for per tensor and step


def backend_for(x):
    """The backend for tensor ``x``, by the package its type comes from."""
    backend = _BY_TYPE.get(type(x))
    if backend is not None:
        return backend
    root = type(x).__module__.split(".")[0]
    if root not in _BY_MODULE:
        raise TypeError(f"grace has no backend for tensors of type {type(x).__name__} ({root})")
    return _BY_TYPE.setdefault(type(x), get_backend(root))
