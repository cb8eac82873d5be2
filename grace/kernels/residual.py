"""Residual memory's fast paths: its steps written into the exchange's buffers (one
multi-tensor operation for several, on an accelerator), and fused with a method's compression
where the compressor has a kernel for it (compensate, compress and the new residual in one pass).
"""
from grace.core.plans.feedback import Feedback, feedback_for
from grace.memories import ResidualMemory


@feedback_for(ResidualMemory)
class ResidualFeedback(Feedback):
    def compensate_into(self, xp, g, residual, out):
        beta, gamma = self._scales()
        if residual is None or beta != 1.0:
            return None
        scaled = g if gamma == 1.0 else xp.multiply_into(g, gamma, out)  # (g * gamma, as compensate)
        return xp.add_into(scaled, residual, out)

    def update_into(self, xp, p, p_hat, residual, out):
        return xp.subtract_into(p, p_hat, out)

    # several at once: one multi-tensor operation on an accelerator (the same sums)
    def compensate_many_into(self, xp, gs, residuals, outs):
        if self._scales() != (1.0, 1.0) or any(e is None for e in residuals):
            return super().compensate_many_into(xp, gs, residuals, outs)
        return xp.add_many_into(gs, residuals, outs)

    def update_many_into(self, xp, ps, p_hats, residuals, outs):
        if any(out is not p for p, out in zip(ps, outs)):
            return super().update_many_into(xp, ps, p_hats, residuals, outs)
        return xp.subtract_many_into(ps, p_hats)

    def feedback_into(self, xp, kernels, p, payload, ctx, residual, out):
        fused = kernels.residual_into(xp, p, payload, ctx, out)  # p - p_hat in one pass, where it can
        return super().feedback_into(xp, kernels, p, payload, ctx, residual, out) if fused is None else fused

    def fused_segments(self, xp, kernels, g, residual, table, infos, nonfinite=None, into=None):
        return kernels.compress_segments_with_residual(xp, g, residual, *self._scales(), table, infos, nonfinite,
                                                       into)

    def selected_segments(self, xp, kernels, g, residual, table, infos, nonfinite=None):
        return kernels.select_segments_with_residual(xp, g, residual, *self._scales(), table, infos, nonfinite)

    def fused_steps(self, xp, kernels, gs, residuals, infos, outs, flag=None, into=None, defer=False):
        deferring = {"defer": True} if defer and kernels.defers_residual else {}
        return kernels.compress_many_with_residual(xp, gs, residuals, *self._scales(), infos, outs, flag, into,
                                                   **deferring)

    def fused_firsts(self, xp, kernels, gs, residuals, infos, compressor_states, p_outs, nonfinite=None,
                     places=None):
        return kernels.firsts_with_residual(xp, gs, residuals, *self._scales(), infos, compressor_states, p_outs,
                                            nonfinite, places)

    def fused_step(self, xp, kernels, g, residual, info, out=None):
        return kernels.compress_with_residual(xp, g, residual, *self._scales(), info, out)

    def _scales(self):
        """(beta, gamma): p = gamma * g + beta * e."""
        return self.memory.beta, self.memory.gamma
