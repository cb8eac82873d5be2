"""QSGD (Alistarh et al. 2017): stochastic rounding to s levels of the norm, unbiased.

    r = s * |x| / ||x||_2,  l = floor(r)
    level = l + 1 with probability r - l, else l          (docs/methods.md: printed swapped in the paper)
    out = ||x||_2 * sign(x) * level / s

Each code is level * 2 + (x < 0), packed at the narrowest width holding 2 * (s + 1) codes;
the norm (one float32 per bucket of ``bucket_size`` elements, or per tensor) travels with it.
"""
import math

import numpy as np

from grace.core import bits, segments
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.registry import example, register
from grace.core.tensors import constant
from grace.formats import qsgd_bucket
from grace.memories import make_memory


class QSGD(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True, nonfinite_field=1, seeded=True)  # (field 1: the norms)

    def __init__(self, levels: int = 127, bucket_size: int = 0, seed: int = 0):
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"levels must be an integer in [1, 127], got {levels!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 0:
            raise ValueError(f"bucket_size must be an integer >= 0 (0: one bucket), got {bucket_size!r}")
        self.levels = levels
        self.bucket_size = bucket_size
        self.seed = check_seed(seed)
        self.bits = bits.code_width(2 * (levels + 1))

    def bucket_of(self, d: int) -> int:
        """The bucket of a tensor of d elements (a bucket_size beyond d is the whole tensor)."""
        return qsgd_bucket(d, self.bucket_size)

    def compress(self, xp, x, info):
        seed = info.rank_seed(self.seed)
        d = xp.numel(x)
        native = compressed_natively(xp, "qsgd_compress", x, seed, lambda: self.rows_of(d) * self.bucket_of(d),
                                     self.levels, self.bucket_size)
        if native is not None:
            return native, Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        b, padded = self.bucket_of(d), self.rows_of(d) * self.bucket_of(d)
        squares = flat * flat
        if padded > d:
            squares = xp.concat([squares, xp.zeros(padded - d, "float32", like=flat)])
        norms = self.norms(xp, squares, segments.rows(xp, padded, b, flat))
        u = xp.uniform(padded, seed, like=flat)[:d]  # (the padding drew too)
        codes = self.codes(xp, flat, u, norms, segments.rows(xp, d, b, flat))
        return (bits.pack(xp, codes, self.bits), norms), Shape(xp.shape(x), xp.dtype(x))

    @staticmethod
    def norms(xp, squares, rows):
        """Each row's ||x||_2 from the squares of its elements (``rows``: a tensor's, or a
        bucket's gradients', each row a whole bucket: a last one padded with zeros)."""
        return xp.segment_sum(squares, rows.counts) ** 0.5

    def codes(self, xp, flat, u, norms, rows):
        """Element by element: the codes of ``flat`` from its draws ``u``, each element at its
        row's norm (``rows``: a tensor's, or a bucket's gradients'; a zero norm divides as 1)."""
        r = xp.abs(flat) * self.levels / rows.per_element(xp, xp.where(norms > 0, norms, norms + 1))
        low = xp.floor(r)
        level = low + xp.cast(u < r - low, "float32")
        level = level - xp.cast(level > self.levels, "float32")  # r can pass s by a rounding error
        return xp.cast(level * 2 + xp.cast(flat < 0, "float32"), "uint8")

    def ideal_bits(self, xp, payload, ctx):
        buckets = self.rows_of(ctx.numel)
        return (1 + math.ceil(math.log2(self.levels + 1))) * ctx.numel + 32 * buckets

    def rows_of(self, d: int) -> int:
        return -(-d // self.bucket_of(d))

    def decompress(self, xp, payload, ctx):
        packed, norms = payload
        fused = xp.native("qsgd_decompress", packed, ctx.dtype)
        if fused:
            return xp.reshape(fused(packed, norms, ctx.numel, self.levels, self.bucket_size), ctx.shape)
        rows = segments.rows(xp, ctx.numel, self.bucket_of(ctx.numel), packed)
        values = self.values(xp, bits.unpack(xp, packed, self.bits, ctx.numel), rows.per_element(xp, norms))
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)

    def values(self, xp, codes, norms):
        """Element by element: the float32 values of the codes, each at its row's norm."""
        levels = constant(xp, ("qsgd levels", self.levels), lambda: xp.asarray(self._levels_of_codes(), like=codes),
                          codes)
        return xp.gather(levels, codes) * norms

    def _levels_of_codes(self):
        """sign * level / s of every code (level * 2 + negative), in float32 arithmetic."""
        codes = np.arange(2 * (self.levels + 1), dtype=np.float32)
        level = np.floor(codes / 2)
        return (1 - 2 * (codes - 2 * level)) * level / np.float32(self.levels)


def _grace_levels(levels) -> dict:
    """GRACE's ``quantum_num``: its helper's default, 256, needs wider codes than grace's 8 bits."""
    if isinstance(levels, int) and not isinstance(levels, bool) and levels > 127:
        raise ValueError(f"qsgd: quantum_num={levels} needs more than the 8-bit codes grace sends; "
                         "it takes 1 to 127 levels (127 is its default)")
    return {"levels": levels}


@register("qsgd", quantum_num=_grace_levels, bucket_size="bucket_size", seed="seed",
          examples=dict(qsgd=example(4), qsgd_bucketed=example(127, bucket_size=64)))
def qsgd(levels: int = 127, *, bucket_size: int = 0, seed: int = 0, memory="none",
         communicator=None) -> GradientCompression:
    """QSGD with ``levels`` quantization levels (GRACE's quantum_num), unbiased."""
    return GradientCompression(QSGD(levels, bucket_size, seed), make_memory(memory), communicator)
