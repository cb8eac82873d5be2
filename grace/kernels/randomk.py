"""Random-k's fast paths: a bucket's residual steps in one native call (CPU, the indices drawn
first for all gradients), the residual written at the sent indices only, the summed values of a
bucket decoded in one call, and the segment-wise forms: the residual step by the segment kernels
that rank the draws (a GPU's rule of indices), or one draw, one gather, one scatter; the mean
of the allreduced sum by one fill and one scatter.
"""
import functools

import numpy as np

from grace.compressors.randomk import RandomK
from grace.core import draws
from grace.core.buffers import shaped_as, shapes_of
from grace.core.compressor import native_or_none, sent_count
from grace.core.journal import left_on_device
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(RandomK)
class RandomKKernels(MethodKernels):
    segmented = True
    flags_in_segment_steps = True

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None):
        """Residual memory's step for every gradient of a bucket in one native call (CPU):
        compensate, gather and the new memory (p, with p - (0 + v) at the sent indices), with
        every gradient's indices drawn first by one call."""
        randomk = self.compressor
        if not xp.native("randomk_ef_step_many", gs[0], xp.dtype(gs[0])):
            return None
        numels = tuple(xp.numel(g) for g in gs)
        ks, scales = _sizes(randomk.ratio, randomk.scale, numels)
        # the first k distinct draws (grace.core.draws) from the bucket's seed words at once (a seed's
        # words per gradient and step: ~0.6 ms a ResNet-50 step), unless the backend ranks the hashes
        drawn = None if xp.indices_by_hash(gs[0]) else native_or_none(
            xp, "random_indices_segments", gs[0], numels, ks, draws.bucket_seed_words(infos, randomk.seed),
            xp.empty(sum(ks), "int64", like=gs[0]))
        if drawn is None:
            drawn = xp.random_indices_segments(numels, ks, [info.seed(randomk.seed) for info in infos], like=gs[0])
        indices = xp.split(drawn, ks)
        done = native_or_none(xp, "randomk_ef_step_many", gs[0], gs, residuals, indices, beta, gamma, scales,
                              outs=outs, nonfinite=flag)
        if done is None:
            return None
        values, news = done
        shapes = shapes_of(xp, gs)
        news = shaped_as(xp, news, outs, shapes)
        return [((v,), (shape, i), e) for v, e, i, shape in zip(values, news, indices, shapes)]

    def residual_into(self, xp, p, payload, ctx, out):
        """p - decompress(payload) is p, but p - (0 + sent value) at the sent indices: written
        into ``out`` (p itself where it can) without a dense decompression."""
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

    def summed_mean(self, xp, summed, indices, table, ranks: int, overflow):
        """The summed values at their indices, over the ranks, poisoned by the summed flags on the
        device: one fill and one scatter (0 + v / n, the decompressed sum divided to the bit)."""
        if isinstance(overflow, int) and overflow:  # (read back already: poisoned after)
            return None
        return native_or_none(xp, "sparse_sum_mean", summed[0], summed[0], indices, ranks, left_on_device(overflow),
                              table.numel)

    def segment_fields(self, numels, dtype):
        return [([sent_count(self.compressor.ratio, d) for d in numels], [dtype] * len(numels))]

    def compress_segments_with_residual(self, xp, g, residual, beta, gamma, table, infos, nonfinite=None,
                                        into=None):
        """Residual memory's step of every segment where the indices are a GPU's draws (the k
        smallest hashes): compensation, draws, gather and the new memory in the top-k segment
        kernels (on a GPU no hash keys written and no sort of the bucket)."""
        randomk = self.compressor
        if not xp.indices_by_hash(g):  # (a CPU's are other draws: grace.core.draws)
            return None
        ks = [sent_count(randomk.ratio, d) for d in table.numels]
        words = draws.bucket_seed_words(infos, randomk.seed)
        scales = [d / k for d, k in zip(table.numels, ks)] if randomk.scale else None
        done = native_or_none(xp, "randomk_ef_step_segments", g, g, residual, table.starts, table.numels, ks, words,
                              scales, beta, gamma, nonfinite=nonfinite)
        if done is None:
            return None
        values, indices, residual = done
        return (values,), indices, residual

    def compress_segments(self, xp, p, table, infos):
        randomk = self.compressor
        ks = [sent_count(randomk.ratio, d) for d in table.numels]
        starts = table.cached("sent starts", lambda: xp.asarray(np.repeat(table.starts, ks), like=p))
        drawn = xp.random_indices_segments(table.numels, ks, [info.seed(randomk.seed) for info in infos], like=p)
        indices = drawn + starts  # in the flat buffer
        values = xp.gather(p, indices)
        if randomk.scale:  # d / k per segment, as the per-tensor multiply rounds it
            values = values * table.cached("scale", lambda: xp.cast(
                xp.asarray(np.repeat([d / k for d, k in zip(table.numels, ks)], ks), like=p), xp.dtype(p)))
        return (values,), indices, None

    def decompress_segments(self, xp, fields, indices, table):
        return xp.scatter_add(indices, fields[0], table.numel)


@functools.lru_cache(maxsize=256)
def _sizes(ratio: float, scale: bool, numels: tuple):
    """A bucket's k per gradient, and its scales d / k (None: unscaled): made once per layout."""
    ks = tuple(sent_count(ratio, d) for d in numels)
    return ks, tuple(d / k if k else 1.0 for d, k in zip(numels, ks)) if scale else None
