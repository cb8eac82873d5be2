"""The two-phase plan (``communicator='alltoall'``): each rank owns one shard of the bucket, so
the bytes a rank moves and the payloads it decodes do not grow with the number of ranks.

    p                 = memory.compensate(g, e)          (the flat bucket, zero-padded to N equal shards)
    payload_j, ctx    = compress(p[shard j])             for every shard j
    e                 = memory.update(p, [decompress(payload_j)]_j)
    phase 1 (alltoall):  payload_j goes to rank j; rank r receives every rank's payload_r
    a_r               = aggregate(the N payloads of shard r)          (the mean, or the vote)
    payload'_r        = compress'(a_r + o_r);  o_r = a_r + o_r - decompress'(payload'_r)
                                                         (o_r: the owner's memory, where it keeps one)
    phase 2 (allgather): every rank decodes the N payload'_j: the bucket's result

Per rank about 2 (N-1)/N payloads of the bucket travel, and one shard's N payloads plus the
bucket's N shards are decoded, whatever N is. Each rank's overflow flag rides on its phase-2
frame alone; a variable-length encoding larger than its shard travels as the shard's values.
What a method does in each role (its second compression, the shard alignment) is its ``Owner``
(``grace.core.plans.owner``).
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, List

from grace.core import bucket as frames
from grace.core.buffers import assign, assign_ranges, ranges_over
from grace.core.compressor import TensorInfo
from grace.core.journal import no_overflow
from grace.core.plans.base import BucketPending, WholeBucket, with_dense
from grace.core.plans.owner import Owner, owner_of
from grace.core.tensors import backend_for


def shard_size(numel: int, ranks: int, align: int = 1) -> int:
    """Elements per rank's shard: ``numel`` cut into ``ranks`` equal whole multiples of ``align``
    (the last shard padded with zeros)."""
    return max(align, -(-numel // (ranks * align)) * align)


def shard_info(info: TensorInfo, phase: str, j: int) -> TensorInfo:
    """Shard j's info: its own name, so that its random draws are its own."""
    return TensorInfo(f"{info.name}/{phase}{j}", info.step, info.world_size, info.rank)


