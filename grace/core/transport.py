"""How a plan's payloads reach the communicator: per-tensor sends, one allreduce per bucket,
and frames (``grace.core.bucket``) for the allgather and broadcast methods; with the bytes
counted (``WireStats``) and the time marked as the collective's phase.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Dict

from grace import native
from grace.core import bucket as frames
from grace.core.buffers import flat_concat
from grace.core.communicator import Handle, _lengths
from grace.core.compressor import Collective


@dataclass
class WireStats:
    """Bytes this rank handed to the collectives, and what dense float32 would have been."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    last_step_bytes: int = 0
    last_step_dense_bytes: int = 0
    _step_bytes: int = field(default=0, repr=False)
    _step_dense_bytes: int = field(default=0, repr=False)
    #: bucket key -> the plan that exchanges it ('alltoall', 'dense', ...: communicator='auto''s choice)
    plans: Dict[str, str] = field(default_factory=dict)

    def add(self, nbytes: int, dense_bytes: int) -> None:
        self._step_bytes += nbytes
        self._step_dense_bytes += dense_bytes

    def end_step(self) -> None:
        self.steps += 1
        self.last_step_bytes, self.last_step_dense_bytes = self._step_bytes, self._step_dense_bytes
        self.bytes_sent += self._step_bytes
        self.dense_bytes += self._step_dense_bytes
        self._step_bytes = self._step_dense_bytes = 0

    @property
    def compression_ratio(self) -> float:
        """Dense float32 bytes over bytes sent, over all steps so far."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


class Transport:
    def __init__(self, compression, communicator, stats: WireStats, buffers, journal, phase):
        self.compression = compression
        self.communicator = communicator
        self.stats = stats
        self.buffers = buffers
        self.journal = journal
        self.phase = phase  # phase(name): a context that times its block as that phase

    def wait(self, wait):
        """``wait()``, timed as the collective."""
        with self.phase("collective"):
            return wait()

    def send(self, name: str, xp, payload, round_: int, flag=None) -> Handle:
        """Launch one tensor's ``payload``, with this rank's overflow ``flag`` as one more tensor
        where given (in the payload's dtype where it is summed)."""
        if flag is not None:
            summed = self.compression.collective is Collective.ALLREDUCE
            payload = (*payload, xp.cast(flag, xp.dtype(payload[0]) if summed else "uint8"))
        suffix = f".round{round_}" if round_ else ""
        with self.phase("collective"):
            handle = self.communicator.exchange(self.compression.collective, xp, payload, f"grace.{name}{suffix}",
                                                equal_lengths=not self.compression.compressor.traits.variable_length)
        self.stats.add(handle.nbytes, 0)
        return handle

    def allreduce_units(self, xp, key: str, payloads, flag=None, written_in=None, owned=False, defer=False):
        """One allreduce per payload dtype (one, unless a method mixes them) of all units'
        payloads, and of this rank's overflow ``flag`` where given (one more element of the first
        dtype). Returns (wait, bytes sent); ``wait()`` gives (the summed payloads per unit, how
        many ranks flagged an overflow or None, whether the sums are new tensors).

        A communicator with a grouped allreduce (Horovod's, joined in its fusion buffer off this
        thread) gets the payloads as they are; else they are joined into one buffer here.
        ``written_in``: the payloads' one flat buffer, where a kernel wrote them there, sent as it
        is. The exchange's own buffers, and the payloads where ``owned``, are summed in place
        where the communicator can. ``defer``: the overflow count stays on the device."""
        if written_in is not None:
            if flag is not None:
                raise ValueError("a buffer of payloads a kernel wrote carries no overflow flag")
            return self._allreduce_written(xp, key, payloads, written_in)
        tensors = [t for payload in payloads for t in payload]
        structure = [len(payload) for payload in payloads]
        if flag is not None:
            tensors.append(xp.flatten(xp.cast(flag, xp.dtype(tensors[0]))))
        dtypes = [xp.dtype(t) for t in tensors]
        kinds = list(dict.fromkeys(dtypes))
        waits, sent, groups = {}, {}, {}
        for dtype in kinds:
            if len(kinds) == 1:  # (the usual case: no choosing per tensor)
                group, name = tensors, key
            else:
                group, name = [t for t, d in zip(tensors, dtypes) if d == dtype], f"{key}.{dtype}"
            groups[dtype] = group
            waits[dtype], sent[dtype] = self._allreduce_group(xp, name, group, owned)

        def wait():
            summed, fresh = {}, True
            for d, w in waits.items():
                out = self.wait(w)
                if isinstance(out, (list, tuple)):  # a grouped allreduce's sums, shaped as the tensors sent
                    summed[d] = iter(out)
                    fresh = fresh and not any(map(operator.is_, out, sent[d]))
                else:  # one sum of them all, joined
                    summed[d] = iter(_cut(xp, out, groups[d]))
                    fresh = fresh and out is not sent[d]
            ordered = list(summed[kinds[0]]) if len(kinds) == 1 else [next(summed[d]) for d in dtypes]
            overflow = self.journal.overflow(xp, [ordered.pop()], defer) if flag is not None else None
            return frames.split_payloads(ordered, structure), overflow, fresh

        return wait, sum(map(xp.nbytes, tensors))

    def _allreduce_written(self, xp, key: str, payloads, buffer):
        """``allreduce_units`` of payloads a kernel wrote into ``buffer``, in order, one dtype:
        summed in place where the communicator can, the payloads are then the sums' views as
        they are (none cut again: 2 calls per piece, 161 a ResNet-50 bucket)."""
        launched, sent = self._allreduce_group(xp, key, [buffer], owned=True)  # (the exchange's own buffer)

        def wait():
            out = self.wait(launched)
            if out is sent:
                return payloads, None, False  # (as the caller keeps them: their native buffers with them)
            ordered = _cut(xp, out, [t for payload in payloads for t in payload])
            return frames.split_payloads(ordered, [len(payload) for payload in payloads]), None, True

        return wait, xp.nbytes(buffer)

    def _allreduce_group(self, xp, name: str, group, owned: bool):
        """Launch the allreduce of one dtype's pieces (``owned``: the caller's to be summed over):
        (its wait, what was sent)."""
        comm = self.communicator
        grouped = len(group) > 1 and comm.grouped_allreduce(xp.dtype(group[0]))
        if grouped:  # (as they are: their sums come back in their shapes)
            sent = group
        else:
            sent = self.buffers.concat_into_kept(xp, name, [xp.flatten(t) for t in group])
        ours = not grouped and len(group) > 1 and xp.mutable_tensors  # joined into a buffer of ours
        in_place = (ours or owned) and comm.sums_in_place(group[0])
        with self.phase("collective"):
            if grouped:
                launch = comm.grouped_allreduce_async_ if in_place else comm.grouped_allreduce_async
            else:
                launch = comm.allreduce_async_ if in_place else comm.allreduce_async
            return launch(sent, name), sent

    # --- frames ----------------------------------------------------------------------------
    def frame_into(self, pending):
        """Where a bucket kernel writes its payloads (``into`` of ``Feedback.fused_steps``): as the
        pieces of this rank's frame in the bucket's frame buffer, which then needs no join; a
        variable-length frame written whole by the kernel's native calls, in the buffer a
        ``FrameRoom`` places (see ``_Rooms.payloads``); None where frames are joined (immutable
        tensors, allreduce methods)."""
        xp, compressor = pending.xp, self.compression.compressor
        if not xp.mutable_tensors or compressor.collective is Collective.ALLREDUCE:
            return None
        variable = compressor.traits.variable_length

        name, flagged = f"{pending.bucket.key}.frame", self.journal.guarded

        def into(dtypes, counts):
            pieces, flag_at, size = frames.layout(dtypes, counts, False, flagged)
            end = sum(count * frames.ITEMSIZE[dtype] for dtype, count in zip(dtypes, counts))
            buffer = self.buffers.buffer_for(xp, name, "uint8", size, pending.g)
            pending.framed = (buffer, flag_at, end, dtypes, counts)
            return buffer, [offset for offset, _, _ in pieces], self.buffers.views.setdefault(name, {})

        def place(dtypes, counts, end, size):  # (the kernel writes the header and the zeros after the pieces)
            buffer = self.buffers.buffer_for(xp, name, "uint8", size, pending.g)
            pending.framed = (buffer, end if flagged else None, size, dtypes, counts)
            return buffer

        return native.FrameRoom(flagged, place) if variable else into

    def _finish_frame(self, pending):
        """The frame whose pieces a bucket kernel wrote in place (``frame_into``), with the
        overflow flag and zeros to its end written: through views of the kept buffer made once
        per layout (a slice and a fill made per bucket and step, just after the kernel's pass,
        cost more than the rest of the bucket's Python)."""
        xp, flag = pending.xp, pending.flag
        frame, flag_at, end, _, _ = pending.framed
        if (flag is None) != (flag_at is None):  # (a guarded exchange flags every bucket)
            raise RuntimeError(f"grace: {pending.bucket.key}'s frame was laid out for {'no ' * (flag_at is None)}"
                               "overflow flag")
        kept = self.buffers.views.setdefault(f"{pending.bucket.key}.frame", {})
        made = kept.get("flag and zeros")
        if made is None or made[0] is not frame or made[1] != (flag_at, end):
            zeros_from = end if flag is None else max(end, flag_at + 1)
            made = kept["flag and zeros"] = (
                frame, (flag_at, end), None if flag is None else frame[flag_at:flag_at + 1],
                (frame[zeros_from:], xp.zeros(xp.numel(frame) - zeros_from, "uint8", like=frame))
                if zeros_from < xp.numel(frame) else None)
        if made[2] is not None:
            xp.assign(made[2], flag)  # (cast to the byte as it is written)
        if made[3] is not None:
            xp.assign(*made[3])
        return frame

    def launch_frame(self, pending, payloads, compensated) -> int:
        """Frame this rank's payloads, or the dense bucket (``compensated()``: its units) where
        that is smaller, and launch the allgather or the broadcasts; the bytes sent."""
        xp, bucket, g = pending.xp, pending.bucket, pending.g
        variable = self.compression.compressor.traits.variable_length
        pieces = [t for payload in payloads for t in payload]
        pending.structure = [len(payload) for payload in payloads]
        if pending.framed is not None:  # (the pieces a bucket kernel wrote as it asked for them)
            *_, dtypes, counts = pending.framed
            pending.dtypes, pending.counts = list(dtypes), list(counts)
            if len(pending.dtypes) != len(pieces):
                raise RuntimeError(f"grace: {bucket.key}'s kernel wrote {len(pending.dtypes)} pieces into its frame "
                                   f"and handed back {len(pieces)}")
        else:
            pending.dtypes, pending.counts = [xp.dtype(t) for t in pieces], [xp.numel(t) for t in pieces]
        flag, flagged = pending.flag, pending.flag is not None
        join = functools.partial(self.buffers.concat_into_kept, xp, f"{bucket.key}.frame")
        frame = self._finish_frame(pending) if pending.framed is not None else \
            frames.frame(xp, pieces, variable, g, flag, join, pending.dtypes, pending.counts)
        dense_size = frames.dense_frame_size(bucket.numel, bucket.dtype, len(pieces) if variable else 0, flagged)
        # Fixed-length methods: every rank decides alike. A length known only when a traced
        # TensorFlow step runs is never replaced (the frame's layout is fixed at trace time).
        if isinstance(xp.numel(frame), int) and xp.numel(frame) > dense_size:
            pending.sent_dense = True
            p = flat_concat(xp, compensated())
            frame = (frames.dense_frame(xp, p, len(pieces), g, flag, join) if variable
                     else frames.frame(xp, [p], False, g, flag, join))
        return self.send_frame(pending, frame, variable)

    def send_header(self, pending, header) -> int:
        """Launch the allgather of this rank's ``header``, sent apart from its frame (equal
        sizes: ``pending.header_wait``); the bytes sent."""
        with self.phase("collective"):
            pending.header_wait = self.communicator.allgather_equal_async(header, f"{pending.bucket.key}.counts")
        return pending.xp.nbytes(header)

    def send_frame(self, pending, frame, variable: bool) -> int:
        """Launch the allgather (or the broadcasts) of this rank's ``frame``; the bytes sent."""
        xp, comm, bucket, g = pending.xp, self.communicator, pending.bucket, pending.g
        nbytes = xp.numel(frame)
        with self.phase("collective"):
            if self.compression.collective is Collective.ALLGATHER:
                gather = comm.allgather_async if variable else comm.allgather_equal_async
                pending.wait = gather(frame, bucket.key)
                return nbytes
            if variable:  # receivers must know the frames' sizes before the broadcasts
                sizes = xp.host_ints(comm.allgather_equal_async(_lengths(xp, [frame]), f"{bucket.key}.sizes")(),
                                     comm.size)
                nbytes += 8
            else:
                sizes = [nbytes] * comm.size
            waits = [comm.broadcast_async(frame if root == comm.rank or not variable
                                          else xp.zeros(sizes[root], "uint8", like=g), root,
                                          f"{bucket.key}.from{root}")
                     for root in range(comm.size)]
        pending.wait = lambda: [w() for w in waits]
        return nbytes


def _cut(xp, flat, tensors) -> list:
    """The allreduced join of ``tensors`` (``flat``) cut into their sums, in their shapes."""
    return [xp.reshape(piece, xp.shape(t)) for piece, t in zip(xp.split(flat, [xp.numel(t) for t in tensors]), tensors)]
