"""No compression: the gradient travels as it is, summed by allreduce."""
from grace.core.compressor import Collective, Compressor, Shape, Traits
from grace.core.compression import GradientCompression
from grace.core.registry import register
from grace.memories import make_memory


class NoneCompressor(Compressor):
    collective = Collective.ALLREDUCE
    traits = Traits(supports_allreduce=True, elementwise=True, unbiased=True, passes_nonfinite=True)

    def compress(self, xp, x, info):
        return (xp.flatten(x),), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return 32 * ctx.numel  # float32

    def decompress(self, xp, payload, ctx):
        return xp.reshape(payload[0], ctx.shape)


@register("none")
def none(*, memory="none", communicator=None) -> GradientCompression:
    """No compression (32 bits per element), exchanged by allreduce."""
    return GradientCompression(NoneCompressor(), make_memory(memory), communicator)