class AllToAll(WholeBucket):
    name = "alltoall"

    def __init__(self, services, bucket, why: str):
        super().__init__(services, bucket, why)
        self.owner = owner_of(services.compression.compressor)
        #: the owner keeps the error of its second compression where the method has error feedback
        self.keeps_memory = services.compression.memory.needs_feedback and not self.owner.exact_again
        self.variable = services.compression.compressor.traits.variable_length
        self._owned_in = None  # the world size this rank's owner memory was cut for
        self._owner_made = (None, None)  # (the owner memory made last, the one it was made from)
        #: full shards go through the memory's fused kernels, where it has them and treats elements
        #: alone (DGC's clipping scales by the bucket's norm); a variable-length method's step in
        #: which a shard's encoding outgrows the shard takes the formula instead
        memory = services.compression.memory
        self.fuses = memory.needs_feedback and memory.elementwise and \
            type(self.owner).prepare is Owner.prepare and type(self.owner).compress is Owner.compress
        #: a method with no memory compresses the shards in one bucket call where it has one (a
        #: CPU's), which checks them for an inf or a NaN as it reads them: no pass of its own
        self.compresses_many = not memory.needs_feedback and type(self.owner).prepare is Owner.prepare and \
            type(self.owner).compress is Owner.compress

    def start(self, xp, grads, flat) -> BucketPending:
        s, owner, ranks = self.services, self.owner, self.services.communicator.size
        memory, n = s.compression.memory, self.bucket.numel
        pending, g_units, infos, states = self.begin(xp, grads, flat)
        g, unit, pending.info = g_units[0], pending.units[0], infos[0]
        # (the overflow flag from the shards' bucket call, which checks them as it reads them; else a pass below)
        in_call = s.journal.guarded and self.compresses_many and xp.mutable_tensors and not xp.on_accelerator(g)
        size = shard_size(n, ranks, owner.align)
        if self.keeps_memory and self._owned_in != ranks and not s.communicator.replicas:
            with s.store.eager():  # (a TensorFlow trace: once, when the step is traced for this world)
                self._take_owned_memory(xp, g, size)
        with s.phase("compress"):
            sent = self._fused_shards(xp, g, pending, size, ranks) if self.fuses else None
            x = None  # (the shards the formula compressed: the frames' dense values, the feedback's p)
            if sent is None:
                p = memory.compensate(xp, g, pending.old[0])
                x, state = owner.prepare(xp, p, pending.info, states[0])
                if state is not None:
                    s.journal.set("state", unit.name, state)
                x = shards_of(xp, x, size, ranks)
                sent = self._compressed_shards(xp, x, [shard_info(pending.info, "shard", j) for j in range(ranks)],
                                               pending, in_call)
        if s.journal.guarded and pending.flag is None:
            pending.flag = xp.nonfinite([g], self.flag_dtype())
        pending.ctxs = [sent[0][1]]  # (equal shards: one ctx serves them all)
        payloads = [payload for payload, _ in sent]
        own = payloads[s.communicator.rank]
        pending.dtypes, pending.counts = [xp.dtype(t) for t in own], [xp.numel(t) for t in own]
        # (no flag here: each rank's own rides on its owner frame, which every rank receives)
        parts = [self._frame(xp, payload, None if x is None else x[j], g) for j, payload in enumerate(payloads)]
        if memory.needs_feedback and x is not None:
            with s.phase("feedback"):
                p_hat = xp.concat([x[j] if dense else
                                   xp.flatten(owner.decompress(xp, payload, pending.ctxs[0]))
                                   for j, (payload, (_, dense)) in enumerate(zip(payloads, parts))])
                s.journal.set("memory", unit.name, memory.update(xp, p, p_hat[:n], pending.old[0]))
        sizes = [xp.numel(t) for t, _ in parts]
        with s.phase("collective"):
            scatter = s.communicator.alltoall_async if self.variable else s.communicator.alltoall_equal_async
            pending.wait = scatter(xp.concat([t for t, _ in parts]), sizes, f"{self.bucket.key}.shards")
        s.transport.stats.add(sum(sizes) - sizes[s.communicator.rank], 0)
        return pending

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        s, xp, comm = self.services, pending.xp, self.services.communicator
        flagged = pending.flag is not None
        received = s.transport.wait(pending.wait)
        mine = [p for p, _ in self._read(xp, received, comm.size, pending.dtypes, pending.counts, False)]
        with s.phase("decompress"):
            encoded = [p for p in mine if not isinstance(p, frames.Dense)]
            dense = [p.values for p in mine if isinstance(p, frames.Dense)]
            aggregate = self.owner.reduce(xp, s.kernels, encoded, pending.ctxs[0]) if encoded else None
            if dense:  # (those ranks' encodings of the shard were larger than it)
                aggregate = with_dense(aggregate, len(encoded), dense, len(mine))
        with s.phase("compress"):
            frame, payload = self._compressed_again(xp, aggregate, pending)
        with s.phase("collective"):
            gather = comm.allgather_async if self.variable else comm.allgather_equal_async
            gathered = gather(frame, f"{self.bucket.key}.owners")()
        s.transport.stats.add(xp.numel(frame), 0)
        dtypes, counts = [xp.dtype(t) for t in payload], [xp.numel(t) for t in payload]
        shards = self._read(xp, gathered, comm.size, dtypes, counts, flagged)
        overflow = s.journal.overflow(xp, [f for _, f in shards]) if flagged else None
        over = into is None and pending.outs is not None and s.average and no_overflow(overflow)
        with s.phase("decompress"):
            if over and self._decoded_over(xp, [p for p, _ in shards], pending, comm.size):
                return list(pending.outs)  # (each shard decoded straight over the gradients it spans)
            parts = [p.values if isinstance(p, frames.Dense) else
                     xp.flatten(self.owner.decompress_again(xp, p, pending.ctxs[0], comm.size)) for p, _ in shards]
        if over and assign_ranges(xp, pending.outs, parts):
            return list(pending.outs)  # (the shards written over the gradients: no flat result in between)
        g_hat = xp.concat(parts)[:self.bucket.numel]
        return self.deliver(pending, [g_hat], overflow, pending.outs or [None] * len(self.bucket.segments), into)

    def _decoded_over(self, xp, payloads, pending, ranks: int) -> bool:
        """Every owner's payload decoded straight over the gradients its shard spans, a kernel
        call a shard (``Owner.decompress_again_into``), where none came dense and every gradient
        is one flat run: whether it ran (the method's kernel runs for every shard or none)."""
        if any(isinstance(p, frames.Dense) for p in payloads):
            return False
        ctx = pending.ctxs[0]
        pieces = ranges_over(xp, pending.outs, [ctx.numel] * len(payloads))
        if pieces is None:
            return False
        # (the pieces come shard after shard: grouped in one sweep, not one sweep a shard)
        for j, mine in itertools.groupby(pieces, key=operator.itemgetter(0)):
            _, starts, lengths, outs = zip(*mine)
            if not self.owner.decompress_again_into(xp, payloads[j], ctx, ranks, starts, lengths, outs):
                return False
        return True

    def _compressed_shards(self, xp, shards, infos, pending, in_call: bool) -> list:
        """[(payload, ctx)] of every shard: by one bucket call where the method has one (and, where
        ``in_call``, the overflow flag set as it reads them), else shard by shard."""
        s = self.services
        if self.compresses_many:
            flag = xp.zeros(1, "float32", like=shards[0]) if in_call else None
            many = s.kernels.compress_many(xp, shards, infos, flag)
            if many is not None:
                pending.flag = flag
                return many
        return [self.owner.compress(xp, x, info) for x, info in zip(shards, infos)]

    def _fused_shards(self, xp, g, pending, size: int, ranks: int):
        """[(payload, ctx)] of every shard: those that lie whole in the bucket by the memory's
        fused kernel (compensate, compress and update in one pass, the new memory written into a
        spare buffer), those past its end by the formula, padded; or None where no kernel runs."""
        s, memory, unit = self.services, self.services.compression.memory, pending.units[0]
        n, old = self.bucket.numel, pending.old[0]
        whole = min(ranks, n // size)
        spare = s.buffers.take_spare(unit.name, xp, old) if whole else None
        if spare is None:
            return None
        infos = [shard_info(pending.info, "shard", j) for j in range(ranks)]
        steps = s.feedback.fused_steps(xp, s.kernels, [g[j * size:(j + 1) * size] for j in range(whole)],
                                       [_cut(old, j * size, (j + 1) * size) for j in range(whole)], infos[:whole],
                                       [_cut(spare, j * size, (j + 1) * size) for j in range(whole)])
        if steps is None:
            s.buffers.spares[unit.name] = spare
            return None
        sent, lo = [(payload, ctx) for payload, ctx, _ in steps], whole * size
        if whole < ranks:
            p = memory.compensate(xp, g[lo:], _cut(old, lo, n))
            x = padded(xp, p, size * (ranks - whole))
            sent += [self.owner.compress(xp, x[(j - whole) * size:(j - whole + 1) * size], infos[j])
                     for j in range(whole, ranks)]
            p_hat = xp.concat([xp.flatten(self.owner.decompress(xp, payload, sent[0][1]))
                               for payload, _ in sent[whole:]])
            assign(xp, _cut(spare, lo, n), memory.update(xp, p, p_hat[:n - lo], _cut(old, lo, n)))
        if self.variable and any(self._outgrows(xp, payload, size, self.bucket.dtype) for payload, _ in sent):
            s.buffers.spares[unit.name] = spare  # (the old memory untouched: the formula's step instead)
            return None
        s.journal.set("memory", unit.name, spare)
        s.buffers.spares[unit.name] = old  # the old memory is the next step's spare
        return sent

    def _outgrows(self, xp, payload, numel, dtype: str, flagged: bool = False) -> bool:
        """Whether a variable-length encoding of ``numel`` elements of ``dtype`` is larger than
        they are dense (then sent dense: ``_frame``). A length known only when a traced
        TensorFlow step runs never is (the frame's layout is fixed at trace time)."""
        counts = [xp.numel(t) for t in payload]
        return all(isinstance(c, int) for c in counts) and \
            frames.frame_size(counts, [xp.dtype(t) for t in payload], True, flagged) > \
            frames.dense_frame_size(numel, dtype, len(payload), flagged)

    def _frame(self, xp, payload, values, like, flag=None):
        """(A shard's frame, whether it carries the shard's dense ``values`` instead): a
        variable-length encoding larger than the dense shard is sent dense, as the allgather's
        frames are, so neither phase moves more than a dense shard (``values``: None for a
        fixed-length method, and for shards of a fused step, which ``_outgrows`` checked)."""
        if self.variable and values is not None and \
                self._outgrows(xp, payload, xp.numel(values), xp.dtype(values), flag is not None):
            return frames.dense_frame(xp, values, len(payload), like, flag), True
        return frames.frame(xp, list(payload), self.variable, like, flag), False

    def _take_owned_memory(self, xp, like, size: int) -> None:
        """At a plan's first step, and after the world changed (elastic training): every rank's
        owner memory summed, and this rank keeps the part of the shard it now owns. Shards that
        stay put give each rank its own memory back; after a change no surviving rank's mass is
        lost. (A traced TensorFlow step does this when it is traced for a world: see
        grace.tensorflow.retrace.)"""
        s, key, n = self.services, self.bucket.key, self.bucket.numel
        held = s.store.value("owner", key)
        held = xp.copy(held) if held is not None else xp.zeros(n, xp.dtype(like), like=like)
        total = s.communicator.allreduce_async(held, f"{key}.owners.memory")()
        lo, hi = self._owned(size)
        kept = xp.concat([xp.zeros(lo, xp.dtype(total), like=total), total[lo:hi],
                          xp.zeros(n - hi, xp.dtype(total), like=total)])
        s.store.set("owner", key, kept)
        self._owned_in = s.communicator.size

    def leave(self) -> None:
        """This rank's owner memory goes into its own error feedback, N times it where the
        result is a mean (a rank's memory reaches the result divided by N), so no memory that
        no plan reads keeps gradient mass. A memory that cannot hold it keeps it per gradient
        name, for the next time the bucket takes the two phases."""
        s, key = self.services, self.bucket.key
        held = s.store.value("owner", key)
        if held is None or not self.keeps_memory:
            return
        xp = backend_for(held)
        memory = s.compression.memory
        state = s.store.value("memory", key)
        state = memory.init(xp, held) if state is None else state
        absorbed = memory.absorb(xp, state, held * s.communicator.size if s.average else held)
        if absorbed is not None:
            s.store.set("memory", key, absorbed)
            s.store.set("owner", key, None)

    def _compressed_again(self, xp, aggregate, pending):
        """(The owner's frame of its shard's aggregate, its payload), with its memory where it keeps one."""
        s, owner, key = self.services, self.owner, self.bucket.key
        info = shard_info(pending.info, "owner", s.communicator.rank)
        if not self.keeps_memory:
            payload = owner.compress_again(xp, aggregate, info)[0]
            return self._frame(xp, payload, aggregate, pending.g, pending.flag)[0], payload
        # the memory spans the bucket (saved per gradient, as the workers'); this rank's shard is its own
        size = xp.numel(aggregate)
        lo, hi = self._owned(size)
        memory = s.store.get("owner", key, lambda t: xp.zeros_like(t), pending.g)
        q = aggregate + padded(xp, memory[lo:hi], size)
        payload, _ = owner.compress_again(xp, q, info)
        frame, dense = self._frame(xp, payload, q, pending.g, pending.flag)
        ranks = s.communicator.size
        error = xp.zeros_like(q) if dense else q - owner.decompress_again(xp, payload, pending.ctxs[0], ranks)
        s.journal.set("owner", key, self._owner_memory(xp, memory, error[:hi - lo], lo, hi))
        return frame, payload

    def _owner_memory(self, xp, memory, error, lo: int, hi: int):
        """The owner memory with ``error`` as its shard [lo, hi): a new tensor (the old one stays
        for a step that an overflow skips). Where the old one is the tensor this plan made last,
        the one that was made from (the same values outside the shard, and no longer anyone's
        state) is written over, the shard alone: not a pass over the whole bucket a step."""
        made, source = self._owner_made
        if xp.mutable_tensors and memory is made and source is not None:
            xp.assign(source[lo:hi], error)
            new = source
        else:
            new = xp.concat([memory[:lo], error, memory[hi:]])
        self._owner_made = (new, memory)
        return new

    def _owned(self, size: int):
        """(start, end) of this rank's shard within the bucket (before the padding)."""
        n, rank = self.bucket.numel, self.services.communicator.rank
        return min(rank * size, n), min((rank + 1) * size, n)

    def _read(self, xp, data, ranks: int, dtypes, counts, flagged: bool):
        """The ``ranks`` frames in ``data``, one after another in rank order: [(payload or
        ``Dense``, flag or None)]. Fixed-length payloads have ``counts`` elements; variable ones
        carry theirs."""
        out, start, size = [], 0, shard_size(self.bucket.numel, ranks, self.owner.align)
        for _ in range(ranks):
            pieces, flag, start = frames.read_frame(xp, data, start, dtypes, counts, self.variable, size,
                                                    self.bucket.dtype, flagged)
            out.append((pieces if isinstance(pieces, frames.Dense) else tuple(pieces), flag))
        return out


def shards_of(xp, x, size: int, ranks: int) -> list:
    """Flat ``x`` as ``ranks`` shards of ``size`` elements: views where they lie whole in it, the
    rest zero-padded (no copy of the whole bucket to pad its end)."""
    n = xp.numel(x)
    return [x[j * size:(j + 1) * size] if (j + 1) * size <= n else padded(xp, x[min(j * size, n):n], size)
            for j in range(ranks)]


def padded(xp, x, length: int):
    """``x`` with zeros after it up to ``length`` elements."""
    n = xp.numel(x)
    return x if n == length else xp.concat([x, xp.zeros(length - n, xp.dtype(x), like=x)])


def _cut(state, lo: int, hi: int):
    """Elements [lo, hi) of a flat memory (each tensor of one made of several)."""
    return tuple(t[lo:hi] for t in state) if isinstance(state, tuple) else state[lo:hi]
