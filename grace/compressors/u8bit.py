"""8-bit quantization (Dettmers 2016): a per-tensor scale and one minifloat code per element.

    s = max|x| / 0.96875          (so the largest magnitude is a code exactly)
    y = |x| / s in [0, 0.96875]  ->  nearest of the 128 minifloat magnitudes:
        exponent field E in 1..7:  (1 + m/16) * 2^(E - 8)     m = 4 mantissa bits
        E = 0 (subnormal):         (m/16) * 2^-7
    code = 128 * (x < 0) + 16 * E + m

Rounding to the nearest code in each binade; a mantissa that rounds up to 16 carries into the
exponent field, which is the next binade's first code, so one formula covers every y.
"""
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor, Shape
from grace.core.floats import floor_log2
from grace.core.registry import register
from grace.memories import make_memory

_TOP = 0.96875  # (1 + 15/16) * 2^-1: the largest magnitude code
_SUBNORMAL = 2.0 ** -7  # below it, codes are linear steps of 2^-11


class U8Bit(Compressor):
    collective = Collective.ALLGATHER

    def compress(self, xp, x, info):
        flat = xp.cast(xp.flatten(x), "float32")
        magnitude = xp.abs(flat)
        scale = xp.max(magnitude) / _TOP
        y = magnitude / xp.where(scale > 0, scale, scale + 1)
        field = floor_log2(xp, y, lowest=-8) + 8  # E, for y >= 2^-7 (1..7)
        normal = field * 16 + xp.round((y * xp.exp2(8 - field) - 1) * 16)
        code = xp.where(y < _SUBNORMAL, xp.round(y * 2.0**11), normal)
        code = xp.where(code > 127, code * 0 + 127, code) + 128 * xp.cast(flat < 0, "float32")
        return (xp.cast(code, "uint8"), xp.reshape(scale, (1,))), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return 8 * ctx.numel + 32  # codes + scale

    def decompress(self, xp, payload, ctx):
        codes, scale = payload
        codes = xp.cast(codes, "float32")
        negative = xp.floor(codes / 128)
        field = xp.floor((codes - 128 * negative) / 16)
        mantissa = codes - 128 * negative - 16 * field
        magnitude = xp.where(field > 0, (1 + mantissa / 16) * xp.exp2(field - 8), mantissa * 2.0**-11)
        return xp.reshape(xp.cast((1 - 2 * negative) * magnitude * scale[0], ctx.dtype), ctx.shape)


@register("u8bit")
def u8bit(*, memory="residual", communicator=None) -> GradientCompression:
    """8-bit minifloat quantization with a per-tensor scale, with residual memory."""
    return GradientCompression(U8Bit(), make_memory(memory), communicator)
