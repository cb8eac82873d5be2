"""The segment-wise plan: a bucket's gradients compressed in one pass over its flat buffer, with
one flat memory, each gradient with its per-tensor result (``grace.core.segments``).

It is an accelerator's plan for the methods that can (``MethodKernels.segmented``), where a launch
per gradient costs more than the arithmetic. The fields of every segment travel in one
allreduce, or one frame (fixed layout: ``SegmentedFrame``; variable lengths: ``SparseFrames``);
a frame larger than the dense bucket is sent dense.
"""
from __future__ import annotations

from typing import Any, List

from grace.core import bucket as frames
from grace.core import segments
from grace.core.bucket import Dense, Segment
from grace.core.compressor import Collective, divided
from grace.core.plans.base import BucketPending, BucketPlan, defers_on_device, with_dense


class Segmented(BucketPlan):
    name = "segmented"
    flat_memory = True

    def __init__(self, services, bucket, why: str, xp, like):
        super().__init__(services, bucket, why)
        guarded, self.variable = services.journal.guarded, services.kernels.variable_segments
        self.table = segments.SegmentTable.build(xp, bucket.numels, like)
        self.own_layout = segments.SparseFrames(xp, self.table, bucket.dtype, guarded, like) \
            if self.variable else self._fixed(xp, services.kernels.segment_fields(self.table.numels, bucket.dtype), like)

    def _fixed(self, xp, fields, like):
        return segments.SegmentedFrame(xp, fields, self.services.journal.guarded, like)

    def _layout_of(self, xp, ctx, like):
        """This step's layout: the bucket's own, unless its fields change by step (``step_fields``:
        then the latest step's is kept, not one per step)."""
        fields = None if self.variable else self.services.kernels.step_fields(self.table.numels, self.bucket.dtype, ctx)
        if fields is None:
            return self.own_layout
        key = tuple((tuple(counts), tuple(dtypes)) for counts, dtypes in fields)
        return self.table.latest("step layout", key, lambda: self._fixed(xp, fields, like))

    def start(self, xp, grads, flat) -> BucketPending:
        s, bucket = self.services, self.bucket
        compressor, memory = s.compression.compressor, s.compression.memory
        g = flat if flat is not None else s.buffers.concat_gradients(bucket, xp, grads)
        step = s.journal.next_step(bucket.key, g)
        s.transport.stats.add(0, 4 * bucket.numel)
        e = s.memory_state(xp, bucket.key, g)
        pending = BucketPending(bucket, xp, [Segment(bucket.key, (bucket.numel,), 0, bucket.numel)], g, [e],
                                defer=defers_on_device(xp, g))
        if s.journal.guarded:
            pending.flag = xp.nonfinite([g], self.flag_dtype())
        infos = [s.info(name, step) for name in bucket.names]
        fused = s.feedback.fused_segments(xp, s.kernels, g, e, self.table, infos)
        e_new = None  # the new memory where a fused kernel made it and it stands
        if fused is not None:  # compensate, compress and the new memory in one go
            fields, pending.segment_ctx, e_new = fused
            p = p_hat = None
        else:
            p = memory.compensate(xp, g, e)
            fields, pending.segment_ctx, p_hat = s.kernels.compress_segments(xp, p, self.table, infos)
        pending.layout = self._layout_of(xp, pending.segment_ctx, g)
        frame = None
        if compressor.collective is Collective.ALLREDUCE:  # (fixed sizes: never more than dense)
            pending.wait, nbytes = s.transport.allreduce_units(xp, bucket.key, [tuple(fields)], pending.flag,
                                                               defer=pending.defer)
        else:
            (header, frame), p = self._frame(pending, fields, p)
            if pending.sent_dense:
                p_hat, e_new = p, None
        if memory.needs_feedback:
            with s.phase("feedback"):
                if e_new is None:  # from p and p_hat
                    if p_hat is None:
                        p_hat = s.kernels.decompress_segments(xp, fields, pending.segment_ctx, self.table)
                    e_new = memory.update(xp, p, p_hat, e)
                s.journal.set("memory", bucket.key, e_new)
        if frame is not None:
            nbytes = s.transport.send_frame(pending, frame, self.variable, header)
        s.transport.stats.add(nbytes, 0)
        return pending

    def _frame(self, pending: BucketPending, fields, p):
        """This rank's (header, frame), and p; the dense bucket where its encoding would be
        larger (fixed sizes: every rank decides alike, and the frame has no header; variable
        ones: each rank for its own frame)."""
        s, xp, layout, variable = self.services, pending.xp, pending.layout, self.variable
        dense = layout.size(pending.segment_ctx[0]) > layout.dense_size() if variable else \
            layout.size > frames.frame_size([self.bucket.numel], [self.bucket.dtype], False, s.journal.guarded)
        if not dense:
            sent = layout.write(xp, *fields, pending.segment_ctx, pending.flag) if variable else \
                (None, layout.write(xp, fields, pending.flag))
            return sent, p
        p = s.compression.memory.compensate(xp, pending.g, pending.old[0]) if p is None else p
        pending.sent_dense = True
        sent = layout.write_dense(xp, p, pending.flag) if variable else \
            (None, frames.frame(xp, [p], False, pending.g, pending.flag))
        return sent, p

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        flat, overflow = self._mean(pending)
        return self.deliver(pending, [flat], overflow, pending.outs or [None] * len(self.bucket.segments), into)

    def _mean(self, pending: BucketPending):
        """The flat mean of the bucket's exchange, and the overflow count (None: not guarded, or
        poisoned in already)."""
        s, xp, bucket, n = self.services, pending.xp, self.bucket, self.services.communicator.size
        compressor, table, flagged = s.compression.compressor, self.table, pending.flag is not None
        if compressor.collective is Collective.ALLREDUCE:
            (summed,), overflow, fresh = pending.wait()  # (its waits are timed inside)
            return divided(xp, s.kernels.decompress_segments(xp, summed, pending.segment_ctx, table), n, fresh), \
                overflow
        received = s.transport.wait(pending.wait)
        if self.variable:
            read, flags = pending.layout.read(xp, received, self.headers(pending), n, pending.header_counts)
            return self._sparse_mean(xp, read), \
                s.journal.overflow(xp, [flags], pending.defer) if flagged else None
        if isinstance(received, list):  # broadcasts: one frame per rank
            received = xp.concat(received)
        if pending.sent_dense:
            nbytes = bucket.numel * frames.ITEMSIZE[bucket.dtype]  # then the flag byte, then padding
            rows = xp.reshape(received, (n, frames.frame_size([bucket.numel], [bucket.dtype], False, flagged)))
            g_hat = with_dense(None, 0, [xp.from_bytes(rows[r, :nbytes], bucket.dtype) for r in range(n)], n)
            flags = rows[:, nbytes] if flagged else None
            return g_hat, s.journal.overflow(xp, [flags], pending.defer) if flagged else None
        fields, flags = pending.layout.read(xp, received, n)  # (poisoned by the aggregate)
        overflow = s.journal.overflow(xp, [flags], pending.defer) if flagged else None
        return s.kernels.aggregate_segments(xp, fields, pending.segment_ctx, table, n, overflow), None

    def headers(self, pending: BucketPending):
        if pending.header_wait is not None and pending.headers is None:
            pending.headers = self.services.transport.wait(pending.header_wait)
        return pending.headers

    def _sparse_mean(self, xp, read):
        """The flat mean of the ranks' (value, index) pairs and dense buckets (``read``), with
        the per-tensor exchange's additions: the pairs' values over their count of ranks, rank
        after rank (``Sparsifier.aggregate``); then weighed, and the dense buckets added."""
        n = self.services.communicator.size
        pairs = [r for r in read if not isinstance(r, Dense)]
        dense = [r.values for r in read if isinstance(r, Dense)]
        g_hat = None
        if pairs:  # (every rank's values divided by one op)
            shares = xp.split(xp.concat([v for v, _ in pairs]) / len(pairs), [xp.numel(v) for v, _ in pairs])
            g_hat = xp.scatter_add_rows([i for _, i in pairs], shares, self.bucket.numel)
        return with_dense(g_hat, len(pairs), dense, n) if dense else g_hat
