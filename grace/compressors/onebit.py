"""1-bit SGD (Seide et al. 2014): one bit per element and the two means it decodes to.

    compress: bit = (x >= 0); mu1 = mean(x[bit]), mu0 = mean(x[not bit])
    decode:   mu1 where bit else mu0
"""
from dataclasses import replace

from grace.compressors.sign_bits import SignBits
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import Shape
from grace.core.registry import register
from grace.memories import make_memory


class OneBit(SignBits):
    scalars = 2  # mu0, mu1
    traits = replace(SignBits.traits, nonfinite_field=1)  # the means

    def compress(self, xp, x, info):
        fused = xp.native("onebit_compress", x, xp.dtype(x))  # one pass, when built
        if fused:
            return fused(x), Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        positive = flat >= 0
        n_pos = xp.sum(xp.cast(positive, "float32"))
        sum_pos = xp.sum(xp.where(positive, flat, flat * 0))
        mu1 = sum_pos / xp.clip_min(n_pos, 1)
        mu0 = (xp.sum(flat) - sum_pos) / xp.clip_min(xp.numel(flat) - n_pos, 1)
        means = xp.concat([xp.reshape(mu0, (1,)), xp.reshape(mu1, (1,))])
        return (bits.pack(xp, positive, 1), means), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return ctx.numel + 64  # bits + two means

    def decompress(self, xp, payload, ctx):
        packed, means = payload
        fused = xp.native("onebit_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, means, ctx.numel), ctx.shape)
        bit = xp.cast(bits.unpack(xp, packed, 1, ctx.numel), "float32")
        mu0, mu1 = means[0], means[1]
        return xp.reshape(xp.cast(mu0 + bit * (mu1 - mu0), ctx.dtype), ctx.shape)


@register("onebit")
def onebit(*, memory="residual", communicator=None) -> GradientCompression:
    """1-bit SGD: 1 bit per element plus two float32 means, with residual memory."""
    return GradientCompression(OneBit(), make_memory(memory), communicator)
