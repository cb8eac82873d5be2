"""Residual error feedback (GRACE's default memory, Xu et al. 2021, eq. 3-4).

    p = beta * e + gamma * g      (compensate)
    e = p - Q^-1(Q(p))            (update)

The state ``e`` is one tensor per gradient, in gradient units, on the gradient's device.
"""
from grace.core.compressor import check_number
from grace.core.memory import Memory


class ResidualMemory(Memory):
    needs_feedback = True
    elementwise = True

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        self.beta = check_number(beta, "beta")
        self.gamma = check_number(gamma, "gamma")

    def init(self, xp, g):
        return xp.zeros_like(g)

    def compensate(self, xp, g, residual):
        p = g if self.gamma == 1.0 else g * self.gamma
        return p + (residual if self.beta == 1.0 else residual * self.beta)

    def update(self, xp, p, p_hat, residual):
        return p - p_hat

    def compensate_into(self, xp, g, residual, out):
        if residual is None or self.beta != 1.0:
            return None
        scaled = g if self.gamma == 1.0 else xp.multiply_into(g, self.gamma, out)  # (g * gamma, as compensate)
        return xp.add_into(scaled, residual, out)

    def update_into(self, xp, p, p_hat, residual, out):
        return xp.subtract_into(p, p_hat, out)

    # several at once: one multi-tensor operation on an accelerator (the same sums)
    def compensate_many_into(self, xp, gs, residuals, outs):
        if self.beta != 1.0 or self.gamma != 1.0 or any(e is None for e in residuals):
            return super().compensate_many_into(xp, gs, residuals, outs)
        return xp.add_many_into(gs, residuals, outs)

    def update_many_into(self, xp, ps, p_hats, residuals, outs):
        if any(out is not p for p, out in zip(ps, outs)):
            return super().update_many_into(xp, ps, p_hats, residuals, outs)
        return xp.subtract_many_into(ps, p_hats)

    def feedback_into(self, xp, compressor, p, payload, ctx, residual, out):
        fused = compressor.residual_into(xp, p, payload, ctx, out)  # p - p_hat in one pass, where it can
        return super().feedback_into(xp, compressor, p, payload, ctx, residual, out) if fused is None else fused

    def fused_segments(self, xp, compressor, g, residual, table, infos):
        return compressor.compress_segments_with_residual(xp, g, residual, self.beta, self.gamma, table, infos)

    def fused_steps(self, xp, compressor, gs, residuals, infos, outs, flag=None, into=None):
        return compressor.compress_many_with_residual(xp, gs, residuals, self.beta, self.gamma, infos, outs, flag,
                                                      into)

    def fused_firsts(self, xp, compressor, gs, residuals, infos, compressor_states, p_outs, nonfinite=None):
        return compressor.firsts_with_residual(xp, gs, residuals, self.beta, self.gamma, infos, compressor_states,
                                               p_outs, nonfinite)

    def fused_step(self, xp, compressor, g, residual, info, out=None):
        return compressor.compress_with_residual(xp, g, residual, self.beta, self.gamma, info, out)
