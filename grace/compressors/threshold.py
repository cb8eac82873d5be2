"""Hard-threshold sparsification (Sahu et al. 2021, docs/methods.md): keep every element with |x| >= threshold.

The number kept, k_t, varies per step and per rank and may be zero; the exchange sends each
rank's length with its payload. grace compresses gradients, so the memory is in gradient units
and the threshold applies to p = g + e: this is the paper's lr * C(p / lr) with its memory
expressed in gradient units, which needs no rescaling when the learning rate changes.
"""
from dataclasses import replace

from grace.compressors.sparse import Sparsifier
from grace.core.compression import GradientCompression
from grace.core.compressor import check_number
from grace.core.registry import example, register
from grace.memories import make_memory


class Threshold(Sparsifier):
    traits = replace(Sparsifier.traits, variable_length=True)

    def __init__(self, threshold: float):
        self.threshold = check_number(threshold, "threshold")

    def kernel_argument(self, numel: int) -> float:
        return self.threshold

    def select(self, xp, flat, info):
        return xp.indices_abs_at_least(flat, self.threshold)

    def select_segments(self, xp, p, table, infos):
        return xp.abs(p) >= self.threshold


@register("threshold", threshold="threshold", grace_defaults=dict(threshold=256.0),
          examples=dict(threshold=example(0.5)))
def threshold(threshold: float, *, memory="residual", communicator=None) -> GradientCompression:
    """Hard threshold: every element with ``|x|`` >= threshold, with its index, by allgather."""
    return GradientCompression(Threshold(threshold), make_memory(memory), communicator)
