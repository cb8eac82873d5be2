"""Random-k sparsification: k = max(1, ceil(ratio * d)) elements chosen at random.

All ranks draw the same indices from a seed shared for this (tensor, step), so only the k
values travel and they are summed by allreduce.
With ``scale=True`` the values are multiplied by d/k, which makes the estimate unbiased.
"""
import functools

from grace.core.compression import GradientCompression
from grace.core.compressor import check_ratio, check_seed, Collective, Compressor, sent_count, Shape, Traits
from grace.core.registry import example, register
from grace.memories import make_memory


class RandomK(Compressor):
    collective = Collective.ALLREDUCE

    def __init__(self, ratio: float, scale: bool = False, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.scale = bool(scale)
        self.seed = check_seed(seed)

    @functools.cached_property
    def traits(self) -> Traits:
        # unbiased: scaled by d/k (made once: read per gradient and step)
        return Traits(supports_allreduce=True, new_payload=True, unbiased=self.scale, seeded=True)

    def compress(self, xp, x, info):
        flat = xp.flatten(x)
        d = xp.numel(flat)
        k = sent_count(self.ratio, d)
        indices = xp.random_indices(d, k, info.seed(self.seed), like=flat)
        values = xp.gather(flat, indices)
        if self.scale and k:
            values = values * (d / k)
        return (values,), (Shape(xp.shape(x), xp.dtype(x)), indices)

    def ideal_bits(self, xp, payload, ctx):
        return 32 * xp.numel(payload[0])  # values only: the indices come from the shared seed

    def decompress(self, xp, payload, ctx):
        shape, indices = ctx
        return xp.reshape(xp.scatter_add(indices, payload[0], shape.numel), shape.shape)


@register("randomk", compress_ratio="ratio", scale="scale", seed="seed", grace_defaults=dict(compress_ratio=0.3),
          examples=dict(randomk=example(0.1), randomk_scaled=example(0.1, scale=True)))
def randomk(ratio: float, *, scale: bool = False, seed: int = 0, memory="residual",
            communicator=None) -> GradientCompression:
    """Random-k: ceil(ratio * d) elements at indices drawn from a seed all ranks share."""
    return GradientCompression(RandomK(ratio, scale, seed), make_memory(memory), communicator)
