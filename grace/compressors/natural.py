"""Natural compression (Horváth et al. 2019): stochastic rounding to a power of two, unbiased.

    a = 2^floor(log2 |x|)
    |out| = 2a with probability (|x| - a) / a, else a;  out keeps the sign of x

Each element is a sign bit (packed 8 to a byte) and an 8-bit exponent code: code c >= 1 is
2^(c - 127), code 0 is zero. Below 2^-126 the two neighbours are 0 and 2^-126, so the
rounding stays unbiased there too.
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.floats import floor_log2
from grace.core.registry import register
from grace.memories import make_memory

_BIAS = 127  # code = exponent + 127, as in IEEE single precision
_TOP = 254  # 2^127: the largest power of two a float32 holds


class Natural(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True)

    def __init__(self, seed: int = 0):
        self.seed = check_seed(seed)

    def compress(self, xp, x, info):
        seed = info.rank_seed(self.seed)
        native = compressed_natively(xp, "natural_compress", x, seed, lambda: xp.numel(x))
        if native is not None:
            return native, Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        negative, codes = self.codes(xp, flat, xp.uniform(xp.numel(flat), seed, like=flat))
        return (bits.pack(xp, negative, 1), codes), Shape(xp.shape(x), xp.dtype(x))

    def codes(self, xp, flat, u):
        """Element by element (a bucket's segments at once as well): the sign bits (x < 0) and
        the exponent codes of a float32 ``flat``, from its draws ``u``."""
        magnitude = xp.abs(flat)
        low_code = floor_log2(xp, magnitude, lowest=-_BIAS) + _BIAS  # 0 .. 254
        low = xp.where(low_code > 0, xp.exp2(low_code - _BIAS), magnitude * 0)
        high = xp.exp2(low_code + 1 - _BIAS)
        up = u < (magnitude - low) / (high - low)
        codes = low_code + xp.cast(up, "float32")
        codes = xp.where(codes > _TOP, codes * 0 + _TOP, codes)  # 2^128 is not a float32
        return flat < 0, xp.cast(codes, "uint8")

    def ideal_bits(self, xp, payload, ctx):
        return 9 * ctx.numel  # sign + exponent

    def decompress(self, xp, payload, ctx):
        negative, codes = payload
        fused = xp.native("natural_decompress", codes, ctx.dtype)
        if fused:
            return xp.reshape(fused(negative, codes, ctx.numel), ctx.shape)
        values = self.values(xp, bits.unpack(xp, negative, 1, ctx.numel), codes)
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)

    def values(self, xp, negative, codes):
        """Element by element: the float32 values of the unpacked sign bits and the codes."""
        codes = xp.cast(codes, "float32")
        magnitude = xp.where(codes > 0, xp.exp2(codes - _BIAS), codes * 0)
        return (1 - 2 * xp.cast(negative, "float32")) * magnitude


@register("natural", seed="seed")
def natural(*, seed: int = 0, memory="none", communicator=None) -> GradientCompression:
    """Natural compression: 9 bits per element (sign and exponent), unbiased."""
    return GradientCompression(Natural(seed), make_memory(memory), communicator)
