"""Random-k sparsification: k = max(1, ceil(ratio * d)) elements chosen at random.

All ranks draw the same indices from a seed shared for this (tensor, step), so only the k
values travel and they are summed by allreduce.
With ``scale=True`` the values are multiplied by d/k, which makes the estimate unbiased.
"""
import numpy as np

from grace.core.compression import GradientCompression
from grace.core.compressor import (check_ratio, check_seed, Collective, Compressor, native_or_none, sent_count, Shape,
                                   Traits)
from grace.core.registry import example, register
from grace.memories import make_memory


class RandomK(Compressor):
    collective = Collective.ALLREDUCE

    def __init__(self, ratio: float, scale: bool = False, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.scale = bool(scale)
        self.seed = check_seed(seed)

    @property
    def traits(self) -> Traits:
        return Traits(supports_allreduce=True, new_payload=True, unbiased=self.scale)  # unbiased: scaled by d/k

    def compress(self, xp, x, info):
        flat = xp.flatten(x)
        d = xp.numel(flat)
        k = sent_count(self.ratio, d)
        indices = xp.random_indices(d, k, info.seed(self.seed), like=flat)
        values = xp.gather(flat, indices)
        if self.scale and k:
            values = values * (d / k)
        return (values,), (Shape(xp.shape(x), xp.dtype(x)), indices)

    def ideal_bits(self, xp, payload, ctx):
        return 32 * xp.numel(payload[0])  # values only: the indices come from the shared seed

    def decompress(self, xp, payload, ctx):
        shape, indices = ctx
        return xp.reshape(xp.scatter_add(indices, payload[0], shape.numel), shape.shape)

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None):
        """Residual memory's step for every gradient of a bucket in one native call (CPU):
        compensate, gather and the new memory (p, with p - (0 + v) at the sent indices), with
        every gradient's indices drawn first by one call of the backend's draws."""
        if not xp.fused("randomk_ef_step_many", gs[0], xp.dtype(gs[0])):
            return None
        numels = [xp.numel(g) for g in gs]
        ks = [sent_count(self.ratio, d) for d in numels]
        indices = xp.split(xp.random_indices_segments(numels, ks, [info.seed(self.seed) for info in infos], like=gs[0]),
                           ks)
        scales = [d / k if k else 1.0 for d, k in zip(numels, ks)] if self.scale else None
        done = native_or_none(xp, "randomk_ef_step_many", gs[0], gs, residuals, indices, beta, gamma, scales,
                              outs=outs, nonfinite=flag)
        if done is None:
            return None
        return [((v,), (Shape(xp.shape(g), xp.dtype(g)), i), xp.reshape(e, xp.shape(g)))
                for v, e, i, g in zip(*done, indices, gs)]

    def residual_into(self, xp, p, payload, ctx, out):
        """p - decompress(payload) is p, but p - (0 + sent value) at the sent indices: written
        into ``out`` (a mutable backend's buffer, p itself where it can) without a dense
        decompression."""
        if out is not p:
            xp.assign(out, p)
        flat = xp.flatten(out)
        indices = ctx[1]
        xp.put(flat, indices, xp.gather(flat, indices) - (payload[0] + 0.0))
        return out

    def averaged_many(self, xp, summed, ctxs, n: int, outs):
        """Every gradient's summed values, decompressed and divided by n, written into ``outs``
        in one native call (0 + v / n, which is (0 + v) / n to the bit)."""
        return native_or_none(xp, "scatter_add_segments_into", outs[0],
                              [[(payload[0], ctx[1])] for payload, ctx in zip(summed, ctxs)], outs, n)

    # --- a bucket at once: each segment's own draw, one gather and one scatter -------------
    segmented = True

    def segment_fields(self, numels, dtype):
        return [([sent_count(self.ratio, d) for d in numels], [dtype] * len(numels))]

    def compress_segments(self, xp, p, table, infos):
        ks = [sent_count(self.ratio, d) for d in table.numels]
        starts = table.cached("sent starts", lambda: xp.asarray(np.repeat(table.starts, ks), like=p))
        drawn = xp.random_indices_segments(table.numels, ks, [info.seed(self.seed) for info in infos], like=p)
        indices = drawn + starts  # in the flat buffer
        values = xp.gather(p, indices)
        if self.scale:  # d / k per segment, as the per-tensor multiply rounds it
            values = values * table.cached("scale", lambda: xp.cast(
                xp.asarray(np.repeat([d / k for d, k in zip(table.numels, ks)], ks), like=p), xp.dtype(p)))
        return (values,), indices, None

    def decompress_segments(self, xp, fields, indices, table):
        return xp.scatter_add(indices, fields[0], table.numel)


@register("randomk", compress_ratio="ratio", scale="scale", seed="seed",
          examples=dict(randomk=example(0.1), randomk_scaled=example(0.1, scale=True)))
def randomk(ratio: float, *, scale: bool = False, seed: int = 0, memory="residual",
            communicator=None) -> GradientCompression:
    """Random-k: ceil(ratio * d) elements at indices drawn from a seed all ranks share."""
    return GradientCompression(RandomK(ratio, scale, seed), make_memory(memory), communicator)
