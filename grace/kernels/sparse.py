"""The sparsifiers' fast paths (top-k, threshold, DGC): the residual step fused with selection
(one native pass per gradient, or per bucket on a CPU), the ranks' pairs added in one call, and
the segment-wise forms: a fixed k per segment (the per-tensor kernel on each segment) or a
variable number selected by whole-buffer tensor ops.
"""
import numbers

import numpy as np

from grace import native
from grace.compressors.dgc import DGC
from grace.compressors.sparse import Sparsifier
from grace.compressors.threshold import Threshold
from grace.compressors.topk import TopK
from grace.core import draws, segments
from grace.core.buffers import column, marked_shapes, shaped_as, shapes_of
from grace.core.compressor import Shape, called_or_none, index_dtype, native_or_none
from grace.core.journal import poisoned
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(Sparsifier)
class SparseKernels(MethodKernels):
    #: grace.native's one-pass residual step (compensate, select, new residual), if it has one
    residual_kernel = None
    #: grace.native's residual step for a whole bucket in one call (CPU), if it has one
    residual_kernel_many = None

    def __init__(self, compressor):
        super().__init__(compressor)
        self._arguments_per_layout = {}  # (id of a layout's shapes -> (those shapes, kept), its arguments)

    def compress_with_residual(self, xp, g, residual, beta, gamma, info, out=None):
        fused = xp.native(self.residual_kernel, g, xp.dtype(g)) if self.residual_kernel else None
        if not fused:
            return None
        where = {} if out is None else {"out": out}
        values, indices, residual = fused(g, residual, self.compressor.kernel_argument(xp.numel(g)), beta, gamma,
                                          **where)
        return (values, indices), Shape(xp.shape(g), xp.dtype(g)), xp.reshape(residual, xp.shape(g))

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None):
        if self.residual_kernel_many is None:  # (DGC's selection with residual memory)
            return None
        placed = {} if into is None else {"into": into}
        done = native_or_none(xp, self.residual_kernel_many, gs[0], gs, residuals, self._kernel_arguments(xp, gs),
                              beta, gamma, outs=outs, nonfinite=flag, **placed)
        if done is None:
            return None
        values, indices, news = done
        shapes = shapes_of(xp, gs)
        return list(zip(zip(values, indices), shapes, shaped_as(xp, news, outs, shapes)))

    def _kernel_arguments(self, xp, gs):
        """Each gradient's ``kernel_argument``: of a step's gradients marked with their bucket's
        shapes (``laid_out``), made once per layout (asked per gradient, it reads each cold
        tensor's size after the previous bucket's pass)."""
        shapes = marked_shapes(gs)
        if shapes is None:
            return [self.compressor.kernel_argument(xp.numel(g)) for g in gs]
        kept = self._arguments_per_layout
        made = kept.get(id(shapes))
        if made is None or made[0] is not shapes:
            if len(kept) >= 64:
                kept.clear()
            made = kept[id(shapes)] = (shapes, tuple(self.compressor.kernel_argument(s.numel) for s in shapes))
        return made[1]

    def aggregate_many(self, xp, payloads, ctxs, outs):
        # each rank's values divided by n, added payload after payload: as aggregate
        return native_or_none(xp, "scatter_add_segments_into", outs[0], payloads, outs,
                              native.payload_ranks(payloads))

    # --- a bucket at once (a fixed k per segment, or a variable number) -------------------
    def segment_fields(self, numels, dtype, ks=None):
        k = [self.compressor.kernel_argument(d) for d in numels] if ks is None else list(ks)
        return [(k, [dtype] * len(k)), (k, [index_dtype(d) for d in numels])]

    def _ks(self, table, ctx=None):
        """Each segment's k: a fixed-k ctx is this step's where k changes by step, else None."""
        if ctx is not None:
            return ctx
        return table.cached("k", lambda: tuple(self.compressor.kernel_argument(d) for d in table.numels))

    def _sent_starts(self, xp, table, like, ctx=None):
        """Each sent element's segment start (k_i of each segment, in order)."""
        ks = self._ks(table, ctx)
        return table.latest("sent starts", ks, lambda: xp.asarray(np.repeat(table.starts, ks), like=like))

    def compress_segments(self, xp, p, table, infos):
        return self._top_segments(xp, p, table)  # (a variable-length selection: select_segments)

    def _top_segments(self, xp, p, table, ctx=None):
        """Each segment's k largest ``|p|`` (ties: the first), as the per-tensor top-k has them:
        ((values, indices within their segment), ctx, p_hat or None)."""
        fused = xp.native("topk_compress_segments", p, xp.dtype(p))
        if fused:  # the per-tensor kernel on each segment
            return fused(p, table.starts, table.numels, self._ks(table, ctx)), ctx, None
        take = segments.top_mask(xp, segments.magnitude_keys(xp, p), table, self._ks(table, ctx))
        starts = self._sent_starts(xp, table, p, ctx)
        indices = xp.nonzero(take, size=xp.numel(starts))  # ascending: k_i per segment, in order
        return (xp.gather(p, indices), indices - starts), ctx, xp.where(take, p, 0.0)

    def select_segments(self, xp, p, table, infos):
        """A variable-length selection of every segment (``Sparsifier.select_segments``): the
        mask of the selected, and each segment's count (int64, on the device: no wait for it
        here; the plan reads it back with the ranks' headers)."""
        take = self.compressor.select_segments(xp, p, table, infos)
        running = xp.cumsum(xp.cast(take, "int64"))
        last = table.cached("last elements", lambda: xp.asarray(  # (buckets hold no empty gradients)
            np.asarray(table.starts, np.int64) + np.asarray(table.numels, np.int64) - 1, like=p))
        at_last = xp.gather(running, last)  # selected up to each segment's end
        return take, at_last - xp.concat([xp.zeros(1, "int64", like=p), at_last[:-1]])

    def selected_pairs(self, xp, p, take, counts, table, with_p_hat: bool = True):
        """The selection's pairs, once its counts are known (``counts``: host ints, and the same
        as a tensor): (values, indices within their segment), and p_hat as ``decompress``
        makes it (None unless ``with_p_hat``)."""
        host, on_device = counts
        indices = xp.nonzero(take, size=sum(host))  # ascending: each segment's in a row
        values = xp.gather(p, indices)
        local = indices - xp.repeat(table.start, on_device, sum(host))
        return (values, local), xp.scatter_add(indices, values, table.numel) if with_p_hat else None

    def compress_segments_with_residual(self, xp, g, residual, beta, gamma, table, infos, nonfinite=None,
                                        into=None):
        if self.variable_segments:  # (selected by tensor ops: select_segments)
            return None
        fused = xp.native(f"{self.residual_kernel}_segments", g, xp.dtype(g)) if self.residual_kernel else None
        if not fused:
            return None
        values, local, residual = fused(g, residual, table.starts, table.numels, self._ks(table), beta, gamma,
                                        nonfinite=nonfinite, frame=into)
        return (None if into else (values, local)), None, residual

    def decompress_segments(self, xp, fields, ctx, table):
        values, local = fields
        return xp.scatter_add(local + self._sent_starts(xp, table, values, ctx), values, table.numel)

    def frames_mean(self, xp, received, layout, table, ranks: int):
        """k pairs per segment (top-k, DGC): each rank's values over the ranks added at their
        indices, rank after rank, read from the frames in place, and the flags counted (one
        launch on a GPU, not the fields read, then scattered, divided and poisoned)."""
        mean = xp.native("sparse_frames_mean", received)
        if mean is None:
            return None
        slots, flag_at = layout.pair_slots(xp, table.starts)
        return mean(received, ranks, layout.size, slots, flag_at, ranks, table.numel)

    def aggregate_segments(self, xp, fields, ctx, table, ranks, overflow=None):
        values, local = fields  # (ranks, sent) each: every rank's indices and shares by one op each
        indices, shares = local + self._sent_starts(xp, table, values, ctx), values / ranks
        rows = range(ranks)  # payload after payload, as aggregate adds them
        return poisoned(xp, xp.scatter_add_rows([indices[r] for r in rows], [shares[r] for r in rows], table.numel),
                        overflow)


