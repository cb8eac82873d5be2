"""A method's fast paths, registered per compressor class beside the plans that use them.

The ``Compressor`` is the method's formula (compress, decompress, aggregate, rounds); what makes
it fast on a bucket (one native call for all of a bucket's gradients, a pass fused with residual
memory, the ranks' payloads decoded and summed in one pass, the segment-wise forms of an
accelerator's bucket) is a ``MethodKernels`` subclass:

    @kernels_for(TopK)
    class TopKKernels(SparseKernels): ...        (grace/kernels/sparse.py)

A method with none registered runs every plan through its formula: ``MethodKernels`` itself.
A fast path returns None where it does not run here (no native library, another device or
dtype, a traced step); the plan then runs the formula.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Any, Sequence

from grace import native
from grace.core import draws
from grace.core.buffers import shapes_of
from grace.core.compressor import Compressor, Payload, Shape, TensorInfo, finished, native_or_none
from grace.core.journal import left_on_device, poisoned
from grace.core.plans.by_class import ByClass


class MethodKernels:
    """The formula's own forms: no native call; the segment-wise forms absent."""

    #: the segment-wise forms exist (the segmented plan: one pass over an accelerator's bucket)
    segmented = False
    #: grace.native's "<name>_compress_segments" / "<name>_decompress_segments": the per-tensor
    #: kernels on every segment in one call
    segment_kernel = ""
    #: grace.native's kernel that decodes every rank's payload of a tensor and adds them in one pass
    #: (its "_into" form: a bucket's gradients at once, CPU)
    sum_kernel = ""
    #: grace.native.compress_many's name for this method (a bucket's payloads in one call, CPU)
    many_kernel = ""
    #: compress_segments_with_residual, where it runs, writes the overflow flag into its
    #: ``nonfinite`` (from the pass that reads g): no pass of the plan's own for it
    flags_in_segment_steps = False
    #: the fused segment step (value, index) pairs can write them into the frame of the bucket's
    #: own layout (``SegmentedFrame.pair_slots``) in place of its fields: no frame made of them
    pairs_into_frames = False
    #: compress_many_with_residual takes ``defer=True``: its new residuals may then be ``Deferred``
    #: ones whose buffers are its outs (their subtraction left to its next call's pass)
    defers_residual = False

    def __init__(self, compressor):
        self.compressor = compressor

    @property
    def variable_segments(self) -> bool:
        """Whether a segment-wise bucket's frames vary in length (each rank's, each step)."""
        return self.compressor.traits.variable_length

    @property
    def mean_kernel(self) -> str:
        """grace.native's kernel that decodes every rank's payloads (of a tensor, or of every
        segment), adds and finishes them in one pass: the segment kernels' "<name>_mean_segments"."""
        return f"{self.segment_kernel}_mean_segments" if self.segment_kernel else ""

    def arguments(self) -> tuple:
        """What the native kernels take after the tensors (and draws): the method's parameters."""
        return ()

    def draws(self, numels: Sequence[int]):
        """Random methods: how many uniform draws ``compress`` makes for tensors of ``numels``
        elements, from ``info.rank_seed(seed)``; None: it draws none."""
        return None

    # --- every plan: the ranks' payloads of a tensor ----------------------------------------
    def aggregate(self, xp, payloads: Sequence[Payload], ctx) -> Any:
        """``compressor.aggregate``, with every rank's payload decoded, summed and finished in one
        native pass where the method has one (``mean_kernel``)."""
        mean = xp.native(self.mean_kernel, payloads[0][0], ctx.dtype) if self.mean_kernel else None
        if not mean:
            return self.compressor.aggregate(xp, payloads, ctx)
        n = len(payloads)
        rows = [xp.concat([xp.flatten(p[i]) for p in payloads]) for i in range(len(payloads[0]))]
        return xp.reshape(mean(*rows, (ctx.numel,), n, self.compressor.finish(n), None, *self.arguments()), ctx.shape)

    # --- fused with residual memory (grace.kernels.residual) ------------------------------
    def compress_with_residual(self, xp, g, residual, beta: float, gamma: float, info: TensorInfo, out=None):
        """p = gamma * g + beta * residual, compress(p) and the new residual p - decompress(compress(p))
        in one pass (the residual written into ``out`` where given): (payload, ctx, new residual)."""
        return None

    def compress_many_with_residual(self, xp, gs, residuals, beta: float, gamma: float, infos, outs, flag=None,
                                    into=None):
        """``compress_with_residual`` of every gradient of a bucket in one call, the new residuals
        written into ``outs``: a list of (payload, ctx, new residual). ``flag``, ``into``: as
        ``Feedback.fused_steps``'."""
        return None

    def residual_into(self, xp, p, payload: Payload, ctx, out):
        """p - decompress(payload) written into ``out`` (which may be ``p``) without a dense
        decompression."""
        return None

    def firsts_with_residual(self, xp, gs, residuals, beta: float, gamma: float, infos: Sequence[TensorInfo], states,
                             p_outs, nonfinite=None, places=None):
        """Multi-round methods: each p = gamma * g + beta * residual written into ``p_outs[i]`` in
        the pass that makes its first payload (``nonfinite`` set where a g holds an inf or a NaN):
        the first payloads (None where not made), for ``rounds_many``, whose last pass then writes
        the new residual p - p_hat over p."""
        return None

    # --- the per-gradient plan: a bucket's gradients in one call (CPU) ---------------------
    def compress_many(self, xp, gs, infos: Sequence[TensorInfo], flag=None, into=None):
        """``compress`` of every gradient of a bucket (stateless methods) in one native call
        (``many_kernel``), random methods drawing from each gradient's rank seed: a list of
        (payload, ctx). ``flag``, ``into``: as ``Feedback.fused_steps``'."""
        compressor = self.compressor
        if not self.many_kernel or type(compressor).step is not Compressor.step:  # (a step with state: Signum's)
            return None
        if not isinstance(infos[0].step, numbers.Integral):
            return None
        drawn = self.draws([1]) is not None  # (a random method: it draws)
        words = draws.bucket_seed_words(infos, compressor.seed, own=True) if drawn else None
        done = native_or_none(xp, "compress_many", gs[0], self.many_kernel, gs, words, *self.arguments(),
                              nonfinite=flag, into=into)
        return None if done is None else list(zip(done, shapes_of(xp, gs)))

    def compress_many_into(self, xp, gs, infos: Sequence[TensorInfo], pieces, step_bytes: int = 0) -> Any:
        """Allreduce methods with no memory: every gradient compressed in one call into one flat
        buffer kept by the exchange (``pieces(dtype, numels)``: its views of those sizes, in order),
        which then travels as it is: (the payloads, each of those views; their ctxs). ``step_bytes``:
        the bytes of the step's gradients, every bucket's (0: this bucket's alone), which are
        compressed before this bucket's payloads are read back."""
        return None

    def averaged_many(self, xp, summed: Sequence[Payload], ctxs, n: int, outs) -> Any:
        """Allreduce methods: ``decompress`` of every gradient's summed payload divided by n, to the
        bit, written into ``outs`` in one call: the list of ``outs``."""
        return None

    def aggregate_many(self, xp, payloads: Sequence[Sequence[Payload]], ctxs, outs) -> Any:
        """``aggregate`` of every gradient of a bucket (``payloads[i]``: the ranks' payloads of
        gradient i, or a ``grace.native.FrameRows`` of them), written into ``outs`` in one call:
        the list of ``outs``."""
        # each sum finished (the mean, ...) as the kernel stores it
        finish = self.compressor.finish(native.payload_ranks(payloads))
        return native_or_none(xp, self.sum_kernel and f"{self.sum_kernel}_into", outs[0], payloads, outs,
                              *self.arguments(), finish=finish)

    # --- the multi-round plan ---------------------------------------------------------------
    def rounds_many(self, xp, xs, infos: Sequence[TensorInfo], states, outs=None, firsts=None, deferred=None,
                    places=None):
        """All of a bucket's rounds in one generator: each round yields every tensor's payload
        (an empty tuple once its rounds are done), all summed by one allreduce, and receives the
        sums; it returns every tensor's (g_hat, p_hat, state). ``firsts[i]``: tensor i's first
        payload where ``firsts_with_residual`` made it; ``deferred[i]``: p_hat is then left
        unmade, an object whose ``residual_of(x_i)`` is the new memory (a ``Deferred`` state).
        ``places(name, shapes)``: where the exchange keeps tensors of ``shapes`` per ``name`` for
        the bucket (the same ones step after step: ``Buffers.shaped_pieces``), or None.
        Here: each tensor's ``rounds`` side by side."""
        assert not any(firsts or []), "firsts come from a method's own firsts_with_residual"
        count = len(xs)
        running = [self.compressor.rounds(xp, x, info, state, out)
                   for x, info, state, out in zip(xs, infos, states, outs or [None] * count)]
        payloads, results = [next(r) for r in running], [None] * count
        while any(result is None for result in results):
            summed = yield payloads
            payloads = [()] * count
            for i, total in enumerate(summed):
                if results[i] is None:
                    try:
                        payloads[i] = running[i].send(total)
                    except StopIteration as done:
                        results[i] = done.value
        return results

    # --- the segmented plan -----------------------------------------------------------------
    def segment_fields(self, numels: Sequence[int], dtype: str):
        """Per payload position, (element count per segment, wire dtype per segment) of what each
        segment of ``numels`` elements would send alone."""
        raise NotImplementedError

    def step_fields(self, numels: Sequence[int], dtype: str, ctx):
        """``segment_fields`` of this step's frame where they change by step (``ctx``: what
        ``compress_segments`` gave this step); None: the bucket's own, every step."""
        return None

    def compress_segments(self, xp, p, table, infos: Sequence[TensorInfo]):
        """Every segment of the flat ``p`` compressed, as (fields, ctx, p_hat): field j holds all
        segments' j-th payload tensors in a row; p_hat is what ``p`` becomes (None: the caller
        asks ``decompress_segments``). The segment kernels where built, else ``encode_segments``."""
        compressor = self.compressor
        fused = xp.native(f"{self.segment_kernel}_compress_segments", p, xp.dtype(p)) if self.segment_kernel else None
        if fused:  # (a random method's draws made in the kernel, from each segment's seed words)
            counts = table.cached("draws", lambda: self.draws(table.numels))
            words = () if counts is None else (draws.bucket_seed_words(infos, compressor.seed, own=True),)
            return fused(p, table.starts, table.numels, *words, *self.arguments()), None, None
        return self.encode_segments(xp, p, table, infos), None, None

    def encode_segments(self, xp, p, table, infos: Sequence[TensorInfo]):
        """``compress`` of every segment in tensor ops, as fields. Here each segment's own
        ``compress`` in turn; a method's whole-bucket form overrides it (a few ops per bucket)."""
        payloads = [self.compressor.compress(xp, p[start:start + n], info)[0]
                    for start, n, info in zip(table.starts, table.numels, infos)]
        return [xp.concat(list(field)) for field in zip(*payloads)]

    def decode_segments(self, xp, fields, table):
        """``decompress`` of every segment in tensor ops, flat; as ``encode_segments``."""
        offsets = table.cached("field offsets", lambda: [
            [0, *itertools.accumulate(counts)] for counts, _ in self.segment_fields(table.numels, "float32")])
        return xp.concat([
            xp.flatten(self.compressor.decompress(xp, tuple(f[o[s]:o[s + 1]] for f, o in zip(fields, offsets)),
                                                  Shape((n,), "float32")))
            for s, n in enumerate(table.numels)])

    def compress_segments_with_residual(self, xp, g, residual, beta: float, gamma: float, table, infos,
                                        nonfinite=None, into=None):
        """Residual memory's step for every segment in one go: (fields, ctx, new residual); the
        overflow flag into ``nonfinite`` where the kernels say they write it (``flags_in_segment_steps``);
        the fields written into the frame ``into`` instead where given and the kernels say they
        write pairs there (``pairs_into_frames``: then the fields are None)."""
        return None

    def select_segments_with_residual(self, xp, g, residual, beta: float, gamma: float, table, infos,
                                      nonfinite=None):
        """A variable-length selection (``select_segments``) of p = compensate(g, residual), in one
        native call: (p, the mask, each segment's count, the header ``SparseFrames.header_of``
        makes of them and the flag); the overflow flag into ``nonfinite`` where given; or None."""
        return None

    def write_selected(self, xp, p, take, layout, counts, flag=None):
        """The frame of a selection ``select_segments_with_residual`` made, and the new residual,
        in one native call: (frame, new residual), or None."""
        return None

    def _segment_decoder(self, xp, like):
        return xp.native(f"{self.segment_kernel}_decompress_segments", like, "float32") if self.segment_kernel \
            else None

    def decompress_segments(self, xp, fields, ctx, table):
        """Every segment's decompress, flat (allreduce methods: of the summed fields)."""
        fused = self._segment_decoder(xp, fields[0])
        if fused:
            return fused(*fields, table.numels, *self.arguments())
        return self.decode_segments(xp, fields, table)

    def summed_mean(self, xp, summed, ctx, table, ranks: int, overflow):
        """Allreduce methods: ``decompress_segments`` of the summed fields divided by ``ranks``,
        NaN where ``overflow`` (the summed flags, left on the device) counts a rank, by one native
        call; None where the method has no such call (decoded, divided, then poisoned)."""
        return None

    def frames_mean(self, xp, received, layout, table, ranks: int):
        """Allgather methods: ``aggregate_segments`` of the ranks' frames (``received``, end to
        end, of ``layout``) by one native call that reads them where they lie, poisoned by their
        flags, and how many ranks flagged an overflow (one float32 on the device); None where
        the method has no such call (the fields are read first)."""
        return None

    def aggregate_segments(self, xp, fields, ctx, table, ranks: int, overflow=None):
        """Allgather methods: the flat aggregate over ``ranks`` of the received fields (each a
        (ranks, field size) tensor): each rank's payloads decoded and added, rank after rank, then
        finished (``Compressor.finish``); poisoned where ``overflow`` counts a rank. The native
        kernel does it all in one call (with the count left on the device); else all ranks' are
        decoded at once: their fields in a row are the segments of every rank in turn."""
        flat = [xp.flatten(f) for f in fields]
        fused = xp.native(self.mean_kernel, flat[0]) if self.mean_kernel else None
        if fused:
            count = left_on_device(overflow)
            mean = fused(*flat, table.numels, ranks, self.compressor.finish(ranks), count, *self.arguments())
            return mean if count is not None else poisoned(xp, mean, overflow)
        decoded = xp.reshape(self.decompress_segments(xp, flat, ctx, table.repeated(xp, ranks)), (ranks, table.numel))
        total = decoded[0]
        for r in range(1, ranks):
            total = total + decoded[r]
        return poisoned(xp, finished(self.compressor, xp, total, ranks, True), overflow)


_REGISTRY = ByClass(MethodKernels)
#: register the decorated ``MethodKernels`` subclass for the given compressor classes (and their subclasses)
kernels_for = _REGISTRY.register
#: the kernels of a compressor: those registered for its class (or the nearest base), else ``MethodKernels``
kernels_of = _REGISTRY.of
