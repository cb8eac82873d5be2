"""A traced step that follows the world it runs in (Horovod's elastic training).

A ``tf.function`` traced with grace holds its world in the graph: the average's divisor, the
shards of the two-phase plan, the payloads an allgather brings, ``'auto'``'s choice. Horovod's
elastic training changes rank and size under a running function, and TensorFlow would run the
old trace for ever (its trace cache is keyed on the arguments only), where Horovod's own
allreduce reads the size when it runs. So while grace is traced it records the trace caches of
the ``tf.function``s being traced (one per function, nested ones included), with the world of the
trace; after each elastic reset (``follow``) it empties those traced in another world. Their next
call traces the step again at the new rank and size; the exchange's state lives on in its
variables, so nothing a rank remembers is lost. No user code changes: Horovod's own elastic
examples run with only their compression line changed.
"""
from __future__ import annotations

import sys
import weakref
from typing import Dict, Iterator, Tuple

from tensorflow.python.eager.polymorphic_function import tracing_compilation

World = Tuple[int, int]  # (rank, size)

# TensorFlow's tracing entry point: each frame of it on the stack holds the TracingOptions (and so
# the trace cache) of one tf.function being traced. TensorFlow has no public way to drop a
# function's traces; this is the one place grace reaches into it.
_TRACE_FUNCTION = tracing_compilation.trace_function.__code__

# id(trace cache): (a weak reference to the TracingOptions that hold it, the world it was traced in)
_TRACED: Dict[int, tuple] = {}


def _options_being_traced() -> Iterator[object]:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _TRACE_FUNCTION:
            options = frame.f_locals.get("tracing_options")
            if getattr(options, "function_cache", None) is not None:
                yield options
        frame = frame.f_back


def record(world: World) -> int:
    """Called while grace is traced: the tf.functions being traced are traced again once the
    world is no longer ``world``. How many were found (none: the graph keeps its size check)."""
    found = 0
    for options in _options_being_traced():  # (weakly: a function gone takes its traces along)
        _TRACED[id(options.function_cache)] = (weakref.ref(options), world)
        found += 1
    return found


def follow(world: World) -> int:
    """After an elastic reset: every function traced in another world than ``world`` drops its
    traces. How many did."""
    dropped = 0
    for key, (ref, traced_in) in list(_TRACED.items()):
        options = ref()
        if options is not None and traced_in != world:
            options.function_cache.clear()
            dropped += 1
        if options is None or traced_in != world:
            del _TRACED[key]
    return dropped
