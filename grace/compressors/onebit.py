"""1-bit SGD (Seide et al. 2014): one bit per element and the two means it decodes to.

    compress: bit = (x >= 0); mu1 = mean(x[bit]), mu0 = mean(x[not bit])
    decode:   mu1 where bit else mu0
"""
from dataclasses import replace

from grace.compressors.sign_bits import SignBits
from grace.core import bits, segments
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
        means = self.scalars_of(xp, flat, segments.whole(xp, xp.numel(flat), flat))
        return (bits.pack(xp, flat >= 0, 1), means), Shape(xp.shape(x), xp.dtype(x))

    def scalars_of(self, xp, flat, table):
        """Per segment of ``flat`` (a tensor, or a bucket's gradients): mu0 and mu1 (a segment's
        pair after another's)."""
        positive = flat >= 0
        n_pos = xp.segment_sum(xp.cast(positive, "float32"), table.counts)
        sum_pos = xp.segment_sum(xp.where(positive, flat, flat * 0), table.counts)
        mu1 = sum_pos / xp.clip_min(n_pos, 1)
        mu0 = (xp.segment_sum(flat, table.counts) - sum_pos) / xp.clip_min(table.counts_at_least_one(xp) - n_pos, 1)
        return xp.flatten(xp.transpose(xp.reshape(xp.concat([mu0, mu1]), (2, -1))))

    def ideal_bits(self, xp, payload, ctx):
        return ctx.numel + 64  # bits + two means

    def decompress(self, xp, payload, ctx):
        packed, means = payload
        fused = xp.native("onebit_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, means, ctx.numel), ctx.shape)
        values = self.values(xp, bits.unpack(xp, packed, 1, ctx.numel), means, segments.whole(xp, ctx.numel, packed))
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)

    def values(self, xp, positive, means, table):
        """Element by element: mu1 where the unpacked bit is set, else mu0, of its segment's means."""
        pairs = xp.reshape(means, (-1, 2))
        mu0, mu1 = pairs[:, 0], pairs[:, 1]
        return table.per_element(xp, mu0) + xp.cast(positive, "float32") * table.per_element(xp, mu1 - mu0)


@register("onebit")
def onebit(*, memory="residual", communicator=None) -> GradientCompression:
    """1-bit SGD: 1 bit per element plus two float32 means, with residual memory."""
    return GradientCompression(OneBit(), make_memory(memory), communicator)
