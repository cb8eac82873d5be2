"""EF-signSGD (Karimireddy et al. 2019): scaled sign with error feedback in model units.

    p    = lr * g + e                    (memory 'efsignsgd': residual with gamma = lr)
    C(p) = (||p||_1 / d) * sign(p)       1 bit per element + one float32
    e    = p - C(p)
    g_hat = mean_i C(p_i) / lr           back to gradient units for the optimizer

``lr`` must be the optimizer's learning rate.
"""
from dataclasses import replace

from grace.compressors.sign_bits import SignBits
from grace.core import bits, segments
from grace.core.compression import GradientCompression
from grace.core.compressor import Shape, check_number
from grace.core.registry import example, register
from grace.memories import EFSignSGDMemory, make_memory


class EFSignSGD(SignBits):
    traits = replace(SignBits.traits, nonfinite_field=1)  # the scale

    def __init__(self, lr: float):
        self.lr = check_number(lr, "lr", strict=True, note=" (the optimizer's learning rate)")

    def compress(self, xp, x, info):
        fused = xp.native("efsignsgd_compress", x, xp.dtype(x))  # one pass, when built
        if fused:
            return fused(x), Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        scale = self.scalars_of(xp, flat, segments.whole(xp, xp.numel(flat), flat))
        return (bits.pack(xp, flat >= 0, 1), scale), Shape(xp.shape(x), xp.dtype(x))

    def scalars_of(self, xp, flat, table):
        """Per segment of ``flat`` (a tensor, or a bucket's gradients): its scale ||x||_1 / d."""
        return xp.segment_sum(xp.abs(flat), table.counts) / table.counts_at_least_one(xp)

    def ideal_bits(self, xp, payload, ctx):
        return ctx.numel + 32  # bits + scale

    def decompress(self, xp, payload, ctx):
        packed, scale = payload
        fused = xp.native("efsignsgd_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, scale, ctx.numel), ctx.shape)
        values = self.values(xp, bits.unpack(xp, packed, 1, ctx.numel), scale, segments.whole(xp, ctx.numel, packed))
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)

    def values(self, xp, positive, scale, table):
        """Element by element: the float32 values of the unpacked bits (or the signs' mask), each
        its segment's scale or that times -1."""
        scales = table.per_element(xp, scale)
        return xp.where(xp.cast(positive, "bool"), scales, scales * -1.0)

    def finish(self, n):
        return False, (n, self.lr)  # the mean, over lr


@register("efsignsgd", lr="lr", examples=dict(efsignsgd=example(0.1)))  # (no default lr: it must be the optimizer's)
def efsignsgd(lr: float, *, memory="efsignsgd", communicator=None) -> GradientCompression:
    """EF-signSGD: scaled sign (1 bit + 1 float) with error feedback; ``lr`` as the optimizer's."""
    compressor = EFSignSGD(lr)
    if memory != "efsignsgd" and not (isinstance(memory, EFSignSGDMemory) and memory.gamma == compressor.lr):
        raise ValueError("efsignsgd works in model units: its memory must be 'efsignsgd' "
                         f"(error feedback with gamma = lr = {compressor.lr}); got {memory!r}")
    return GradientCompression(compressor, make_memory(memory, lr=compressor.lr), communicator)
