"""The Memory role of the GRACE pipeline: error feedback (docs/methods.md).

    state = init(g)                   # before a tensor's first step
    p     = compensate(g, state)      # phi
    state = update(p, p_hat, state)   # psi, with p_hat = decompress(compress(p))

A Memory object holds only configuration. Its state (one entry per tensor and rank) is passed
in and returned, so the caller can keep it (in a dict, or in tf.Variables created from
``init``), save it in a checkpoint and restore it exactly.

Its fast paths (steps written into kept buffers, or fused with a method's compression into one
kernel pass) are not part of the role: they are registered per memory class beside the plans
that use them (``grace.core.plans.feedback``).
"""
from __future__ import annotations

from typing import Any, Optional


class Memory:
    """Base class: no error feedback."""

    #: update() needs p_hat, so the pipeline must decompress the rank's own payload
    needs_feedback: bool = False
    #: each element's state depends on that element alone (a bucket's memories can be one
    #: flat tensor updated at once)
    elementwise: bool = False
    #: p = g and nothing is kept: a compressor may read the gradients as they are
    passes_gradient: bool = False

    def fits(self, compressor) -> bool:
        """Whether this memory's formula applies to ``compressor``'s payloads (checked when a
        method is built)."""
        return True

    def init(self, xp, g) -> Optional[Any]:
        """The state before the first step (None: this memory keeps none for ``g``)."""
        return None

    def compensate(self, xp, g, state: Optional[Any]):
        return g

    def update(self, xp, p, p_hat, state: Optional[Any]) -> Optional[Any]:
        return None

    def absorb(self, xp, state: Optional[Any], extra) -> Optional[Any]:
        """The state whose ``compensate`` gives ``extra`` more (what a bucket's two-phase owner
        had not sent yet, handed back when the bucket leaves the two phases); None where this
        memory cannot hold it."""
        return None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({params})"


class Deferred:
    """A state whose last operation is left to the pass that next reads it (PowerSGD's residual
    e = M - P Q^T: the next step's first product reads M anyway, so e is never written, two
    passes over the gradients fewer a step). ``buffer``: the tensor that holds it (the exchange
    writes the next state into a spare buffer like it); ``value()``: the state made now, a new
    tensor (what a checkpoint saves and ``Exchange.memory`` shows)."""

    buffer: Any

    def value(self):
        raise NotImplementedError


def stored(state):
    """``state`` as the tensor (or tuple of them, or None) it stands for: a Deferred one made now."""
    return state.value() if isinstance(state, Deferred) else state


def buffer_of(state):
    """The tensor (or tuple of them) that holds ``state``."""
    return state.buffer if isinstance(state, Deferred) else state
