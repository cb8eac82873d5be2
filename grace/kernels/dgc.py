"""DGC memory's fast paths: the momentum correction written into the exchange's buffers with
only the sent elements changed after selecting, one native pass for the sums on a CPU, and a
whole bucket in one native call where the compressor has one (DGC's selection).
"""
from grace.core.compressor import native_or_none
from grace.core.plans.feedback import Feedback, feedback_for
from grace.memories import DGCMemory


@feedback_for(DGCMemory)
class DGCFeedback(Feedback):
    def fused_steps(self, xp, kernels, gs, states, infos, outs, flag=None, into=None, defer=False):
        """fused_step of a whole bucket in one native call, where the compressor has one (DGC's
        selection, on a CPU); with clipping, each gradient's factor computed first (its norm, as
        ``clipped`` does) and applied where the call reads g: no clipped copy."""
        many = getattr(kernels, "compress_many_with_momentum", None)
        if many is None or not xp.mutable_tensors:
            return None
        factor = (lambda g: self.memory.clip_factor(xp, g)) if self.memory.clip_norm else None
        return many(xp, gs, states, self.memory.momentum, infos, outs, flag, factor, into)

    def fused_segments(self, xp, kernels, g, state, table, infos, nonfinite=None, into=None):
        """The segment-wise step of a flat bucket in native calls, where the compressor has them
        (DGC's selection): (fields, ctx, new (u, v)), or None."""
        segments = getattr(kernels, "compress_segments_with_momentum", None)
        if segments is None or self.memory.clip_norm or state is None:
            return None
        return segments(xp, g, state, self.memory.momentum, table, infos, nonfinite, into)

    def fused_step(self, xp, kernels, g, state, info, out=None):
        """The same step with the new (u, v) written into ``out`` (buffers like the state, where
        the backend's tensors are mutable): p in v's buffer, u = p - v_old in u's, and only the
        sent elements changed after (their p_hat is 0 + p, so they need no dense decompression).
        One pass over memory for the sums on a CPU (a native kernel; four of tensor ops
        elsewhere), and no gradient-sized allocation."""
        if out is None or not xp.mutable_tensors or not kernels.compressor.traits.sparse:
            return None
        (u, v), (u_out, v_out), momentum = state, out, self.memory.momentum
        g = self.memory.clipped(xp, g)
        # the three sums in one pass, where built
        u_new, p = native_or_none(xp, "dgc_compensate_into", g, u, v, g, momentum, u_out, v_out) or (None, None)
        if p is None:
            t = xp.add_into(xp.multiply_into(u, momentum, u_out), g, u_out)  # m u + g
            p = xp.add_into(v, t, v_out)
        payload, ctx = kernels.compressor.compress(xp, p, info)
        values, indices = payload
        u_new = xp.subtract_into(p, v, u_out) if u_new is None else u_new
        indices = xp.cast(indices, "int64")
        p_hat = values + 0.0  # the decompressed payload at the sent elements
        sent_u = xp.gather(xp.flatten(u_new), indices)
        xp.put(xp.flatten(u_new), indices, xp.where(p_hat != 0, sent_u * 0, sent_u))
        xp.put(xp.flatten(p), indices, values - p_hat)  # v = p - p_hat
        return payload, ctx, (u_out, v_out)
