"""TernGrad (Wen et al. 2017): three levels {-s, 0, s}, unbiased.

    s = max|x|;  b ~ Bernoulli(|x| / s)        (docs/methods.md: |x|, not x)
    out = s * sign(x) * b

Codes 0 (zero), 1 (+s), 2 (-s) at 2 bits; s travels as one float32.
"""
import numpy as np

from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.registry import register
from grace.core.tensors import constant
from grace.memories import make_memory


class TernGrad(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True, seeded=True)

    def __init__(self, seed: int = 0):
        self.seed = check_seed(seed)

    def compress(self, xp, x, info):
        seed = info.rank_seed(self.seed)
        native = compressed_natively(xp, "terngrad_compress", x, seed, lambda: xp.numel(x))
        if native is not None:
            return native, Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        magnitude = xp.abs(flat)
        scale = xp.max(magnitude)
        codes = self.codes(xp, flat, magnitude, xp.uniform(xp.numel(flat), seed, like=flat), self.safe(xp, scale))
        return (bits.pack(xp, codes, 2), xp.reshape(scale, (1,))), Shape(xp.shape(x), xp.dtype(x))

    @staticmethod
    def safe(xp, scale):
        """The scale to divide by: 1 where it is 0 (then every |x| is 0, and no code is kept)."""
        return xp.where(scale > 0, scale, scale + 1)

    @staticmethod
    def codes(xp, flat, magnitude, u, safe):
        """Element by element (a bucket's segments at once as well, each element with its own
        segment's ``safe`` scale): the 2-bit codes of ``flat``, from its draws ``u``."""
        keep = u < magnitude / safe
        return xp.cast(keep, "uint8") * (1 + xp.cast(flat < 0, "uint8"))

    def ideal_bits(self, xp, payload, ctx):
        return 2 * ctx.numel + 32  # codes + scale

    def decompress(self, xp, payload, ctx):
        packed, scale = payload
        fused = xp.native("terngrad_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, scale, ctx.numel), ctx.shape)
        values = self.values(xp, bits.unpack(xp, packed, 2, ctx.numel), scale[0])
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)

    @staticmethod
    def values(xp, codes, scale):
        """Element by element: the float32 values of the codes, each at its ``scale``."""
        signs = constant(xp, "terngrad signs", lambda: xp.asarray(np.float32([0, 1, -1]), like=codes), codes)
        return xp.gather(signs, codes) * scale  # codes 0, 1, 2: 0, +s, -s


@register("terngrad", seed="seed")
def terngrad(*, seed: int = 0, memory="none", communicator=None) -> GradientCompression:
    """TernGrad: 2 bits per element plus max|x|, unbiased."""
    return GradientCompression(TernGrad(seed), make_memory(memory), communicator)
