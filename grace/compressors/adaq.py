"""Adaptive quantization (Dryden et al. 2016): the largest fraction of each sign, at its mean.

    P = the ceil(ratio * #positive) largest positive elements, N likewise for the negative
    send the indices of P and of N, and mean(P), mean(N)
    decode: mean(P) at P, mean(N) at N, 0 elsewhere
"""
from grace.core.compression import GradientCompression
from grace.core.compressor import check_ratio, Collective, Compressor, index_bits, index_dtype, Shape, Traits
from grace.core.registry import example, register
from grace.memories import make_memory


class AdaQ(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(variable_length=True)

    def __init__(self, ratio: float):
        self.ratio = check_ratio(ratio)

    def _side(self, xp, flat, members):
        """Sorted indices of the largest ``ratio`` of ``flat[members]`` and their mean."""
        values = xp.gather(flat, members)
        k = xp.ceil(self.ratio * xp.sum(xp.cast(members >= 0, "float32")))  # a count, maybe dynamic
        chosen = xp.sort(xp.gather(members, xp.topk_indices(values, k)))
        return chosen, xp.sum(xp.gather(flat, chosen)) / xp.clip_min(k, 1)

    def compress(self, xp, x, info):
        flat = xp.cast(xp.flatten(x), "float32")
        positive, pos_mean = self._side(xp, flat, xp.nonzero(flat > 0))
        negative, neg_mean = self._side(xp, -flat, xp.nonzero(flat < 0))
        means = xp.cast(xp.concat([xp.reshape(pos_mean, (1,)), xp.reshape(-neg_mean, (1,))]), "float32")
        dtype = index_dtype(xp.numel(flat))
        return (xp.cast(positive, dtype), xp.cast(negative, dtype), means), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return (xp.numel(payload[0]) + xp.numel(payload[1])) * index_bits(ctx.numel) + 64

    def decompress(self, xp, payload, ctx):
        positive, negative, means = payload
        values = xp.concat([xp.zeros(xp.numel(positive), "float32", like=means) + means[0],
                            xp.zeros(xp.numel(negative), "float32", like=means) + means[1]])
        indices = xp.concat([xp.cast(positive, "int64"), xp.cast(negative, "int64")])
        return xp.reshape(xp.cast(xp.scatter_add(indices, values, ctx.numel), ctx.dtype), ctx.shape)


@register("adaq", compress_ratio="ratio", examples=dict(adaq=example(0.1)))
def adaq(ratio: float = 0.01, *, memory="residual", communicator=None) -> GradientCompression:
    """AdaQ: the top ``ratio`` of the positive and of the negative elements, each at its mean."""
    return GradientCompression(AdaQ(ratio), make_memory(memory), communicator)
