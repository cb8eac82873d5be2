"""Methods by name: each method file registers its factory with one decorator line."""
from __future__ import annotations

import functools
from typing import Callable, Dict

from grace.core.compression import DEFAULT_BUCKET_MB, GradientCompression

_FACTORIES: Dict[str, Callable[..., GradientCompression]] = {}
_GRACE_PARAMS: Dict[str, Dict[str, str]] = {}
# Keys of GRACE's parameter dictionary that every method accepts; world_size comes from Horovod.
_COMMON_PARAMS = {"memory": "memory", "communicator": "communicator", "bucket_mb": "bucket_mb", "scope": "scope"}
_IGNORED_PARAMS = {"world_size"}


def register(name: str, **grace_params: str):
    """Register a factory under ``name``; ``grace_params`` maps GRACE dictionary keys to its
    keyword arguments (e.g. ``compress_ratio="ratio"``). The registered factory also takes
    ``bucket_mb=`` and ``scope=`` (see ``GradientCompression``)."""

    def decorate(factory):
        @functools.wraps(factory)
        def make(*args, bucket_mb: float = DEFAULT_BUCKET_MB, scope: str = "tensor", **kwargs):
            method = factory(*args, **kwargs)
            return GradientCompression(method.compressor, method.memory, method.collective, bucket_mb, scope)

        _FACTORIES[name] = make
        _GRACE_PARAMS[name] = {**_COMMON_PARAMS, **grace_params}
        return make

    return decorate


def methods():
    return sorted(_FACTORIES)


def create(name: str, **kwargs) -> GradientCompression:
    if name not in _FACTORIES:
        raise ValueError(f"unknown compression method {name!r}; available: {', '.join(methods())}")
    return _FACTORIES[name](**kwargs)


def from_params(params: dict) -> GradientCompression:
    """Build a method from the original GRACE parameter dictionary, e.g.
    ``{'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather', 'compress_ratio': 0.01}``."""
    params = dict(params)
    if "compressor" not in params:
        raise ValueError("params needs a 'compressor' key naming the method")
    name = params.pop("compressor")
    if name not in _FACTORIES:
        raise ValueError(f"unknown compression method {name!r}; available: {', '.join(methods())}")
    accepted = _GRACE_PARAMS[name]
    kwargs = {}
    for key, value in params.items():
        if key in _IGNORED_PARAMS:
            continue
        if key not in accepted:
            raise ValueError(f"{name} does not take parameter {key!r}; it takes {', '.join(sorted(accepted))}")
        kwargs[accepted[key]] = value
    return create(name, **kwargs)
