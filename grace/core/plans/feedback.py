"""Error feedback's fast paths, registered per memory class: a memory's steps written into
buffers the exchange keeps (no gradient-sized allocation per step), or fused with a method's
compression into one kernel pass. A memory with none registered runs its formula
(``Memory.compensate`` / ``update``) in every plan: ``Feedback`` is that formula, for buffers.

    @feedback_for(ResidualMemory)
    class ResidualFeedback(Feedback): ...       (grace/kernels/residual.py)

Each fast path returns None where it does not run (this device, dtype or configuration); the
plan then runs the formula. ``kernels``: the method's fast paths (``grace.core.plans.kernels``),
which a fused step runs with the memory's own.
"""
from __future__ import annotations

from typing import Any, Optional

from grace.core.plans.by_class import ByClass


class Feedback:
    """A memory's formula, for buffers; no fused step."""

    def __init__(self, memory):
        self.memory = memory

    def compensate_into(self, xp, g, state: Optional[Any], out):
        """``compensate`` written into ``out`` (a buffer like the state, on a backend whose
        tensors are mutable); None where it cannot (the caller then calls ``compensate``)."""
        return None

    def update_into(self, xp, p, p_hat, state: Optional[Any], out):
        """``update`` written into ``out``, for a ``p`` that ``compensate_into`` gave."""
        return self.memory.update(xp, p, p_hat, state)

    def compensate_many_into(self, xp, gs, states, outs):
        """``compensate_into`` of several gradients (one multi-tensor operation where it can)."""
        return [self.compensate_into(xp, g, state, out) for g, state, out in zip(gs, states, outs)]

    def update_many_into(self, xp, ps, p_hats, states, outs):
        """``update_into`` of several gradients (one multi-tensor operation where it can)."""
        return [self.update_into(xp, p, p_hat, state, out) for p, p_hat, state, out in zip(ps, p_hats, states, outs)]

    def feedback_into(self, xp, kernels, p, payload, ctx, state: Optional[Any], out):
        """``update`` with this rank's decompressed payload, written into ``out``."""
        return self.update_into(xp, p, kernels.compressor.decompress(xp, payload, ctx), state, out)

    def fused_step(self, xp, kernels, g, state: Optional[Any], info, out=None):
        """compensate, compress and update in one go: (payload, ctx, new state), or None.
        ``out``: where the kernel may write the new state."""
        return None

    def fused_steps(self, xp, kernels, gs, states, infos, outs, flag=None, into=None, defer=False):
        """``fused_step`` of every gradient of a bucket in one call, the new states written into
        ``outs``: a list of (payload, ctx, new state), or None. ``flag`` (optional, a one-element
        float32 tensor): the call writes the bucket's overflow flag there (1 where any gradient
        holds an inf or a NaN), with no pass of its own. ``into`` (optional): where the call
        writes the payload tensors, if it can (the exchange's frame buffer; a variable-length
        payload written there is handed back as Nones). ``defer``: a new
        state may be a ``Deferred`` one whose buffer is its out (for a caller that keeps each
        state as it comes: the states may be such ones too)."""
        return None

    def fused_segments(self, xp, kernels, g, state: Optional[Any], table, infos, nonfinite=None, into=None):
        """``fused_step`` for every segment of a flat bucket: (fields, ctx, new state), or None;
        the overflow flag into ``nonfinite`` where ``kernels.flags_in_segment_steps``; the fields
        None where written into the frame ``into`` (``kernels.pairs_into_frames``)."""
        return None

    def selected_segments(self, xp, kernels, g, state: Optional[Any], table, infos, nonfinite=None):
        """A variable-length selection of every segment with its compensation, in one call
        (``MethodKernels.select_segments_with_residual``), or None."""
        return None

    def fused_firsts(self, xp, kernels, gs, states, infos, compressor_states, p_outs, nonfinite=None, places=None):
        """A multi-round method's compensations written into ``p_outs`` in the passes that make
        the first payloads, where the compressor has a kernel for it (``nonfinite`` set where a
        g holds an inf or a NaN): the first payloads (None where not made), whose rounds write
        the new states over p themselves; or None. ``places``: as ``MethodKernels.rounds_many``'."""
        return None


_REGISTRY = ByClass(Feedback)
#: register the decorated ``Feedback`` subclass for the given memory classes (and their subclasses)
feedback_for = _REGISTRY.register
#: the feedback of a memory: those registered for its class (or the nearest base), else ``Feedback``
feedback_of = _REGISTRY.of