@kernels_for(TopK)
class TopKKernels(SparseKernels):
    segmented = True
    flags_in_segment_steps = True
    pairs_into_frames = True
    residual_kernel = "topk_ef_step"
    residual_kernel_many = "topk_ef_step_many"


@kernels_for(Threshold)
class ThresholdKernels(SparseKernels):
    segmented = True  # on an accelerator: a bucket's selection in one native call, or by whole-buffer tensor ops
    residual_kernel = "threshold_ef_step"
    residual_kernel_many = "threshold_ef_step_many"

    def select_segments_with_residual(self, xp, g, residual, beta, gamma, table, infos, nonfinite=None):
        fused = xp.native("threshold_select_segments", g, xp.dtype(g)) if residual is not None else None
        if not fused:
            return None
        return fused(g, residual, table.start, self.compressor.threshold, beta, gamma, nonfinite=nonfinite)

    def write_selected(self, xp, p, take, layout, counts, flag=None):
        """The frame of a selection that ``select_segments_with_residual`` made (``counts``: its
        segments', host ints), written by one native call, and the new residual: p, written
        over (p - p_hat); or None."""
        places = layout.write_places(counts) if xp.native("threshold_write_segments", p) else None
        if places is None:
            return None
        table, tail, size = places
        frame = native_or_none(xp, "threshold_write_segments", p, p, take, xp.asarray(table, like=p), size, tail, flag)
        return None if frame is None else (frame, p)


