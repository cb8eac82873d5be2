"""Deep Gradient Compression's memory (Lin et al. 2018): momentum correction and factor masking.

    u = m * u + g          momentum, accumulated locally instead of in the optimizer
    v = v + u              what is sent is selected from v
    after sending:  v = v - sent;  u = 0 where sent   (momentum factor masking)

With ``clip_norm``, g is first scaled to norm at most clip_norm (DGC's local clipping).
State per tensor: (u, v). Use it with an optimizer without momentum: this is the momentum.
"""
from grace.core.compressor import check_number
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

    def clipped(self, xp, g):
        return g * self.clip_factor(xp, g) if self.clip_norm else g

    def clip_factor(self, xp, g):
        """clip_norm / max(|g|, clip_norm), in g's dtype."""
        return xp.cast(self.clip_norm / xp.clip_min(xp.norm(g), self.clip_norm), xp.dtype(g))

    def compensate(self, xp, g, state):
        u, v = state
        return v + (self.momentum * u + self.clipped(xp, g))

    def absorb(self, xp, state, extra):
        u, v = state
        return u, v + extra

    def update(self, xp, p, p_hat, state):
        u = p - state[1]  # p = v_old + u_new
        sent = p_hat != 0
        return xp.where(sent, u * 0, u), p - p_hat
