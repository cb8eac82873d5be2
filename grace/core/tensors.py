"""Which backend a tensor belongs to, from a table the backends fill in (``grace.backends``):
the core names no backend and no toolkit.

A backend is made on first use, so ``import grace`` imports no toolkit; ``backend_for`` then
remembers it per tensor type (it is asked per tensor and step).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

_MAKERS: Dict[str, Callable[[], Any]] = {}  # name (a tensor type's top-level package) -> makes its backend
_MADE: Dict[str, Any] = {}
_BY_TYPE: Dict[type, Any] = {}


def register_backend(name: str, make: Callable[[], Any]) -> None:
    """Tensors whose type comes from package ``name`` are served by the backend ``make()`` builds."""
    _MAKERS[name] = make


def get_backend(name: str):
    """The backend registered as ``name`` ('numpy', 'torch', 'tensorflow')."""
    if name not in _MADE:
        if name not in _MAKERS:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(_MAKERS)}")
        _MADE[name] = _MAKERS[name]()
    return _MADE[name]


def backend_for(x):
    """The backend for tensor ``x``, by the package its type comes from."""
    backend = _BY_TYPE.get(type(x))
    if backend is not None:
        return backend
    root = type(x).__module__.split(".")[0]
    if root not in _MAKERS:
        raise TypeError(f"grace has no backend for tensors of type {type(x).__name__} ({root})")
    return _BY_TYPE.setdefault(type(x), get_backend(root))


_CONSTANTS: Dict[tuple, Any] = {}  # (backend, device, key) -> what make() made there


def constant(xp, key, make: Callable[[], Any], like):
    """``make()``, something that depends on ``key`` alone (place values, a table, zeros), made
    once per backend and device where tensors persist: no copy to the device or fill launched
    per call. (A traced graph's tensors stay in their graph: there, made every time.)"""
    if not xp.mutable_tensors:
        return make()
    full = (type(xp), None if like is None else xp.device(like), key)
    made = _CONSTANTS.get(full)
    if made is None:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        made = _CONSTANTS[full] = make()
    return made
