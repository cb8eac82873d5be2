"""Deep Gradient Compression's memory (Lin et al. 2018): momentum correction and factor masking.

    u = m * u + g          momentum, accumulated locally instead of in the optimizer
    v = v + u              what is sent is selected from v
    after sending:  v = v - sent;  u = 0 where sent   (momentum factor masking)

With ``clip_norm``, g is first scaled to norm at most clip_norm (DGC's local clipping).
State per tensor: (u, v). Use it with an optimizer without momentum: this is the momentum.
"""
from grace.core.compressor import check_number, native_or_none
from grace.core.memory import Memory


class DGCMemory(Memory):
    needs_feedback = True

    def __init__(self, momentum: float = 0.9, clip_norm: float = 0.0):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        check_number(clip_norm, "clip_norm", note=" (0: no clipping)")
        self.momentum = float(momentum)
        self.clip_norm = float(clip_norm)

    @property
    def elementwise(self) -> bool:  # (clipping scales each tensor by its own norm)
        return not self.clip_norm

    def init(self, xp, g):
        return xp.zeros_like(g), xp.zeros_like(g)

    def _clipped(self, xp, g):
        return g * self._clip_factor(xp, g) if self.clip_norm else g

    def _clip_factor(self, xp, g):
        """clip_norm / max(|g|, clip_norm), in g's dtype."""
        return xp.cast(self.clip_norm / xp.clip_min(xp.norm(g), self.clip_norm), xp.dtype(g))

    def compensate(self, xp, g, state):
        u, v = state
        return v + (self.momentum * u + self._clipped(xp, g))

    def update(self, xp, p, p_hat, state):
        u = p - state[1]  # p = v_old + u_new
        sent = p_hat != 0
        return xp.where(sent, u * 0, u), p - p_hat

    def fused_steps(self, xp, compressor, gs, states, infos, outs, flag=None, into=None):
        """fused_step of a whole bucket in one native call, where the compressor has one (DGC's
        selection, on a CPU); with clipping, each gradient's factor computed first (its norm, as
        ``_clipped`` does) and applied where the call reads g: no clipped copy."""
        many = getattr(compressor, "compress_many_with_momentum", None)
        if many is None or not xp.mutable_tensors:
            return None
        factor = (lambda g: self._clip_factor(xp, g)) if self.clip_norm else None
        return many(xp, gs, states, self.momentum, infos, outs, flag, factor)

    def fused_step(self, xp, compressor, g, state, info, out=None):
        """The same step with the new (u, v) written into ``out`` (buffers like the state, where
        the backend's tensors are mutable): p in v's buffer, u = p - v_old in u's, and only the
        sent elements changed after (their p_hat is 0 + p, so they need no dense decompression).
        One pass over memory for the sums on a CPU (a native kernel; four of tensor ops
        elsewhere), and no gradient-sized allocation."""
        if out is None or not xp.mutable_tensors or not compressor.sparse:
            return None
        (u, v), (u_out, v_out) = state, out
        g = self._clipped(xp, g)
        # the three sums in one pass, where built
        u_new, p = native_or_none(xp, "dgc_compensate_into", g, u, v, g, self.momentum, u_out, v_out) or (None, None)
        if p is None:
            t = xp.add_into(xp.multiply_into(u, self.momentum, u_out), g, u_out)  # m u + g
            p = xp.add_into(v, t, v_out)
        payload, ctx = compressor.compress(xp, p, info)
        values, indices = payload
        u_new = xp.subtract_into(p, v, u_out) if u_new is None else u_new
        indices = xp.cast(indices, "int64")
        p_hat = values + 0.0  # the decompressed payload at the sent elements
        sent_u = xp.gather(xp.flatten(u_new), indices)
        xp.put(xp.flatten(u_new), indices, xp.where(p_hat != 0, sent_u * 0, sent_u))
        xp.put(xp.flatten(p), indices, values - p_hat)  # v = p - p_hat
        return payload, ctx, (u_out, v_out)
