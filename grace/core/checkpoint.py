"""What an exchange's saved state may hold, checked before any of it is loaded.

A state names the method that saved it (its compressor and memory classes): another method's
memory means something else, so it is refused rather than carried into the wrong formula.
Each value is held against the gradient it belongs to, where the exchange knows that gradient:
the layout the method's own ``init`` gives (shapes, None or a tuple), the gradient's dtype,
finite numbers; a step counter is an integer in [0, 2**40). Every refusal is a ``ValueError``
that names the parameter and what to do.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

from grace.core.tensors import get_backend
from grace.core import portable
from grace.core.compressor import TensorInfo

#: no run takes 2**40 steps; a larger (or negative) counter is a corrupted checkpoint
STEP_LIMIT = 2**40


def method_of(compression) -> Dict[str, str]:
    """What a saved state records of the method that saved it."""
    return {"compressor": type(compression.compressor).__name__, "memory": type(compression.memory).__name__}


@dataclass(frozen=True)
class Leaf:
    """One tensor of a saved value."""

    shape: tuple
    dtype: str

    def __str__(self) -> str:
        return str(list(self.shape))


def _layout(value) -> Any:
    """None, a Leaf, or a tuple of those: what a state value (on the host) is made of."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple(_layout(v) for v in value)
    value = np.asarray(value)
    return Leaf(tuple(value.shape), value.dtype.name)


def _shapes(layout):
    return tuple(map(_shapes, layout)) if isinstance(layout, tuple) else getattr(layout, "shape", None)


def _dtypes(layout):
    if isinstance(layout, tuple):
        return [d for part in layout for d in _dtypes(part)]
    return [] if layout is None else [layout.dtype]


def _shown(layout) -> str:
    if isinstance(layout, tuple):
        return "(" + ", ".join(map(_shown, layout)) + ")"
    return "nothing" if layout is None else str(layout)


def _check_step(name: str, value) -> None:
    host = np.asarray(portable.on_host(value))
    ok = host.shape == () and (host.dtype.kind in "iu") and 0 <= int(host) < STEP_LIMIT
    if not ok:
        raise ValueError(f"grace: the checkpoint's step counter of {name!r} is {value!r}; a counter is an integer "
                         f"in [0, 2**40). The checkpoint is damaged: load another, or leave out its 'steps'")


def _check_finite(table: str, name: str, value) -> None:
    for part in value if isinstance(value, (tuple, list)) else (value,):
        if part is None:
            continue
        host = np.asarray(part)
        if host.dtype.kind == "f" or host.dtype.name == "bfloat16":
            if not np.isfinite(host.astype(np.float64)).all():
                raise ValueError(f"grace: the checkpoint's {table} of {name!r} holds an inf or a NaN; it would "
                                 "poison every later step. Load a checkpoint saved before the overflow, or leave "
                                 f"out its {table!r}")


def check_method(saved: Optional[Dict[str, str]], compression) -> None:
    mine = method_of(compression)
    if saved is not None and dict(saved) != mine:
        raise ValueError(f"grace: this checkpoint was saved by {saved['compressor']} with {saved['memory']}, and "
                         f"this optimizer runs {mine['compressor']} with {mine['memory']}: its state means "
                         "something else here. Build the optimizer with the method that saved it, or start "
                         "this one without grace's state (drop the checkpoint's 'grace' entry)")


def check_state(state: Dict[str, Dict[str, Any]], compression, tensors: Iterable[Tuple[str, tuple, str]],
                per_name_state: bool) -> None:
    """Raise a ValueError where ``state`` (tables of name -> value) cannot be this exchange's.
    ``tensors``: the (name, shape, dtype) of the gradients the exchange knows (none yet: only
    counters and finiteness are checked). ``per_name_state``: whether compressor state is kept
    per gradient name (not per bucket, as with ``scope='bucket'``)."""
    known = {name: (tuple(shape), str(dtype)) for name, shape, dtype in tensors}
    xp = get_backend("numpy")
    for table, values in state.items():
        for name, value in values.items():
            if table == "steps":
                _check_step(name, value)
                continue
            if value is None:
                continue
            value = portable.on_host(value)  # (once: a device's tensors are read back here)
            _check_finite(table, name, value)
            if not known or (table == "state" and not per_name_state):
                continue
            if name not in known:
                raise ValueError(f"grace: the checkpoint holds {table} for {name!r}, which is no parameter of this "
                                 f"optimizer (it has {', '.join(sorted(known)[:8])}{', ...' if len(known) > 8 else ''}); "
                                 "load the checkpoint of this model, or leave that entry out")
            shape, dtype = known[name]
            template = xp.zeros(int(np.prod(shape)), dtype).reshape(shape)
            if table == "memory":
                want = _layout(compression.memory.init(xp, template))
            elif table == "owner":  # (the two-phase exchange's memory of the shard a rank owns)
                want = _layout(template)
            else:
                want = _layout(compression.compressor.init_state(xp, template, TensorInfo(name, 0, 1)))
            got = _layout(value)
            if want is None or _shapes(want) != _shapes(got):
                raise ValueError(f"grace: the checkpoint's {table} of {name!r} has the layout {_shown(got)}, and this "
                                 f"optimizer's {name!r} needs {_shown(want)} (a gradient of shape {shape}); load the "
                                 "checkpoint of this model and method, or leave that entry out")
            if _dtypes(want) != _dtypes(got):
                raise ValueError(f"grace: the checkpoint's {table} of {name!r} is {', '.join(_dtypes(got))}, and this "
                                 f"optimizer keeps {', '.join(_dtypes(want))} there (a {dtype} gradient); cast the "
                                 "saved values, or leave that entry out")


def check_origin(origin, state: Dict[str, Dict[str, Any]], rank: int, size: int, process: str,
                 shared_state: bool) -> None:
    """The rule for a state saved elsewhere (``origin``: its rank, world size and process).
    Another rank's memory is that rank's unsent gradient: loaded on every rank it would be sent n
    times, so it is dropped (and per-rank method state with it, unless the method's state is
    ``shared_state``) with a warning; this rank starts with empty memory. Another world size
    keeps everything, with a warning. A state this very ``process`` saved (an elastic reset, a
    state kept in memory) is its own, whatever its rank was."""
    if not origin or origin.get("process") == process:
        return
    saved_rank, saved_size = int(origin["rank"]), int(origin["size"])
    if saved_rank != rank:
        state["memory"], state["owner"] = {}, {}
        if not shared_state:
            state["state"] = {}
        warnings.warn(f"grace: this checkpoint holds rank {saved_rank}'s error-feedback memory; rank {rank} starts "
                      "with empty memory instead (save and load one checkpoint per rank to keep it)", RuntimeWarning,
                      stacklevel=3)
    elif saved_size != size:
        warnings.warn(f"grace: this checkpoint was saved in a world of {saved_size} ranks, this one has {size}; its "
                      "memory is loaded as it is", RuntimeWarning, stacklevel=3)
