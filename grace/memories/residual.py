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

    def absorb(self, xp, residual, extra):
        if self.beta == 0.0:
            return None
        return residual + (extra if self.beta == 1.0 else extra / self.beta)
