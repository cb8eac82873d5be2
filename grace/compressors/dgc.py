"""Deep Gradient Compression (Lin et al. 2018): a threshold estimated from a sample.

    k   = max(1, ceil(ratio_t * d));   ratio_t = ratio, or during the sparsity warm-up
          ratio^((t + 1) / (sparsity_warmup_steps + 1)): the sparsity rises exponentially
    thr = the ceil(ratio_t * s)-th largest |v| of s = ceil(sample_ratio * d) random elements
    send v where |v| >= thr; if that is more than k elements, the k largest of them

Momentum correction and factor masking are the 'dgc' memory (grace/memories/dgc.py); the
selection here sees v. The sample is each rank's own, so lengths differ between ranks.

On an accelerator a bucket is selected segment-wise: every gradient's draws in one call, the
samples' magnitudes keyed by their segment and sorted at once, each segment's threshold read
from that (``segment_cut``). The k largest of a segment are then its selection where it
selected more than k, and hold it where it selected fewer: so a segment sends its k largest,
those under its threshold as +0.0, in frames whose size every rank knows (no count read back).
"""
import functools
import math
import numbers
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from grace.compressors.sparse import Sparsifier
from grace.core import draws, segments
from grace.core.compression import GradientCompression
from grace.core.compressor import check_ratio, check_seed, check_steps
from grace.core.registry import example, register
from grace.memories import DGCMemory, make_memory