@kernels_for(DGC)
class DGCKernels(SparseKernels):
    segmented = True  # (with the 'dgc' memory only without clipping: a norm per tensor)
    flags_in_segment_steps = True
    pairs_into_frames = True

    @property
    def variable_segments(self) -> bool:
        """A segment sends k slots: its k largest, those under its threshold as +0.0 (which adds
        nothing where a sum starts from +0.0), so that no rank waits for a count."""
        return False

    def compress_segments(self, xp, p, table, infos):
        ks, thresholds = self.compressor.segment_cut(xp, p, table, infos)
        (values, local), ctx, _ = self._top_segments(xp, p, table, None if ks == self._ks(table) else ks)
        slots = table.latest("slot segments", ks, lambda: xp.asarray(  # each slot's segment
            np.repeat(np.arange(len(table.numels), dtype=np.int64), ks), like=p))
        return (xp.where(xp.abs(values) >= xp.gather(thresholds, slots), values, 0.0), local), ctx, None

    def compress_segments_with_momentum(self, xp, g, state, momentum, table, infos, nonfinite=None, into=None):
        """DGC memory's step for every segment, where built: the momentum correction (one pass),
        each segment's k and cut (``segment_cut``), then top-k's segment kernels with the cut and
        the masking in their writes: (fields, ctx, new (u, v)), the overflow flag into
        ``nonfinite``; the fields None where written into ``into`` (at the own k only); or None."""
        select = xp.native("dgc_select_segments", g, xp.dtype(g))
        if not select:
            return None
        n = xp.numel(g)
        u, p = native_or_none(xp, "dgc_compensate_into", g, *state, g, momentum, xp.empty(n, "float32", like=g),
                              xp.empty(n, "float32", like=g)) or (None, None)
        if p is None:
            return None
        ks, cut = self._cut(xp, p, table, infos)
        own = ks == self._ks(table)
        into = into if own else None  # (during the warm-up the frame's layout is the step's own)
        values, local = select(p, u, table.starts, table.numels, ks, cut, nonfinite=nonfinite, frame=into)
        return (None if into else (values, local)), None if own else ks, (u, p)

    def _cut(self, xp, p, table, infos):
        """Each segment's k and threshold at this step (``DGC.segment_cut``): by one native call
        where built (each sample drawn and selected where it lies), else by tensor ops."""
        dgc, cut = self.compressor, xp.native("dgc_cut_segments", p)
        if not cut:
            return dgc.segment_cut(xp, p, table, infos)
        ratio = dgc.ratio_at(xp, infos[0].step)
        sizes, needs, ks = table.latest("dgc plan", ratio, lambda: dgc.sample_plan(table.numels, ratio))
        words = draws.bucket_seed_words(infos, dgc.seed, own=True)
        return ks, cut(p, table.starts, table.numels, sizes, needs, words)

    def step_fields(self, numels, dtype, ctx):
        """During the warm-up, k changes every step (``ctx``: this step's)."""
        return None if ctx is None else self.segment_fields(numels, dtype, ctx)

    def compress_many_with_momentum(self, xp, gs, states, momentum, infos, outs, flag=None, factor=None,
                                    into=None):
        """DGC memory's fused step with this selection for every gradient of a bucket, in one
        native call (CPU; new states written into ``outs``, the overflow flag into ``flag``
        where given; each g taken as g * factor(g) where ``factor`` is given, the clipping,
        computed only where the call runs; the pairs where ``into`` lays them out, the payloads
        then (None, None)): [(payload, ctx, new state)], or None where it does not run (or the
        step is not a known int: a traced TensorFlow step)."""
        dgc, step = self.compressor, infos[0].step
        fused = isinstance(step, numbers.Integral) and xp.native("dgc_step_many", gs[0], xp.dtype(gs[0]))
        if not fused:  # (asked once: not again to call it)
            return None
        scales = None if factor is None else [float(factor(g)) for g in gs]
        words = draws.bucket_seed_words(infos, dgc.seed, own=True)
        done = called_or_none(fused, gs, column(states, 0), column(states, 1), momentum, dgc.ratio_at(xp, step),
                              dgc.sample_ratio, words, column(outs, 0), column(outs, 1), nonfinite=flag,
                              scales=scales, into=into)
        if done is None:
            return None
        values, indices = done
        return list(zip(zip(values, indices), shapes_of(xp, gs), outs))

