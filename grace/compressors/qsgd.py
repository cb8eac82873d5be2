"""QSGD (Alistarh et al. 2017): stochastic rounding to s levels of the norm, unbiased.

    r = s * |x| / ||x||_2,  l = floor(r)
    level = l + 1 with probability r - l, else l          (docs/methods.md: printed swapped in the paper)
    out = ||x||_2 * sign(x) * level / s

Each code is level * 2 + (x < 0), packed at the narrowest width holding 2 * (s + 1) codes;
the norm (one float32 per bucket of ``bucket_size`` elements, or per tensor) travels with it.
"""
import math

from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, compressed_natively, Shape, Traits
from grace.core.registry import example, register
from grace.formats import qsgd_bucket
from grace.memories import make_memory


class QSGD(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(unbiased=True, new_payload=True, nonfinite_field=1)  # (field 1: the norms)

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

    def _buckets(self, xp, flat, d):
        """(rows, b) view of the flat tensor, zero-padded to whole buckets."""
        b = self.bucket_of(d)
        pad = -d % b
        if pad:
            flat = xp.concat([flat, xp.zeros(pad, xp.dtype(flat), like=flat)])
        return xp.reshape(flat, (-1, b))

    def compress(self, xp, x, info):
        seed = info.rank_seed(self.seed)
        d = xp.numel(x)
        native = compressed_natively(xp, "qsgd_compress", x, seed, lambda: self.rows_of(d) * self.bucket_of(d),
                                     self.levels, self.bucket_size)
        if native is not None:
            return native, Shape(xp.shape(x), xp.dtype(x))
        flat = xp.cast(xp.flatten(x), "float32")
        rows = self._buckets(xp, flat, d)
        u = xp.uniform(xp.numel(rows), seed, like=flat)
        norms = xp.norm(rows, axis=1)
        safe = xp.where(norms > 0, norms, norms + 1)
        r = xp.abs(rows) * self.levels / xp.reshape(safe, (-1, 1))
        low = xp.floor(r)
        u = xp.reshape(u, xp.shape(rows))
        level = low + xp.cast(u < r - low, "float32")
        level = level - xp.cast(level > self.levels, "float32")  # r can pass s by a rounding error
        codes = xp.cast(level * 2 + xp.cast(rows < 0, "float32"), "uint8")
        return (bits.pack(xp, xp.flatten(codes)[:d], self.bits), norms), Shape(xp.shape(x), xp.dtype(x))

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
        codes = xp.cast(bits.unpack(xp, packed, self.bits, ctx.numel), "float32")
        level = xp.floor(codes / 2)
        sign = 1 - 2 * (codes - 2 * level)
        rows = self._buckets(xp, sign * level / self.levels, ctx.numel)
        values = xp.flatten(rows * xp.reshape(norms, (-1, 1)))[:ctx.numel]
        return xp.reshape(xp.cast(values, ctx.dtype), ctx.shape)


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
