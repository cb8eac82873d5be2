"""The segment-wise plan: a bucket's gradients compressed in one pass over its flat buffer, with
one flat memory, each gradient with its per-tensor result (``grace.core.segments``).

It is an accelerator's plan for the methods that can (``MethodKernels.segmented``), where a launch
per gradient costs more than the arithmetic. The fields of every segment travel in one
allreduce, or one frame (fixed layout: ``SegmentedFrame``; variable lengths: ``SparseFrames``);
a frame larger than the dense bucket is sent dense.
"""
from __future__ import annotations

import itertools
from typing import Any, List, Sequence

import numpy as np

from grace.core import bucket as frames
from grace.core import segments, sparse_frames
from grace.core.bucket import Dense, Segment
from grace.core.compressor import Collective, divided
from grace.core.plans.base import BucketPending, BucketPlan, defers_on_device, with_dense
from grace.core.plans.tensor_ops import tensor_ops_of


class Segmented(BucketPlan):
    name = "segmented"
    flat_memory = True

    def __init__(self, services, bucket, why: str, xp, like):
        super().__init__(services, bucket, why)
        guarded, self.variable = services.journal.guarded, services.kernels.variable_segments
        self.table = segments.SegmentTable.build(xp, bucket.numels, like)
        self.own_layout = sparse_frames.SparseFrames(xp, self.table, bucket.dtype, guarded, like) \
            if self.variable else self._fixed(xp, services.kernels.segment_fields(self.table.numels, bucket.dtype), like)
        self.tensor_ops = None  # the tensor-op path's two phases, to be fused (after a first step that ran it)
        self._tensor_op_start = False  # whether the latest start ran that path

    def _fixed(self, xp, fields, like):
        return segments.SegmentedFrame(xp, fields, self.services.journal.guarded, like)

    def _layout_of(self, xp, ctx, like):
        """This step's layout: the bucket's own, unless its fields change by step (``step_fields``:
        then the latest step's is kept, not one per step)."""
        fields = self.services.kernels.step_fields(self.table.numels, self.bucket.dtype, ctx)
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
        if self.tensor_ops is not None:
            return self._start_fused(pending, g, e, step)
        infos = s.infos(bucket.names, bucket.name_keys, step)
        if self.variable:
            return self._select(pending, e, infos)
        # the overflow flag from one pass over g; or from the fused step's kernels, which read g anyway
        in_call = s.journal.guarded and s.kernels.flags_in_segment_steps
        if s.journal.guarded and not in_call:
            pending.flag = xp.nonfinite([g], self.flag_dtype())
        into, frame_flag = self._frame_into(xp, g, in_call)
        flag = (frame_flag if into is not None else xp.empty(1, self.flag_dtype(), like=g)) if in_call else None
        fused = s.feedback.fused_segments(xp, s.kernels, g, e, self.table, infos, flag, into)
        if in_call:
            pending.flag = flag if fused is not None else xp.nonfinite([g], self.flag_dtype())
        e_new = None  # the new memory where a fused kernel made it and it stands
        self._tensor_op_start = fused is None
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
        elif fields is None:  # (written into the frame by the fused step)
            frame = into[0]
        else:
            frame, p = self._frame(pending, fields, p)
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
            nbytes = s.transport.send_frame(pending, frame, False)
        s.transport.stats.add(nbytes, 0)
        return pending

    def _start_fused(self, pending: BucketPending, g, e, step: int) -> BucketPending:
        """``start`` by the tensor-op phase (``TensorOps.compress``): the frame, the flag and the
        new memory from one call (a method that draws: its infos with the step as a tensor); a
        variable-length bucket's selection, counts and header (``SelectionOps.select``)."""
        s, xp = self.services, pending.xp
        infos = ()
        if self.tensor_ops.seeded:
            step = xp.asarray(np.int64(step), like=g)
            infos = tuple(s.infos(self.bucket.names, self.bucket.name_keys, step))  # (plain TensorInfos: traced)
        if self.variable:  # (the new memory kept until the frame is made: unless it goes dense)
            p, take, counts, header, pending.flag, e_new = self.tensor_ops.select(g, e, infos)
            return self._send_header(pending, (p, take, counts, False, e_new), header)
        sent, pending.flag, e_new, pending.segment_ctx = self.tensor_ops.compress(g, e, infos)
        pending.layout = self.own_layout
        if e_new is not None:
            s.journal.set("memory", self.bucket.key, e_new)
        if s.compression.compressor.collective is Collective.ALLREDUCE:  # (the fields to sum)
            pending.wait, nbytes = s.transport.allreduce_units(xp, self.bucket.key, [sent], pending.flag,
                                                               defer=pending.defer)
        else:
            nbytes = s.transport.send_frame(pending, sent, False)
        s.transport.stats.add(nbytes, 0)
        return pending

    def _select(self, pending: BucketPending, e, infos) -> BucketPending:
        """A variable-length bucket's start: its selection and counts, whose header goes now; its
        frame once the ranks' counts are read back (``send_selected``). Compensation, selection,
        counts, header and flag in one native call where there is one."""
        s, xp, g, layout = self.services, pending.xp, pending.g, self.own_layout
        flag = xp.empty(1, self.flag_dtype(), like=g) if s.journal.guarded else None
        selected = s.feedback.selected_segments(xp, s.kernels, g, e, self.table, infos, flag)
        fused = selected is not None  # (then its frame too, by ``write_selected``)
        self._tensor_op_start = not fused
        if fused:
            p, take, counts, header = selected
            pending.flag = flag
        else:
            pending.flag = xp.nonfinite([g], self.flag_dtype()) if s.journal.guarded else None
            p = s.compression.memory.compensate(xp, g, e)
            take, counts = s.kernels.select_segments(xp, p, self.table, infos)
            header = layout.header_of(xp, counts, pending.flag)
        return self._send_header(pending, (p, take, counts, fused, None), header)

    def _send_header(self, pending: BucketPending, selection, header) -> BucketPending:
        """A variable-length bucket's header sent; its ``selection`` (p, the mask, the counts,
        whether a native call made them, the new memory where made) kept for ``send_selected``."""
        s = self.services
        pending.selection, pending.layout = selection, self.own_layout
        s.transport.stats.add(s.transport.send_header(pending, header), 0)
        return pending

    def _frame_into(self, xp, g, in_call: bool):
        """Where a fused step may write this rank's frame of the bucket's own layout in place of
        its fields (``MethodKernels.pairs_into_frames``): (a new frame, its pairs' places, its first
        byte after the flag) and its flag byte (a view: the step's flag goes there); (None, None)
        for an allreduce, a frame sent dense, or a flag the step does not write."""
        s, layout = self.services, self.own_layout
        if not s.kernels.pairs_into_frames or s.compression.compressor.collective is Collective.ALLREDUCE \
                or (s.journal.guarded and not in_call) \
                or layout.size > frames.frame_size([self.bucket.numel], [self.bucket.dtype], False, s.journal.guarded):
            return None, None
        frame = xp.empty(layout.size, "uint8", like=g)
        slots, flag_at = layout.pair_slots(xp, self.table.starts)
        return (frame, slots, layout.size - layout.pad), (frame[flag_at:flag_at + 1] if flag_at >= 0 else None)

    def _frame(self, pending: BucketPending, fields, p):
        """This rank's frame, and p; the dense bucket where the encoding would be larger (fixed
        sizes: every rank decides alike)."""
        s, xp, layout = self.services, pending.xp, pending.layout
        if layout.size <= frames.frame_size([self.bucket.numel], [self.bucket.dtype], False, s.journal.guarded):
            return layout.write(xp, fields, pending.flag), p
        p = s.compression.memory.compensate(xp, pending.g, pending.old[0]) if p is None else p
        pending.sent_dense = True
        return frames.frame(xp, [p], False, pending.g, pending.flag), p

    def send_selected(self, pending: BucketPending) -> None:
        """A variable-length bucket's frame, once the ranks' counts are read back
        (``Exchange.read_counts``, or ``finish``): this rank's pairs, or its dense bucket where
        their frame would be larger; and its new memory. No wait for the device at ``start``."""
        s, xp, layout = self.services, pending.xp, pending.layout
        (p, take, counts, fused, e_sparse), pending.selection = pending.selection, None
        width, rank = len(layout.dtypes), s.communicator.rank
        own = self.counts(pending)[rank * width:(rank + 1) * width:2]
        dense = layout.sends_dense(own)
        written = s.kernels.write_selected(xp, p, take, layout, own, pending.flag) if fused and not dense else None
        if written is not None:  # the new memory made with it
            frame, e_new = written
        elif dense:
            pending.sent_dense = True
            frame, p_hat, e_new = layout.write_dense(xp, p, pending.flag), p, None
        else:  # (p_hat only where the selection made no new memory)
            fields, p_hat = s.kernels.selected_pairs(xp, p, take, (own, counts), self.table, e_sparse is None)
            frame, e_new = layout.write(xp, *fields, own, pending.flag), e_sparse
        memory = s.compression.memory
        if memory.needs_feedback:
            with s.phase("feedback"):
                s.journal.set("memory", self.bucket.key,
                              e_new if e_new is not None else memory.update(xp, p, p_hat, pending.old[0]))
        s.transport.stats.add(s.transport.send_frame(pending, frame, True), 0)

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        flat, overflow = self._mean(pending)
        return self.deliver(pending, [flat], overflow, pending.outs or [None] * len(self.bucket.segments), into)

    def _mean(self, pending: BucketPending):
        """The flat mean of the bucket's exchange, and the overflow count (None: not guarded, or
        poisoned in already)."""
        s, xp, bucket, n = self.services, pending.xp, self.bucket, self.services.communicator.size
        compressor, table, flagged = s.compression.compressor, self.table, pending.flag is not None
        if self.tensor_ops is not None and self.tensor_ops.ranks != n:  # (a resized world)
            self.tensor_ops = tensor_ops_of(self, pending)
        if compressor.collective is Collective.ALLREDUCE:
            (summed,), overflow, fresh = pending.wait()  # (its waits are timed inside)
            if self.tensor_ops is not None:
                return self.tensor_ops.mean(tuple(summed), pending.segment_ctx)[0], overflow
            mean = s.kernels.summed_mean(xp, summed, pending.segment_ctx, table, n, overflow)
            if mean is not None:
                return mean, None  # (poisoned in it)
            self._tensor_ops_after_first_step(pending)
            return divided(xp, s.kernels.decompress_segments(xp, summed, pending.segment_ctx, table), n, fresh), \
                overflow
        if self.variable:
            if pending.selection is not None:  # (a bucket alone, or awaited before read_counts)
                self.send_selected(pending)
            received, counts = s.transport.wait(pending.wait), self.counts(pending)
            mean = self._pairs_mean(xp, received, pending.layout, counts)
            if mean is None:
                read, flags = pending.layout.read(xp, received, self.headers(pending), n, counts)
                mean = self._sparse_mean(xp, read)
                self._tensor_ops_after_first_step(pending)
            else:
                flags = pending.layout.flags(counts, n)
            return mean, s.journal.counted(sum(flags)) if flagged else None
        received = s.transport.wait(pending.wait)
        if isinstance(received, list):  # broadcasts: one frame per rank
            received = xp.concat(received)
        if self.tensor_ops is not None:  # (the count left on the device, read when the step ends)
            mean, count = self.tensor_ops.mean(received, pending.segment_ctx)
            if count is not None:
                s.journal.leave_on_device(count)
            return mean, None
        if pending.sent_dense:
            nbytes = bucket.numel * frames.ITEMSIZE[bucket.dtype]  # then the flag byte, then padding
            rows = xp.reshape(received, (n, frames.frame_size([bucket.numel], [bucket.dtype], False, flagged)))
            g_hat = with_dense(None, 0, [xp.from_bytes(rows[r, :nbytes], bucket.dtype) for r in range(n)], n)
            flags = rows[:, nbytes] if flagged else None
            return g_hat, s.journal.overflow(xp, [flags], pending.defer) if flagged else None
        read = s.kernels.frames_mean(xp, received, pending.layout, table, n)
        if read is not None:  # (poisoned in it, and the flags counted)
            mean, flags = read
        else:
            flags = pending.layout.flags(xp, received, n)
        overflow = s.journal.overflow(xp, [flags], pending.defer) if flagged else None
        if read is None:
            fields, _ = pending.layout.read(xp, received, n)
            mean = s.kernels.aggregate_segments(xp, fields, pending.segment_ctx, table, n, overflow)
            self._tensor_ops_after_first_step(pending)
        return mean, None

    def _tensor_ops_after_first_step(self, pending: BucketPending) -> None:
        """Where both phases of a step ran the tensor ops: from now on in two calls."""
        if self._tensor_op_start and self.tensor_ops is None:
            self.tensor_ops = tensor_ops_of(self, pending)

    def headers(self, pending: BucketPending):
        """Every rank's header of the bucket, on the device (awaited once)."""
        if pending.header_wait is not None and pending.headers is None:
            pending.headers = self.services.transport.wait(pending.header_wait)
        return pending.headers

    def counts(self, pending: BucketPending):
        """Every rank's header as host ints: read back with other buckets' already, or now."""
        if pending.header_counts is None:
            width = len(pending.layout.dtypes) * self.services.communicator.size
            pending.header_counts = pending.xp.host_ints(self.headers(pending), width)
        return pending.header_counts

    def _pairs_mean(self, xp, received, layout, counts):
        """The flat mean of the ranks' variable-length frames (``received``, end to end) by one
        native call that reads their pairs where they lie, as ``_sparse_mean`` adds them, or by
        the fused tensor ops (``SelectionOps.pairs``, then added rank after rank); None where
        neither runs (a rank sent its dense bucket, the values are not float32)."""
        if isinstance(received, list):
            return None
        mean, n = xp.native("sparse_variable_mean", received), self.services.communicator.size
        table = layout.pair_table(counts, n) if mean or self.tensor_ops is not None else None
        if table is None:
            return None
        if mean:
            return mean(received, xp.asarray(table, like=received), n, n, self.bucket.numel)
        rows = table.reshape(n, -1, 6)
        sizes = rows[:, :, 3].sum(axis=1)  # (each rank's pairs)
        total = int(sizes.sum())  # (none selected: zeros; one: op by op, as dynamo compiles it apart)
        if total < 2:
            return xp.zeros(self.bucket.numel, layout.dtype, like=received) if total == 0 else None
        rows[:, :, 2] += (np.cumsum(sizes) - sizes)[:, None]  # (each row's first pair among all ranks')
        columns = np.ascontiguousarray(rows.reshape(-1, 6).T)  # (each column's values in a row)
        indices, shares = self.tensor_ops.pairs(received, xp.asarray(columns, like=received), total)
        sizes = sizes.tolist()
        return xp.scatter_add_rows(xp.split(indices, sizes), xp.split(shares, sizes), self.bucket.numel)

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


def read_headers(pendings: Sequence[BucketPending]) -> None:
    """The ranks' headers of the variable-length buckets among ``pendings``, read back in one
    wait (not one per bucket); then each one's frame sent (``Segmented.send_selected``)."""
    held = [p for p in pendings if p.selection is not None]
    if len(held) > 1:  # (a bucket alone reads its own)
        xp, headers = held[0].xp, [p.plan.headers(p) for p in held]
        sizes = [xp.numel(h) for h in headers]
        counts = xp.host_ints(xp.concat(headers), sum(sizes))
        for pending, start, size in zip(held, itertools.accumulate([0] + sizes), sizes):
            pending.header_counts = counts[start:start + size]
    for pending in held:
        pending.plan.send_selected(pending)
