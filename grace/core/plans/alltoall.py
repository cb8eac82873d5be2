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
bucket's N shards are decoded, whatever N is. What a method does in each role (its second
compression, the shard alignment) is its ``Owner`` (``grace.core.plans.owner``).
"""
from __future__ import annotations

from typing import Any, List

from grace.core import bucket as frames
from grace.core.compressor import TensorInfo
from grace.core.journal import any_flag
from grace.core.plans.base import BucketPending, WholeBucket
from grace.core.plans.owner import owner_of


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

    def start(self, xp, grads, flat) -> BucketPending:
        s, owner, ranks = self.services, self.owner, self.services.communicator.size
        memory, n = s.compression.memory, self.bucket.numel
        pending, g_units, infos, states = self.begin(xp, grads, flat)
        g, unit, pending.info = g_units[0], pending.units[0], infos[0]
        pending.flag = xp.nonfinite([g]) if s.journal.guarded else None
        size = shard_size(n, ranks, owner.align)
        if self.keeps_memory and self._owned_in != ranks and xp.mutable_tensors and not s.communicator.replicas:
            self._take_owned_memory(xp, g, size)
        with s.phase("compress"):
            p = memory.compensate(xp, g, pending.old[0])
            x, state = owner.prepare(xp, p, pending.info, states[0])
            if state is not None:
                s.journal.set("state", unit.name, state)
            if size * ranks > n:
                x = xp.concat([x, xp.zeros(size * ranks - n, xp.dtype(x), like=x)])
            sent = [owner.compress(xp, x[j * size:(j + 1) * size], shard_info(pending.info, "shard", j))
                    for j in range(ranks)]
        pending.ctxs = [sent[0][1]]  # (equal shards: one ctx serves them all)
        payloads = [payload for payload, _ in sent]
        if memory.needs_feedback:
            with s.phase("feedback"):
                p_hat = xp.concat([xp.flatten(owner.decompress(xp, payload, pending.ctxs[0])) for payload in payloads])
                s.journal.set("memory", unit.name, memory.update(xp, p, p_hat[:n], pending.old[0]))
        own = payloads[s.communicator.rank]
        pending.dtypes, pending.counts = [xp.dtype(t) for t in own], [xp.numel(t) for t in own]
        parts = [frames.frame(xp, list(payload), self.variable, g, pending.flag) for payload in payloads]
        sizes = [xp.numel(t) for t in parts]
        with s.phase("collective"):
            pending.wait = s.communicator.alltoall_async(xp.concat(parts), sizes, f"{self.bucket.key}.shards")
        s.transport.stats.add(sum(sizes) - sizes[s.communicator.rank], 0)
        return pending

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        s, xp, comm = self.services, pending.xp, self.services.communicator
        flagged = pending.flag is not None
        received = s.transport.wait(pending.wait)
        mine = self._read(xp, received, comm.size, pending.dtypes, pending.counts, self.variable, flagged)
        # every rank told every owner its flag: each owner passes on whether any rank flagged one
        flag = any_flag(xp, [f for _, f in mine]) if flagged else None
        with s.phase("decompress"):
            aggregate = self.owner.reduce(xp, s.kernels, [payload for payload, _ in mine], pending.ctxs[0])
        with s.phase("compress"):
            payload = self._compressed_again(xp, aggregate, pending)
        frame = frames.frame(xp, list(payload), self.variable, pending.g, flag)
        with s.phase("collective"):
            gather = comm.allgather_async if self.variable else comm.allgather_equal_async
            gathered = gather(frame, f"{self.bucket.key}.owners")()
        s.transport.stats.add(xp.numel(frame), 0)
        dtypes, counts = [xp.dtype(t) for t in payload], [xp.numel(t) for t in payload]
        shards = self._read(xp, gathered, comm.size, dtypes, counts, self.variable, flagged)
        with s.phase("decompress"):
            parts = [xp.flatten(self.owner.decompress_again(xp, p, pending.ctxs[0], comm.size)) for p, _ in shards]
        g_hat = xp.concat(parts)[:self.bucket.numel]
        overflow = s.journal.overflow(xp, [f for _, f in shards]) if flagged else None
        return self.deliver(pending, [g_hat], overflow, pending.outs or [None] * len(self.bucket.segments), into)

    def _take_owned_memory(self, xp, like, size: int) -> None:
        """At a plan's first step, and after the world changed (elastic training): every rank's
        owner memory summed, and this rank keeps the part of the shard it now owns. Shards that
        stay put give each rank its own memory back; after a change no surviving rank's mass is
        lost. (A traced TensorFlow step keeps the world it was traced for.)"""
        s, key, n = self.services, self.bucket.key, self.bucket.numel
        held = s.store.value("owner", key)
        held = xp.copy(held) if held is not None else xp.zeros(n, xp.dtype(like), like=like)
        total = s.communicator.allreduce_async(held, f"{key}.owners.memory")()
        lo, hi = self._owned(size)
        kept = xp.concat([xp.zeros(lo, xp.dtype(total), like=total), total[lo:hi],
                          xp.zeros(n - hi, xp.dtype(total), like=total)])
        s.store.set("owner", key, kept)
        self._owned_in = s.communicator.size

    def _compressed_again(self, xp, aggregate, pending):
        """The owner's payload of its shard's aggregate, with its memory where it keeps one."""
        s, owner, key = self.services, self.owner, self.bucket.key
        info = shard_info(pending.info, "owner", s.communicator.rank)
        if not self.keeps_memory:
            return owner.compress_again(xp, aggregate, info)[0]
        # the memory spans the bucket (saved per gradient, as the workers'); this rank's shard is its own
        size = xp.numel(aggregate)
        lo, hi = self._owned(size)
        memory = s.store.get("owner", key, lambda t: xp.zeros_like(t), pending.g)
        q = aggregate + xp.concat([memory[lo:hi], xp.zeros(size - (hi - lo), xp.dtype(memory), like=memory)])
        payload, _ = owner.compress_again(xp, q, info)
        error = q - owner.decompress_again(xp, payload, pending.ctxs[0], s.communicator.size)
        s.journal.set("owner", key, xp.concat([memory[:lo], error[:hi - lo], memory[hi:]]))
        return payload

    def _owned(self, size: int):
        """(start, end) of this rank's shard within the bucket (before the padding)."""
        n, rank = self.bucket.numel, self.services.communicator.rank
        return min(rank * size, n), min((rank + 1) * size, n)

    @staticmethod
    def _read(xp, data, ranks: int, dtypes, counts, variable: bool, flagged: bool):
        """The ``ranks`` frames in ``data``, one after another in rank order: [(payload, flag or
        None)]. Fixed-length payloads have ``counts`` elements; variable ones carry theirs."""
        out, start = [], 0
        for _ in range(ranks):
            pieces, flag, start = frames.read_frame(xp, data, start, dtypes, counts, variable, 0, "float32", flagged)
            out.append((tuple(pieces), flag))
        return out
