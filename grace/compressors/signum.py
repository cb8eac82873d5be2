"""Signum (Bernstein et al. 2018): signSGD on a local momentum, majority vote.

    m = beta * m + (1 - beta) * g          (per-tensor compressor state, starts at 0)
    send sign(m) at 1 bit; aggregate: sign of the sum of the ranks' signs

The optimizer should then run without its own momentum: this one is the method's.
"""
from dataclasses import replace

from grace.compressors.signsgd import SignSGD
from grace.core.compression import GradientCompression
from grace.core.registry import register
from grace.memories import make_memory


class Signum(SignSGD):
    traits = replace(SignSGD.traits, elementwise=False)  # its momentum is per-tensor state, saved by name

    def __init__(self, momentum: float = 0.9, aggregate: str = "majority"):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        super().__init__(aggregate)
        self.momentum = float(momentum)

    def init_state(self, xp, x, info):
        return xp.zeros_like(x)

    def step(self, xp, x, info, m):
        m = self.momentum * m + (1 - self.momentum) * x
        payload, ctx = self.compress(xp, m, info)
        return payload, ctx, m


@register("signum", momentum="momentum", aggregate="aggregate")
def signum(momentum: float = 0.9, *, aggregate: str = "majority", memory="none",
           communicator=None) -> GradientCompression:
    """Signum: the sign of a local momentum, 1 bit per element, majority vote."""
    return GradientCompression(Signum(momentum, aggregate), make_memory(memory), communicator)
