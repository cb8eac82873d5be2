"""Half precision: cast to float16 (or bfloat16), 16 bits per element.

Each rank pre-divides by n before the cast so that the sum of n half-precision payloads
cannot overflow where each one alone did not; decompress multiplies back, so Q^-1(Q(x)) ~ x.
Both steps write their result directly (one rounding, no full-size float32 temporary).
"""
from grace.core.compressor import Collective, Compressor, Shape, Traits
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

    def ideal_bits(self, xp, payload, ctx):
        return 16 * ctx[0].numel

    def decompress(self, xp, payload, ctx):
        shape, n = ctx
        return xp.reshape(xp.cast_multiply(payload[0], shape.dtype, n), shape.shape)


@register("fp16", dtype="dtype", examples=dict(fp16=example(), bf16=example("bfloat16")))
def fp16(dtype: str = "float16", *, memory="none", communicator=None) -> GradientCompression:
    """Half precision (16 bits per element): ``dtype`` is 'float16' or 'bfloat16'."""
    return GradientCompression(FP16(dtype), make_memory(memory), communicator)
