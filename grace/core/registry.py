"""Methods by name: each method file registers its factory, and the arguments it is tried
with, in one decorator line.

    @register("qsgd", quantum_num="levels", bucket_size="bucket_size",
              examples=dict(qsgd=example(4), qsgd_bucketed=example(127, bucket_size=64)))
    def qsgd(levels: int = 127, *, bucket_size: int = 0, ...) -> GradientCompression: ...

The examples are what the test catalogues run every method with (labelled as their test ids);
the one labelled with the method's name is its main one. What a method is (its collective,
variable-length payload, rounds, unbiasedness) its compressor says (see ``Compressor``).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

from grace.core.compression import DEFAULT_BUCKET_MB, GradientCompression

#: where grace's own methods live; the others (plug-ins, test fixtures) register from elsewhere
SHIPPED = "grace.compressors"
# Keys of GRACE's parameter dictionary that every method accepts; world_size comes from Horovod.
_COMMON_PARAMS = {"memory": "memory", "communicator": "communicator", "bucket_mb": "bucket_mb", "scope": "scope",
                  "warmup_steps": "warmup_steps"}
_IGNORED_PARAMS = {"world_size"}
# GRACE's dictionary without a compressor: no compression. Without a memory or communicator a method
# keeps its own (its error feedback, 'auto'), where GRACE's helper would take none and allreduce,
# which drops error feedback and cannot carry the allgather methods.
_GRACE_DEFAULTS = {"compressor": "none"}
_GRACE_NAMES: Dict[str, str] = {}  # GRACE's method name -> grace's, where they differ
_BUCKET_KEYWORDS = [inspect.Parameter("bucket_mb", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_BUCKET_MB,
                                      annotation=float),
                    inspect.Parameter("scope", inspect.Parameter.KEYWORD_ONLY, default="tensor", annotation=str),
                    inspect.Parameter("warmup_steps", inspect.Parameter.KEYWORD_ONLY, default=0, annotation=int)]
_BUCKET_DOC = """

``bucket_mb``: gradients travel in buckets of up to this many MB, one collective each (0: each
gradient on its own). ``scope``: 'tensor' compresses each gradient of a bucket as its own tensor,
'bucket' the whole bucket as one. ``warmup_steps``: the first steps send every gradient
uncompressed, by a plain allreduce, and leave the memory untouched."""


@dataclass(frozen=True)
class Example:
    """Arguments a method's factory is tried with."""

    args: tuple = ()
    kwargs: Mapping = field(default_factory=dict)


def example(*args, **kwargs) -> Example:
    return Example(args, kwargs)


@dataclass(frozen=True)
class Method:
    name: str
    factory: Callable[..., GradientCompression]
    #: GRACE dictionary key -> the factory's keyword, or a call turning the value into keywords
    grace_params: Dict[str, Any]
    examples: Dict[str, Example]
    #: values for keys a GRACE dictionary leaves out, as GRACE's own helper fills them in
    grace_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def module(self) -> str:
        return self.factory.__module__

    def make(self, label: Optional[str] = None) -> Callable[[], GradientCompression]:
        """A call that builds the method with the example ``label`` (default: its main one)."""
        chosen = self.examples[label or self.name]
        return functools.partial(self.factory, *chosen.args, **chosen.kwargs)


_METHODS: Dict[str, Method] = {}


