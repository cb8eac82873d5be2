"""INCEPTIONN-style error-bounded lossy floats (Li et al. 2018): each element gets the fewest
bits that keep its error within the bound.

    tag 0:  |x| <= bound                     0 bits, decodes to 0
    tag 1:  x ~ q * 2 * bound, |q| <= 127    8 bits (int8 q)
    tag 2:  x ~ float16(x)                   16 bits
    tag 3:  x                                32 bits (float32, exact)

A tag is chosen only if the decoded value is within ``error_bound`` of x, checked on the
exact value the receiver will decode. Tags are packed at 2 bits; each stream holds its
elements in index order, so the tags alone say where every value goes.
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_number, Collective, Compressor, Shape, Traits
from grace.core.registry import example, register
from grace.memories import make_memory


class Inceptionn(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(variable_length=True)

    def __init__(self, error_bound: float = 2.0**-12):
        self.error_bound = check_number(error_bound, "error_bound", strict=True)

    def compress(self, xp, x, info):
        flat = xp.cast(xp.flatten(x), "float32")
        bound, step = self.error_bound, 2 * self.error_bound
        q = xp.round(flat / step)
        fits8 = (xp.abs(q) <= 127) & (xp.abs(flat - q * step) <= bound)
        fits16 = xp.abs(flat - xp.cast(xp.cast(flat, "float16"), "float32")) <= bound  # False for inf
        tags = xp.where(xp.abs(flat) <= bound, q * 0,
                        xp.where(fits8, q * 0 + 1, xp.where(fits16, q * 0 + 2, q * 0 + 3)))
        streams = [xp.gather(v, xp.nonzero(tags == t)) for t, v in ((1, q), (2, flat), (3, flat))]
        payload = (bits.pack(xp, tags, 2), xp.cast(streams[0], "int8"), xp.cast(streams[1], "float16"),
                   streams[2])
        return payload, Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return 2 * ctx.numel + sum(bits * xp.numel(t) for bits, t in zip((8, 16, 32), payload[1:]))

    def decompress(self, xp, payload, ctx):
        packed, int8s, halves, fulls = payload
        tags = bits.unpack(xp, packed, 2, ctx.numel)
        out = xp.zeros(ctx.numel, "float32", like=fulls)
        for tag, values in ((1, xp.cast(int8s, "float32") * (2 * self.error_bound)),
                            (2, xp.cast(halves, "float32")), (3, fulls)):
            out = out + xp.scatter_add(xp.nonzero(tags == tag), values, ctx.numel)
        return xp.reshape(xp.cast(out, ctx.dtype), ctx.shape)


@register("inceptionn", error_bound="error_bound", examples=dict(inceptionn=example(0.01)))
def inceptionn(error_bound: float = 2.0**-12, *, memory="none", communicator=None) -> GradientCompression:
    """Error-bounded lossy floats: 2-bit tag plus 0, 8, 16 or 32 bits per element."""
    return GradientCompression(Inceptionn(error_bound), make_memory(memory), communicator)
