"""TernGrad (Wen et al. 2017): three levels {-s, 0, s}, unbiased.

    s = max|x|;  b ~ Bernoulli(|x| / s)        (docs/methods.md: |x|, not x)
    out = s * sign(x) * b

Codes 0 (zero), 1 (+s), 2 (-s) at 2 bits; s travels as one float32.
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.registry import register
from grace.memories import make_memory


class TernGrad(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True)

    def __init__(self, seed: int = 0):
        self.seed = check_seed(seed)

    def compress(self, xp, x, info):
        seed = info.rank_seed(self.seed)
        native = compressed_natively(xp, "terngrad_compress", x, seed, lambda: xp.numel(x))
        if native is not None:
            return native, Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        u = xp.uniform(xp.numel(flat), seed, like=flat)
        scale = xp.max(xp.abs(flat))
        safe = xp.where(scale > 0, scale, scale + 1)
        keep = u < xp.abs(flat) / safe
        codes = xp.cast(keep, "uint8") * (1 + xp.cast(flat < 0, "uint8"))
        return (bits.pack(xp, codes, 2), xp.reshape(scale, (1,))), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return 2 * ctx.numel + 32  # codes + scale

    def decompress(self, xp, payload, ctx):
        packed, scale = payload
        fused = xp.native("terngrad_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, scale, ctx.numel), ctx.shape)
        codes = bits.unpack(xp, packed, 2, ctx.numel)
        signed = xp.cast(codes > 0, "float32") - 2 * xp.cast(codes > 1, "float32")  # 0, +1, -1
        return xp.reshape(xp.cast(signed * scale[0], ctx.dtype), ctx.shape)


@register("terngrad", seed="seed")
def terngrad(*, seed: int = 0, memory="none", communicator=None) -> GradientCompression:
    """TernGrad: 2 bits per element plus max|x|, unbiased."""
    return GradientCompression(TernGrad(seed), make_memory(memory), communicator)