def register(name: str, *, examples: Optional[Dict[str, Example]] = None, grace_name: Optional[str] = None,
             grace_defaults: Optional[Mapping[str, Any]] = None, **grace_params):
    """Register a factory under ``name``; ``grace_params`` maps GRACE dictionary keys to its
    keyword arguments (e.g. ``compress_ratio="ratio"``, or a call from the value to keywords);
    ``grace_name`` is GRACE's name for the method where it differs, ``grace_defaults`` the
    values GRACE's helper gives keys a dictionary leaves out, for the arguments the factory
    requires; ``examples`` labels the arguments the tests try it with, one labelled ``name``
    among them (default: ``{name: example()}``, the factory's defaults). The registered factory
    also takes ``bucket_mb=``, ``scope=`` and ``warmup_steps=`` (see ``GradientCompression``)."""
    examples = dict(examples or {name: example()})
    if name not in examples:
        raise ValueError(f"{name}: one of its examples must be labelled {name!r} (its main one)")
    taken = {label: m.name for m in _METHODS.values() if m.name != name for label in m.examples}
    clashes = sorted(label for label in examples if label in taken)
    if clashes:
        raise ValueError(f"{name}: example labels {clashes} are taken by {sorted({taken[c] for c in clashes})}")

    def decorate(factory):
        @functools.wraps(factory)
        def make(*args, bucket_mb: float = DEFAULT_BUCKET_MB, scope: str = "tensor", warmup_steps: int = 0,
                 **kwargs):
            method = factory(*args, **kwargs)
            communicator = "auto" if method.auto else method.collective
            return GradientCompression(method.compressor, method.memory, communicator, bucket_mb, scope, warmup_steps)

        # help() and the API reference show the keywords every method takes
        signature = inspect.signature(factory)
        make.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *_BUCKET_KEYWORDS])
        make.__doc__ = (factory.__doc__ or "").rstrip() + _BUCKET_DOC
        _METHODS[name] = Method(name, make, {**_COMMON_PARAMS, **grace_params}, examples, dict(grace_defaults or {}))
        if grace_name:
            _GRACE_NAMES[grace_name] = name
        return make

    return decorate


def _registered(package: Optional[str]):
    return [_METHODS[name] for name in sorted(_METHODS)
            if package is None or (_METHODS[name].module + ".").startswith(package + ".")]


def methods(package: Optional[str] = SHIPPED):
    """The names of the methods registered from ``package`` (default: grace's own; None: every
    registered method, plug-ins and test fixtures included)."""
    return [method.name for method in _registered(package)]


def examples(package: Optional[str] = None, *, method: Optional[str] = None) -> Dict[str, Callable[[], Any]]:
    """label -> a call that builds that example, for every example of the methods registered
    from ``package`` (None: all of them), or of ``method`` alone; methods in name order."""
    chosen = [_METHODS[method]] if method else _registered(package)
    return {label: m.make(label) for m in chosen for label in m.examples}


def factory(name: str) -> Callable[..., GradientCompression]:
    if name not in _METHODS:
        raise ValueError(f"unknown compression method {name!r}; available: {', '.join(methods())}")
    return _METHODS[name].factory


def create(name: str, **kwargs) -> GradientCompression:
    return factory(name)(**kwargs)


def from_params(params: Mapping[str, Any]) -> GradientCompression:
    """Build a method from a GRACE parameter dictionary, e.g. ``{'compressor': 'topk', 'memory':
    'residual', 'communicator': 'allgather', 'compress_ratio': 0.01}``, with GRACE's key names and
    defaults: a setting grace's factory requires takes, when left out, the value GRACE's helper
    gives it (top-k's ratio 0.3, ...), any other the method's own default (its memory, 'auto'),
    ``{}`` is no compression, and ``world_size`` is Horovod's. A key the
    method does not take raises ``ValueError`` naming the key and the keys it takes."""
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a dict of GRACE parameters, got {type(params).__name__}")
    given = {**_GRACE_DEFAULTS, **params}
    grace_name = given.pop("compressor")
    name = _GRACE_NAMES.get(grace_name, grace_name)
    method = _METHODS.get(name) or factory(name)  # (factory: the unknown name's error)
    given = {**method.grace_defaults, **given}
    kwargs = {}
    for key, value in given.items():
        if key in _IGNORED_PARAMS:
            continue
        if key not in method.grace_params:
            raise ValueError(f"{name} does not take parameter {key!r}; it takes "
                             f"{', '.join(sorted(method.grace_params))}")
        target = method.grace_params[key]
        kwargs.update(target(value) if callable(target) else {target: value})
    required = [p.name for p in inspect.signature(method.factory).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD and p.name not in kwargs]
    if required:
        keys = [key for key, target in method.grace_params.items() if target in required]
        raise ValueError(f"{name} needs {' and '.join(map(repr, keys or required))} in the dictionary")
    return method.factory(**kwargs)
