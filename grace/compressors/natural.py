"""Natural compression (Horváth et al. 2019): stochastic rounding to a power of two, unbiased.

    a = 2^floor(log2 |x|)
    |out| = 2a with probability (|x| - a) / a, else a;  out keeps the sign of x

Each element is a sign bit (packed 8 to a byte) and an 8-bit exponent code: code c >= 1 is
2^(c - 127), code 0 is zero. Below 2^-126 the two neighbours are 0 and 2^-126, so the
rounding stays unbiased there too.

Both are read off the float's bits, exactly on every backend: a's code is |x|'s biased
exponent (0 for zero and the subnormals), and (|x| - a) / a is its mantissa over 2^23 (for a
subnormal, |x| / 2^-126 is too). A code's value is the float whose exponent field it is.
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.registry import register
from grace.memories import make_memory

_TOP = 254  # 2^127: the largest power of two a float32 holds (a code is an exponent field)
_MANTISSA = 2**23  # one unit of a float32's exponent field, read as an integer


class Natural(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True, seeded=True)

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
        field = xp.from_bytes(xp.to_bytes(xp.abs(flat)), "int32")
        low_code = xp.shift_right(field, 23)  # 0 .. 255 (255: inf, NaN)
        fraction = xp.cast(field - low_code * _MANTISSA, "float32") * (1.0 / _MANTISSA)
        codes = xp.minimum(low_code + xp.cast(u < fraction, "int32"), _TOP)  # 2^128 is not a float32
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
        field = xp.cast(codes, "int32") * _MANTISSA + xp.cast(negative, "int32") * -2**31  # (the sign bit)
        return xp.from_bytes(xp.to_bytes(field), "float32")


@register("natural", seed="seed")
def natural(*, seed: int = 0, memory="none", communicator=None) -> GradientCompression:
    """Natural compression: 9 bits per element (sign and exponent), unbiased."""
    return GradientCompression(Natural(seed), make_memory(memory), communicator)