class DGC(Sparsifier):
    def __init__(self, ratio: float, sample_ratio: float = 0.01, sparsity_warmup_steps: int = 0, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        self.sparsity_warmup_steps = check_steps(sparsity_warmup_steps, "sparsity_warmup_steps")
        self.seed = check_seed(seed)

    @functools.cached_property
    def traits(self):  # (seeded: its sample; made once: read per gradient and step)
        return replace(Sparsifier.traits, variable_length=True, seeded=True, scheduled=self.sparsity_warmup_steps > 0)

    def ratio_at(self, xp, step):
        """The target ratio at ``step`` (an int, or a tensor inside a traced step)."""
        if not self.sparsity_warmup_steps:
            return self.ratio
        return self.ratio ** xp.minimum((step + 1) / (self.sparsity_warmup_steps + 1), 1.0)

    def select(self, xp, flat, info):
        d = xp.numel(flat)
        if d == 0:
            return xp.nonzero(xp.abs(flat) > 0)
        ratio = self.ratio_at(xp, info.step)
        s = _at_most(self.sample_ratio * d, d)
        # all of it in one call where built (CPU), where the step and ratio are host numbers
        host = isinstance(info.step, numbers.Integral) and isinstance(ratio, numbers.Real) and isinstance(d, int)
        fused = xp.native("dgc_select", flat, xp.dtype(flat)) if host else None
        if fused:
            words = draws.seed_words(info.rank_seed(self.seed))
            return fused(flat, s, _at_most(ratio * s, s), _at_most(ratio * d, d), words)
        k = xp.clip_min(xp.ceil(ratio * d), 1)  # <= d, as ratio <= 1
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

    def kernel_argument(self, d: int) -> int:
        return _at_most(self.ratio * d, d)  # k after the warm-up

    def segment_cut(self, xp, p, table, infos):
        """Each segment's k at this step (a tuple of host ints) and its threshold (float32), as ``select``
        finds it: one call for all the draws, one sort of the samples' magnitudes, keyed by
        segment (so each segment's sample lies ascending in a row), and each segment's need-th
        largest read from there."""
        sample, cut = self._layout(xp, table, infos[0].step, p)
        at = sample.whole
        if sample.drawn_counts:
            seeds = [infos[s].rank_seed(self.seed) for s in sample.drawn_segments]
            u = xp.uniform_segments(sample.drawn_counts, seeds, like=p)
            drawn = xp.cast(xp.floor(u * sample.drawn_numels), "int64") + sample.drawn_starts
            at = drawn if at is None else xp.concat([drawn, at])
        keys = xp.cast(segments.magnitude_keys(xp, xp.gather(p, at)), "int64") + sample.segment_bits
        chosen = xp.gather(xp.sort(keys), cut.threshold_at) - sample.bits_of_segment
        return cut.ks, xp.from_bytes(xp.to_bytes(xp.cast(chosen, "int32")), "float32")

    def sample_sizes(self, numels) -> tuple:
        """Each segment's sample size s, of its ``numels`` elements."""
        return tuple(_at_most(self.sample_ratio * d, d) for d in numels)

    def sample_plan(self, numels, ratio: float):
        """Per segment of ``numels`` elements at ``ratio``: its sample's size s, its threshold's
        place (the need-th largest of the sample) and its k, each a tuple of host ints."""
        sizes = self.sample_sizes(numels)
        return sizes, tuple(_at_most(ratio * s, s) for s in sizes), tuple(_at_most(ratio * d, d) for d in numels)

    def _layout(self, xp, table, step, like):
        """The bucket's sample (made once) and its k and threshold places at this step's ratio
        (kept for the latest ratio: it changes only during warm-up)."""
        sample = table.cached("dgc sample", lambda: _Sample.of(xp, table, self.sample_sizes(table.numels), like))
        ratio = self.ratio_at(xp, step)
        cut = table.cache.get("dgc cut")
        if cut is None or cut.ratio != ratio:
            _, needs, ks = self.sample_plan(table.numels, ratio)
            cut = table.cache["dgc cut"] = _Cut.of(xp, sample, ratio, needs, ks, like)
        return sample, cut


def _at_most(x: float, d: int) -> int:
    """max(1, ceil(x)), at most d."""
    return min(d, max(1, math.ceil(x)))


@dataclass
class _Sample:
    """Where a bucket's segments draw their samples: the drawn ones (s < d) as
    floor(u * d) + start, the others (s = d) at each of their elements; every sampled element's
    key gets its segment's number above its 32 bits of magnitude."""

    sizes: Sequence[int]  # s per segment
    drawn_segments: Sequence[int]
    drawn_counts: Sequence[int]
    drawn_numels: Any  # float32 per draw: its segment's d
    drawn_starts: Any  # int64 per draw: its segment's start
    whole: Any  # int64: the elements of the segments sampled whole, or None
    segment_bits: Any  # int64 per sampled element: its segment's number << 32
    bits_of_segment: Any  # int64 per segment: its number << 32

    @classmethod
    def of(cls, xp, table, sizes, like) -> "_Sample":
        drawn = [i for i, (s, d) in enumerate(zip(sizes, table.numels)) if s < d]
        whole = [i for i, (s, d) in enumerate(zip(sizes, table.numels)) if s == d]
        counts = [sizes[i] for i in drawn]
        numbers = np.arange(len(sizes), dtype=np.int64) << 32
        at = [np.arange(table.starts[i], table.starts[i] + table.numels[i], dtype=np.int64) for i in whole]
        return cls(sizes, drawn, counts,
                   xp.asarray(np.repeat(np.float32([table.numels[i] for i in drawn]), counts), like=like),
                   xp.asarray(np.repeat(np.int64([table.starts[i] for i in drawn]), counts), like=like),
                   xp.asarray(np.concatenate(at), like=like) if at else None,
                   xp.asarray(np.concatenate([np.repeat(numbers[drawn], counts),
                                              np.repeat(numbers[whole], [sizes[i] for i in whole])]), like=like),
                   xp.asarray(numbers, like=like))


@dataclass
class _Cut:
    """At one ratio: each segment's k (host ints) and where its threshold lies among the sorted
    sample keys (the need-th largest of its s)."""

    ratio: float
    ks: tuple  # (a tuple: it keys caches)
    threshold_at: Any

    @classmethod
    def of(cls, xp, sample: _Sample, ratio: float, needs, ks, like) -> "_Cut":
        at = np.cumsum(sample.sizes) - np.asarray(needs, np.int64)
        return cls(ratio, ks, xp.asarray(np.int64(at), like=like))


def _no_clamp(on) -> dict:
    """GRACE's ``gradient_clipping``: off is grace's default; on, GRACE clamps each element to the
    ranks' mean gradient norm, which grace does not do."""
    if on:
        raise ValueError(f"dgc: gradient_clipping={on!r} (GRACE's clamp of each element to the ranks' mean "
                         "gradient norm) is not offered; grace's dgc clips each gradient's norm: clip_norm=<max norm>")
    return {}


@register("dgc", compress_ratio="ratio", sample_ratio="sample_ratio",
          sparsity_warmup_steps="sparsity_warmup_steps",
          momentum="momentum", clip_norm="clip_norm", seed="seed", gradient_clipping=_no_clamp,
          grace_defaults=dict(compress_ratio=0.3),  # (GRACE's helper's; its momentum default, 0.3, is not the paper's)
          examples=dict(dgc=example(0.1), dgc_warmup=example(0.01, sparsity_warmup_steps=5, sample_ratio=0.1)))
def dgc(ratio: float, *, sample_ratio: float = 0.01, sparsity_warmup_steps: int = 0, momentum: float = 0.9,
        clip_norm: float = 0.0, seed: int = 0, memory="dgc", communicator=None) -> GradientCompression:
    """DGC: sampled-threshold sparsification with momentum correction (use an optimizer
    without momentum), factor masking, optional clipping and sparsity warm-up."""
    memory = DGCMemory(momentum, clip_norm) if memory == "dgc" else make_memory(memory)
    return GradientCompression(DGC(ratio, sample_ratio, sparsity_warmup_steps, seed), memory, communicator)
