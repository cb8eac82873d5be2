"""The Memory role of the GRACE pipeline: error feedback (docs/methods.md).

    state = init(g)                   # before a tensor's first step
    p     = compensate(g, state)      # phi
    state = update(p, p_hat, state)   # psi, with p_hat = decompress(compress(p))

A Memory object holds only configuration. Its state (one entry per tensor and rank) is passed
in and returned, so the caller can keep it (in a dict, or in tf.Variables created from
``init``), save it in a checkpoint and restore it exactly.
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

    def compensate_into(self, xp, g, state: Optional[Any], out):
        """``compensate`` written into ``out`` (a buffer like the state, on a backend whose
        tensors are mutable), so that no step allocates a gradient-sized tensor; None where
        this memory cannot (the caller then calls ``compensate``)."""
        return None

    def update_into(self, xp, p, p_hat, state: Optional[Any], out):
        """``update`` written into ``out``, for a ``p`` that ``compensate_into`` gave."""
        return self.update(xp, p, p_hat, state)

    def compensate_many_into(self, xp, gs, states, outs):
        """``compensate_into`` of several gradients (a memory may do them at once)."""
        return [self.compensate_into(xp, g, state, out) for g, state, out in zip(gs, states, outs)]

    def update_many_into(self, xp, ps, p_hats, states, outs):
        """``update_into`` of several gradients (a memory may do them at once)."""
        return [self.update_into(xp, p, p_hat, state, out) for p, p_hat, state, out in zip(ps, p_hats, states, outs)]

    def feedback_into(self, xp, compressor, p, payload, ctx, state: Optional[Any], out):
        """``update`` with this rank's decompressed payload, written into ``out``."""
        return self.update_into(xp, p, compressor.decompress(xp, payload, ctx), state, out)

    def fused_segments(self, xp, compressor, g, state: Optional[Any], table, infos):
        """``fused_step`` for every segment of a flat bucket (``Compressor.segmented``):
        (fields, ctx, new state), or None."""
        return None

    def fused_steps(self, xp, compressor, gs, states, infos, outs, flag=None, into=None):
        """``fused_step`` of every gradient of a bucket in one call, the new states written
        into ``outs``: a list of (payload, ctx, new state), or None. ``flag`` (optional, a
        one-element float32 tensor): where it runs, the call writes the bucket's overflow flag
        into it (1 where any gradient holds an inf or a NaN), with no pass of its own.
        ``into`` (optional): where the call writes the payload tensors, if it can
        (``grace.native._placed``: the exchange's frame buffer)."""
        return None

    def fused_firsts(self, xp, compressor, gs, states, infos, compressor_states, p_outs, nonfinite=None):
        """A multi-round method's compensations written into ``p_outs`` in the passes that make
        the first payloads, where the compressor has a kernel for it (``firsts_with_residual``):
        the first payloads (None where not made: those are compensated as usual), whose rounds
        write the new states over p themselves; or None."""
        return None

    def fused_step(self, xp, compressor, g, state: Optional[Any], info, out=None):
        """compensate, compress and update in one go where the compressor has a kernel for it:
        (payload, ctx, new state), or None. ``out``: where the kernel may write the new state."""
        return None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({params})"
