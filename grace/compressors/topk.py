"""Top-k sparsification: keep the k = max(1, ceil(ratio * d)) largest magnitudes.

Indices are sent sorted. Every rank sends the same k, so allgather needs no lengths.
"""
from dataclasses import replace

from grace.compressors.sparse import Sparsifier
from grace.core.compressor import check_ratio, sent_count
from grace.core.compression import GradientCompression
from grace.core.registry import example, register
from grace.memories import make_memory


class TopK(Sparsifier):
    traits = replace(Sparsifier.traits, nonfinite_field=0)

    def __init__(self, ratio: float):
        self.ratio = check_ratio(ratio)

    def kernel_argument(self, d: int) -> int:
        return sent_count(self.ratio, d)  # k

    def select(self, xp, flat, info):
        return xp.sort(xp.topk_indices(xp.abs(flat), self.kernel_argument(xp.numel(flat))))


@register("topk", compress_ratio="ratio", grace_defaults=dict(compress_ratio=0.3), examples=dict(topk=example(0.1)))
def topk(ratio: float, *, memory="residual", communicator=None) -> GradientCompression:
    """Top-k: the ceil(ratio * d) largest magnitudes, with their indices, by allgather."""
    return GradientCompression(TopK(ratio), make_memory(memory), communicator)
