"""Half precision: cast to float16 (or bfloat16), 16 bits per element.

Each rank pre-divides by n before the cast so that the sum of n half-precision payloads
cannot overflow where each one alone did not; decompress multiplies back, so Q^-1(Q(x)) ~ x.
Both steps write their result directly (one rounding, no full-size float32 temporary).
"""
from grace.core.compressor import Collective, Compressor, native_or_none, Shape, Traits
from grace.core.compression import GradientCompression
from grace.core.registry import example, register
from grace.memories import make_memory


class FP16(Compressor):
    collective = Collective.ALLREDUCE
    traits = Traits(supports_allreduce=True, elementwise=True, passes_nonfinite=True)

    def __init__(self, dtype: str = "float16"):
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
        self.dtype = dtype

    def compress(self, xp, x, info):
        n = info.world_size
        return (xp.divide_cast(xp.flatten(x), n, self.dtype),), (Shape(xp.shape(x), xp.dtype(x)), n)

    def compress_many_into(self, xp, gs, infos, buffer):
        if self.dtype != "float16" or not xp.fused("fp16_compress_many_into", gs[0], xp.dtype(gs[0])):
            return None
        numels = [xp.numel(g) for g in gs]
        pieces = xp.split(buffer(self.dtype, sum(numels)), numels)
        n = infos[0].world_size
        if native_or_none(xp, "fp16_compress_many_into", gs[0], gs, n, pieces) is None:
            return None
        return [((piece,), (Shape(xp.shape(g), xp.dtype(g)), n)) for piece, g in zip(pieces, gs)]

    def averaged_many(self, xp, summed, ctxs, n, outs):
        factors = {factor for _, factor in ctxs}
        if len(factors) != 1:
            return None
        return native_or_none(xp, "fp16_decompress_many_into", outs[0], [payload[0] for payload in summed],
                              factors.pop(), n, outs)

    def ideal_bits(self, xp, payload, ctx):
        return 16 * ctx[0].numel

    def decompress(self, xp, payload, ctx):
        shape, n = ctx
        return xp.reshape(xp.cast_multiply(payload[0], shape.dtype, n), shape.shape)


@register("fp16", dtype="dtype", examples=dict(fp16=example(), bf16=example("bfloat16")))
def fp16(dtype: str = "float16", *, memory="none", communicator=None) -> GradientCompression:
    """Half precision (16 bits per element): ``dtype`` is 'float16' or 'bfloat16'."""
    return GradientCompression(FP16(dtype), make_memory(memory), communicator)
