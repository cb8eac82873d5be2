"""The per-gradient plan: each gradient of a bucket compressed as its own tensor, with its own
memory (the same k, scales and draws as alone), and every payload sent in one collective: one
allreduce, or one frame (``grace.core.bucket``) allgathered or broadcast.

It is the CPU's plan: each gradient in turn is a cache-sized pass, with no bucket-sized
temporaries. Where a native kernel takes the whole bucket in one call (a CPU's top-k, DGC, fp16),
it runs it; a frame whose encoding would be larger than the dense bucket is sent dense, and the
memory then records all of it as sent.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np

from grace import native
from grace.core import bucket as frames
from grace.core.bucket import Dense
from grace.core.buffers import assign, buffers_of
from grace.core.compressor import Collective, written
from grace.core.memory import Deferred, buffer_of, stored
from grace.core.plans.base import BucketPending, BucketPlan, with_dense
from grace.core.plans.reference import payload_flag


class PerGradient(BucketPlan):
    name = "per-gradient"

    def start(self, xp, grads, flat) -> BucketPending:
        s = self.services
        pending, g_units, infos, states = self.begin(xp, grads, flat)
        units, g = pending.units, pending.g
        # The overflow flag from one pass over the gradients; or from the bucket kernel, which
        # checks each gradient as it reads it (a CPU); or from the payloads where they carry it.
        guarded = s.journal.guarded
        in_call = guarded and len(units) > 1 and xp.mutable_tensors and not xp.on_accelerator(g)
        if guarded and not s.flags_from_payload and not in_call:
            pending.flag = xp.nonfinite(g_units, self.flag_dtype())
        if not self._compressed_into_one_buffer(pending, g_units, infos):
            self._compress(pending, g_units, infos, states, in_call)
        return pending

    def _compressed_into_one_buffer(self, pending: BucketPending, g_units, infos) -> bool:
        """Unguarded allreduce methods with no memory (fp16 on a CPU): one native call writes every
        payload into a buffer kept per bucket, sent as it is. Whether it ran."""
        s, xp = self.services, pending.xp
        key = self.bucket.key
        if not (s.compression.collective is Collective.ALLREDUCE and s.compression.memory.passes_gradient
                and not s.journal.guarded and len(g_units) > 1 and xp.mutable_tensors):
            return False
        made = []

        def pieces(dtype, numels):
            buffer, views = s.buffers.pieces_of(xp, f"{key}.payload", dtype, numels, pending.g)
            made.append(buffer)
            return views

        many = s.kernels.compress_many_into(xp, g_units, infos, pieces, self.bucket.step_bytes)
        if many is None:
            return False
        payloads, pending.ctxs = many
        pending.wait, nbytes = s.transport.allreduce_units(xp, key, payloads, written_in=made[0])
        s.transport.stats.add(nbytes, 0)
        return True

    def _compress(self, pending: BucketPending, g_units, infos, states, in_call: bool) -> None:
        s, xp = self.services, pending.xp
        memory = s.compression.memory
        names = self._unit_keys(pending.units)[0]
        # New memories go into spare buffers where tensors are mutable: no step allocates (and
        # page-faults) gradient-sized buffers. Both kept as the same objects step after step, so a
        # bucket call derives its native buffers of them once.
        if memory.needs_feedback:
            pending.old = s.buffers.kept(f"{self.bucket.key}.old", pending.old)  # (take_spares marks its buffers)
            kept_spares = s.buffers.take_spares(self.bucket.key, xp, names, pending.old)
        else:
            kept_spares = [None] * len(pending.units)
        spares = list(kept_spares)
        steps = self._bucket_call(pending, g_units, infos, kept_spares, in_call)
        if steps is not None:  # every unit's step from the bucket call (no step per unit in Python)
            payloads = [payload for payload, _, _ in steps]
            pending.ctxs = [ctx for _, ctx, _ in steps]
            new_memory = [_in_spare(e, spare) for (_, _, e), spare in zip(steps, spares)]
        else:
            payloads, new_memory = [], []
            for u, g_u, info, state, e, spare in zip(pending.units, g_units, infos, states, pending.old, spares):
                e = stored(e)  # (a memory whose last operation the bucket call left to its next call, made)
                fused = s.feedback.fused_step(xp, s.kernels, g_u, e, info, out=spare)
                payload, ctx, e_new = self._unit_step(xp, u.name, g_u, info, state, e, spare, fused)
                payloads.append(payload)
                pending.ctxs.append(ctx)
                new_memory.append(e_new)
        # every new memory written into its spare (a bucket call's): none moved or copied unit by unit
        in_spares = memory.needs_feedback and all(map(_in_its_spare, new_memory, spares))
        if not (self.flat_memory or in_spares):  # a memory made elsewhere keeps its own buffer (a copy costs a pass)
            for i, (u, e_new, spare) in enumerate(zip(pending.units, new_memory, spares)):
                if spare is not None and buffer_of(e_new) is not spare:
                    s.buffers.spares[u.name], spares[i] = spare, None
        if s.flags_from_payload and pending.flag is None:
            pending.flag = payload_flag(xp, s.compression, payloads)
        new_memory, nbytes = self._launch(pending, g_units, payloads, new_memory)
        if in_spares and not pending.sent_dense:  # (sent dense: new memories made again, elsewhere)
            s.buffers.spares.update(zip(names, buffers_of(pending.old)))  # the next step's spares
        else:
            for i, (u, spare) in enumerate(zip(pending.units, spares)):
                if spare is not None:
                    if buffer_of(new_memory[i]) is not spare:
                        assign(xp, spare, new_memory[i])
                        new_memory[i] = spare
                    s.buffers.spares[u.name] = buffer_of(pending.old[i])  # the old memory is the next step's spare
        if memory.needs_feedback:
            s.journal.set_many("memory", names, new_memory, pending.old)
        s.transport.stats.add(nbytes, 0)

    def _bucket_call(self, pending: BucketPending, g_units, infos, spares, in_call: bool):
        """Every gradient's (payload, ctx, new memory) from one native call for the whole bucket
        where the method has one (a CPU's top-k, DGC); else None. Where it runs, it also sets the
        overflow flag (``in_call``) and may write the payloads into the frame buffer."""
        s, xp = self.services, pending.xp
        memory = s.compression.memory
        many_units = len(pending.units) > 1
        flag = xp.zeros(1, "float32", like=pending.g) if in_call else None
        into = s.transport.frame_into(pending)
        steps = None
        if many_units and all(spare is not None for spare in spares):  # (memories kept: buffers derived once)
            steps = s.feedback.fused_steps(xp, s.kernels, g_units, pending.old, infos, spares, flag, into, defer=True)
        if steps is None and memory.passes_gradient and many_units:  # no memory: the payloads alone
            many = s.kernels.compress_many(xp, g_units, infos, flag, into)
            steps = None if many is None else [(payload, ctx, None) for payload, ctx in many]
        if steps is None:
            pending.framed = None
        if in_call and steps is not None:
            pending.flag = flag
        elif in_call and not s.flags_from_payload:
            pending.flag = xp.nonfinite(g_units, self.flag_dtype())
        return steps

    def _unit_step(self, xp, name: str, g, info, state, e, spare, fused):
        """One unit's (payload, ctx, new memory): from a fused kernel's result where one ran
        (its new memory written into ``spare`` where given), else the pipeline's steps."""
        s = self.services
        compressor, memory = s.compression.compressor, s.compression.memory
        if fused is not None:
            payload, ctx, e_new = fused
            return payload, ctx, _in_spare(e_new, spare)
        one_buffer = spare is not None and not isinstance(spare, tuple)
        # p goes into the spare buffer (the new memory is then written over it) where the payload
        # cannot be a view of p
        p = s.feedback.compensate_into(xp, g, e, spare) if compressor.traits.new_payload and one_buffer else None
        p = memory.compensate(xp, g, e) if p is None else p
        payload, ctx, state = compressor.step(xp, p, info, state)
        s.journal.set("state", name, state)
        e_new = None
        if memory.needs_feedback:
            with s.phase("feedback"):
                e_new = s.feedback.feedback_into(xp, s.kernels, p, payload, ctx, e, spare) if one_buffer else \
                    memory.update(xp, p, compressor.decompress(xp, payload, ctx), e)
        return payload, ctx, e_new

    def _launch(self, pending: BucketPending, g_units, payloads, new_memory):
        """Launch the bucket's collective: (the new memories, the bytes sent)."""
        s, xp = self.services, pending.xp
        memory = s.compression.memory
        if s.compression.collective is Collective.ALLREDUCE:
            # payloads free to be summed in place: nothing reads them (or the gradients, which
            # they may be views of) once sent, and the results are written over the gradients
            owned = memory.passes_gradient and s.writes_over(xp, pending.g)
            pending.wait, nbytes = s.transport.allreduce_units(xp, self.bucket.key, payloads, pending.flag,
                                                               owned=owned, defer=pending.defer)
            return new_memory, nbytes
        compensated = []

        def dense():  # the compensated units, computed again (the fused kernels keep no p)
            compensated.extend(memory.compensate(xp, g_u, stored(e)) for g_u, e in zip(g_units, pending.old))
            return compensated

        nbytes = s.transport.launch_frame(pending, payloads, dense)
        if pending.sent_dense and memory.needs_feedback:  # the memory records the whole bucket as sent
            with s.phase("feedback"):
                new_memory = [memory.update(xp, p_u, p_u, e) for p_u, e in zip(compensated, pending.old)]
        elif pending.sent_dense:
            new_memory = [None] * len(pending.old)
        return new_memory, nbytes

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        s, xp = self.services, pending.xp
        compressor = s.compression.compressor
        outs = pending.outs or [None] * len(self.bucket.segments)
        # Per-gradient units write each result where it goes at once: a transient is freed
        # before the next is made, so its memory serves again instead of fresh pages.
        unit_outs = [None] if self.flat_memory else outs
        if s.compression.collective is Collective.ALLREDUCE:
            summed, overflow, fresh = pending.wait()  # (its allreduce waits are timed inside)
            g_hat = s.kernels.averaged_many(xp, summed, pending.ctxs, s.communicator.size, unit_outs) \
                if all(o is not None for o in unit_outs) else None
            # A new sum is the exchange's own: averaged in place, no gradient-sized allocation
            g_hat = g_hat or [s.averaged(xp, compressor.decompress(xp, payload, ctx), fresh, out)
                              for payload, ctx, out in zip(summed, pending.ctxs, unit_outs)]
        else:
            g_hat, overflow = self._aggregate_frames(pending, unit_outs)
        return self.deliver(pending, g_hat, overflow, outs, into)

    def _aggregate_frames(self, pending: BucketPending, outs):
        """Every rank's frame read and each unit's aggregate made: (results, overflow count)."""
        s, xp, bucket = self.services, pending.xp, self.bucket
        n, flagged = s.communicator.size, pending.flag is not None
        variable = s.compression.compressor.traits.variable_length
        received = s.transport.wait(pending.wait)
        all_dense = pending.sent_dense and not variable  # every rank sent its dense bucket
        dtypes, counts = ([bucket.dtype], [bucket.numel]) if all_dense else (pending.dtypes, pending.counts)
        if isinstance(received, list):  # broadcasts: one frame per rank
            read, flags = zip(*(frames.read_frame(xp, f, 0, dtypes, counts, variable, bucket.numel, bucket.dtype,
                                                  flagged)[:2] for f in received))
        else:
            if not variable and isinstance(xp.numel(received), int) \
                    and xp.numel(received) != n * frames.frame_size(counts, dtypes, False, flagged):
                raise RuntimeError(f"grace: ranks sent payloads of different lengths for {bucket.key!r} "
                                   "(are they configured differently?)")
            if not all_dense and all(o is not None for o in outs):
                done = self._aggregate_natively(pending, received, outs)
                if done is not None:
                    return done
            read, flags, start = [], [], 0
            for _ in range(n):
                frame, flag, start = frames.read_frame(xp, received, start, dtypes, counts, variable,
                                                       bucket.numel, bucket.dtype, flagged)
                read.append(frame)
                flags.append(flag)
            if flagged and not variable:  # frames of one size: every rank's flag in one strided view, not a join
                _, flag_at, size = frames.layout(dtypes, counts, False, flagged)
                flags = [xp.reshape(received, (n, size))[:, flag_at]]
        if all_dense:
            read = [Dense(pieces[0]) for pieces in read]
        overflow = s.journal.overflow(xp, list(flags), pending.defer) if flagged else None
        return self._aggregates(pending, read, outs), overflow

    def _aggregates(self, pending: BucketPending, read, outs):
        """Each unit's mean over the ranks' frames ``read`` (payloads, or ``Dense`` buckets)."""
        s, xp, n = self.services, pending.xp, self.services.communicator.size
        dense = [f.values for f in read if isinstance(f, Dense)]
        encoded = [frames.split_payloads(f, pending.structure) for f in read if not isinstance(f, Dense)]
        if encoded and not dense and all(o is not None for o in outs):  # one native call, where there is one
            done = s.kernels.aggregate_many(xp, [[payloads[i] for payloads in encoded] for i in range(len(outs))],
                                             pending.ctxs, outs)
            if done is not None:
                return done
        out = []
        for i, (u, ctx, into) in enumerate(zip(pending.units, pending.ctxs, outs)):
            g_hat = s.kernels.aggregate(xp, [payloads[i] for payloads in encoded], ctx) if encoded else None
            if dense:  # aggregate is a mean over the payloads it gets: weigh it, add the dense ones
                g_hat = with_dense(g_hat, len(encoded), [xp.reshape(d[u.offset:u.offset + u.numel], u.shape)
                                                         for d in dense], n)
            out.append(written(xp, g_hat, into))
        return out

    def _aggregate_natively(self, pending: BucketPending, received, outs):
        """Every rank's frame, all in one tensor, handed to the method's bucket-at-once aggregate
        as native buffers at their offsets (a tensor view per piece costs more than the kernel on
        small gradients: C arrays, ``native.FrameRows``; variable-length frames' read from their
        headers natively), the flags counted on the host's bytes, or as the headers are read: (the
        aggregates written into ``outs``, the overflow count or None), or None where no such
        aggregate runs (an accelerator's tensors) or a rank sent dense."""
        s, xp, dtypes, flagged = self.services, pending.xp, pending.dtypes, pending.flag is not None
        variable, n = s.compression.compressor.traits.variable_length, s.communicator.size
        if not variable:  # every rank's frame of one layout: its pieces as C arrays, no object per rank
            pieces, flag_at, size = frames.layout(dtypes, pending.counts, False, flagged)
            try:
                rows = native.FrameRows(received, range(0, n * size, size), pieces, pending.structure)
            except native.NativeUnavailable:
                return None
            done = s.kernels.aggregate_many(xp, rows, pending.ctxs, outs)
            if done is None:
                return None
            # every rank's flag byte counted on the host's own bytes (tensor ops would run cold here)
            return done, s.journal.counted(int(np.count_nonzero(xp.to_numpy(received)[flag_at::size]))) \
                if flagged else None
        # the ranks' headers read by one native call, which counts the set flags too (None: no such
        # call here, or a rank sent its dense bucket)
        read = None if xp.on_accelerator(received) else \
            native.run("variable_rows", received, received, n, dtypes, pending.structure, flagged)
        if read is None:
            return None
        rows, flags_set = read
        done = s.kernels.aggregate_many(xp, rows, pending.ctxs, outs)
        if done is None:
            return None
        return done, s.journal.counted(flags_set) if flagged else None


def _in_its_spare(e_new, spare) -> bool:
    """Whether a new memory lies in its unit's spare."""
    return spare is not None and buffer_of(e_new) is spare


def _in_spare(e_new, spare):
    """A fused step's new memory: the spare it was written into, where given (a Deferred one lies
    there already, as it is)."""
    return e_new if spare is None or isinstance(e_new, Deferred) else spare
