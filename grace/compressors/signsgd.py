"""signSGD (Bernstein et al. 2018): one sign bit per element.

    compress:  bit = (x >= 0), packed 8 to a byte
    decode:    2 * bit - 1  in {-1, +1}
    aggregate: majority vote sign(sum_i decode_i) = sign(2 * count_i(bit_i) - n)  (or, with
               aggregate='mean', their mean)
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor, Shape, Traits
from grace.core.registry import example, register
from grace.formats import packed_size
from grace.memories import make_memory


class SignSGD(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(elementwise=True, new_payload=True)

    def __init__(self, aggregate: str = "majority"):
        if aggregate not in ("majority", "mean"):
            raise ValueError(f"aggregate must be 'majority' or 'mean', got {aggregate!r}")
        self.aggregate_by = aggregate

    def compress(self, xp, x, info):
        fused = xp.native("signsgd_compress", x, xp.dtype(x))  # one pass, when built
        packed = fused(x) if fused else bits.pack(xp, xp.flatten(x) >= 0, 1)
        return (packed,), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return ctx.numel

    def decompress(self, xp, payload, ctx):
        fused = xp.native("signsgd_decompress", payload[0], ctx.dtype)
        if fused:
            return xp.reshape(fused(payload[0], ctx.numel), ctx.shape)
        signs = xp.cast(bits.unpack(xp, payload[0], 1, ctx.numel), ctx.dtype) * 2 - 1
        return xp.reshape(signs, ctx.shape)

    def aggregate(self, xp, payloads, ctx):
        """The majority vote from all ranks' bits at once: an element's count c of + bits gives
        the sum of the ranks' +-1, 2c - n, exactly (integers), so its sign is the vote the
        decoded sum gives, in a few operations however many ranks there are."""
        if self.aggregate_by == "mean":
            return super().aggregate(xp, payloads, ctx)
        n, row = len(payloads), packed_size(ctx.numel, 1)
        planes = bits.unpack(xp, xp.concat([xp.flatten(payload[0]) for payload in payloads]), 1, n * row * 8)
        ones = xp.sum(xp.reshape(planes, (n, row * 8))[:, :ctx.numel], axis=0)
        return xp.reshape(xp.cast(xp.sign(ones * 2 - n), ctx.dtype), ctx.shape)

    def finish(self, n):
        # the majority: the sign of a sum of +-1 (never -0.0), which is the mean's sign
        return (False, (n,)) if self.aggregate_by == "mean" else (True, ())


@register("signsgd", aggregate="aggregate", examples=dict(signsgd=example(), signsgd_mean=example("mean")))
def signsgd(aggregate: str = "majority", *, memory="none", communicator=None) -> GradientCompression:
    """signSGD: 1 bit per element; majority vote (or mean) of the ranks' signs."""
    return GradientCompression(SignSGD(aggregate), make_memory(memory), communicator)
