"""Deep Gradient Compression (Lin et al. 2018): a threshold estimated from a sample.

    k   = max(1, ceil(ratio_t * d));   ratio_t = ratio, or during warm-up
          ratio^((t + 1) / (warmup_steps + 1)): the sparsity rises exponentially
    thr = the ceil(ratio_t * s)-th largest |v| of s = ceil(sample_ratio * d) random elements
    send v where |v| >= thr; if that is more than k elements, the k largest of them

Momentum correction and factor masking are the 'dgc' memory (grace/memories/dgc.py); the
selection here sees v. The sample is each rank's own, so lengths differ between ranks.
"""
import math
import numbers

from grace.compressors.sparse import Sparsifier
from grace.core import draws
from grace.core.compression import GradientCompression
from grace.core.compressor import Shape, check_ratio, native_or_none
from grace.core.registry import example, register
from grace.memories import DGCMemory, make_memory


class DGC(Sparsifier):
    variable_length = True

    def __init__(self, ratio: float, sample_ratio: float = 0.01, warmup_steps: int = 0, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.seed = seed

    def ratio_at(self, xp, step):
        """The target ratio at ``step`` (an int, or a tensor inside a traced step)."""
        if not self.warmup_steps:
            return self.ratio
        return self.ratio ** xp.minimum((step + 1) / (self.warmup_steps + 1), 1.0)

    def select(self, xp, flat, info):
        d = xp.numel(flat)
        if d == 0:
            return xp.nonzero(xp.abs(flat) > 0)
        ratio = self.ratio_at(xp, info.step)
        k = xp.clip_min(xp.ceil(ratio * d), 1)  # <= d, as ratio <= 1
        s = min(d, max(1, math.ceil(self.sample_ratio * d)))
        if s == d:
            sample = xp.abs(flat)
        else:
            u = xp.uniform(s, info.rank_seed(self.seed), like=flat)
            sample = xp.abs(xp.gather(flat, xp.cast(xp.floor(u * d), "int64")))
        threshold = xp.sort(sample)[xp.cast(s - xp.clip_min(xp.ceil(ratio * s), 1), "int64")]
        selected = xp.indices_abs_at_least(flat, threshold)  # (no |v| of the whole tensor)
        # if the sample underestimated the threshold, the k largest of those selected
        candidates = xp.abs(xp.gather(flat, selected))
        return xp.sort(xp.gather(selected, xp.topk_indices(candidates, k)))

    def compress_many_with_momentum(self, xp, gs, states, momentum, infos, outs, flag=None, factor=None):
        """DGCMemory's fused_step with this selection for every gradient of a bucket, in one
        native call (CPU; new states written into ``outs``, the overflow flag into ``flag``
        where given; each g taken as g * factor(g) where ``factor`` is given, the clipping,
        computed only where the call runs): [(payload, ctx, new state)], or None where it does
        not run (or the step is not a known int: a traced TensorFlow step)."""
        step = infos[0].step
        if not isinstance(step, numbers.Integral) or not xp.fused("dgc_step_many", gs[0], xp.dtype(gs[0])):
            return None
        scales = None if factor is None else [float(factor(g)) for g in gs]
        words = [draws.seed_words(info.rank_seed(self.seed)) for info in infos]
        done = native_or_none(xp, "dgc_step_many", gs[0], gs, [u for u, _ in states], [v for _, v in states], momentum,
                              self.ratio_at(xp, step), self.sample_ratio, words, [u for u, _ in outs],
                              [v for _, v in outs], nonfinite=flag, scales=scales)
        if done is None:
            return None
        return [((values, indices), Shape(xp.shape(g), xp.dtype(g)), out)
                for values, indices, g, out in zip(*done, gs, outs)]


@register("dgc", compress_ratio="ratio", sample_ratio="sample_ratio", warmup_steps="warmup_steps",
          momentum="momentum", clip_norm="clip_norm", seed="seed",
          examples=dict(dgc=example(0.1), dgc_warmup=example(0.01, warmup_steps=5, sample_ratio=0.1)))
def dgc(ratio: float, *, sample_ratio: float = 0.01, warmup_steps: int = 0, momentum: float = 0.9,
        clip_norm: float = 0.0, seed: int = 0, memory="dgc", communicator=None) -> GradientCompression:
    """DGC: sampled-threshold sparsification with momentum correction (use an optimizer
    without momentum), factor masking, optional clipping and sparsity warm-up."""
    memory = DGCMemory(momentum, clip_norm) if memory == "dgc" else make_memory(memory)
    return GradientCompression(DGC(ratio, sample_ratio, warmup_steps, seed), memory, communicator)
