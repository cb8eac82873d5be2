"""SketchML-style quantile buckets (Jiang et al. 2018): each value sent as its bucket's index.

    v = the non-zero elements of x, in index order;  n = len(v);  q = min(buckets, n)
    bucket of v_i = floor(rank(v_i) * q / n)   (rank in sorted order: equal-count quantile buckets)
    send: a 1-bit non-zero mask, one 8-bit bucket code per non-zero, the q bucket means
    decode: the mean of its bucket at every non-zero

A bucket is a run of the sorted values, so its sum is a difference of a float64 running sum
at the run's ends: no scatter of every value into q bins (on a GPU, millions of atomic adds
to 256 addresses).

Positions travel as a packed mask, not as indices: for dense gradients (every element
non-zero) that is 1 bit per element instead of 16-32. SketchML's MinMaxSketch for sparse
keys is not reproduced.
"""
from grace.core import bits
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor, Shape, Traits
from grace.core.registry import example, register
from grace.memories import make_memory


class SketchML(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(variable_length=True)

    def __init__(self, buckets: int = 256):
        if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= 256:
            raise ValueError(f"buckets must be an integer in [1, 256] (8-bit codes), got {buckets!r}")
        self.buckets = buckets

    def compress(self, xp, x, info):
        flat = xp.cast(xp.flatten(x), "float32")
        nonzero = flat != 0
        values = xp.gather(flat, xp.nonzero(nonzero))
        n = xp.sum(xp.cast(nonzero, "float32"))  # a count, maybe known only when the step runs
        q = xp.minimum(n, float(self.buckets))
        order = xp.argsort(values)
        ranks = xp.cast(xp.arange(xp.numel(values), like=values), "float32")
        sorted_codes = xp.floor(ranks * q / xp.clip_min(n, 1))
        codes = xp.scatter_add(order, sorted_codes, xp.numel(values))  # values[order[i]] gets sorted_codes[i]
        # the last position of each bucket's run (the codes do not decrease along it)
        last = xp.nonzero(xp.concat([sorted_codes[1:] != sorted_codes[:-1], sorted_codes[:1] == sorted_codes[:1]]))
        running = xp.gather(xp.cumsum(xp.cast(xp.gather(values, order), "float64")), last)
        at = xp.cast(last, "float64")
        sums = running - xp.concat([running[:1] * 0, running[:-1]])
        counts = at - xp.concat([at[:1] * 0 - 1, at[:-1]])
        bucket = xp.gather(sorted_codes, last)
        means = xp.scatter_add(bucket, xp.cast(sums / counts, "float32"), self.buckets)[:xp.cast(q, "int64")]
        return (bits.pack(xp, nonzero, 1), xp.cast(codes, "uint8"), means), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return ctx.numel + 8 * xp.numel(payload[1]) + 32 * xp.numel(payload[2])  # mask, codes, means

    def decompress(self, xp, payload, ctx):
        mask, codes, means = payload
        positions = xp.nonzero(bits.unpack(xp, mask, 1, ctx.numel) > 0)
        values = xp.gather(means, codes)
        return xp.reshape(xp.cast(xp.scatter_add(positions, values, ctx.numel), ctx.dtype), ctx.shape)


@register("sketchml", buckets="buckets", grace_name="sketch", quantiles="buckets", examples=dict(sketchml=example(16)))
def sketchml(buckets: int = 256, *, memory="residual", communicator=None) -> GradientCompression:
    """SketchML: non-zeros as 8-bit quantile-bucket codes plus the bucket means."""
    return GradientCompression(SketchML(buckets), make_memory(memory), communicator)
