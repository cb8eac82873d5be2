"""The reference plan: one gradient at a time, exactly the GRACE pipeline (``bucket_mb=0``).

    p            = memory.compensate(g, e)
    payload, ctx = compressor.step(p)
    e            = memory.update(p, compressor.decompress(payload, ctx))
    allreduce:           g_hat = decompress(sum of payloads) / n
    allgather/broadcast: g_hat = aggregate([payload_1..payload_n])

A multi-round method (PowerSGD) sends one payload per round and decompresses after the last;
its memory is then updated with what the method says p became. Every bucketed plan gives
these results bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grace.core.communicator import Handle
from grace.core.compressor import Collective


@dataclass
class Pending:
    name: str
    xp: Any
    ctx: Any
    handle: Handle
    flagged: bool = False  # the first round's payload ends with the overflow flag
    p: Any = None  # multi-round methods: the compensated gradient, for the memory update
    rounds: Any = None  # multi-round methods: the protocol, suspended between rounds
    memory_state: Any = None  # multi-round methods: the memory before this step
    out: Any = None  # where the result is written (the input gradient), or None: a new tensor


class Reference:
    name = "reference"
    why = "bucket_mb=0: each gradient is exchanged on its own"

    def __init__(self, services):
        self.services = services

    def start(self, name: str, xp, g) -> Pending:
        """Compensate, compress and launch one gradient's collective."""
        s = self.services
        compressor, memory, journal = s.compression.compressor, s.compression.memory, s.journal
        info = s.info(name, journal.next_step(name, g))
        flag = xp.nonfinite([g]) if journal.guarded and not s.flags_from_payload else None
        s.transport.stats.add(0, 4 * xp.numel(g))
        e = s.memory_state(xp, name, g)
        state = s.compressor_state(xp, name, g)
        if not compressor.traits.multi_round:  # one pass over memory where a kernel fuses the three steps
            fused = s.feedback.fused_step(xp, s.kernels, g, e, info)
            if fused is not None:
                payload, ctx, e = fused
                journal.set("memory", name, e)
                flag = self._payload_flag(xp, payload, flag)
                return Pending(name, xp, ctx, s.transport.send(name, xp, payload, 0, flag), flag is not None)
        p = memory.compensate(xp, g, e)
        if compressor.traits.multi_round:
            rounds = compressor.rounds(xp, p, info, state)
            return Pending(name, xp, None, s.transport.send(name, xp, next(rounds), 0, flag), flag is not None,
                           p, rounds, e)
        payload, ctx, state = compressor.step(xp, p, info, state)
        journal.set("state", name, state)
        flag = self._payload_flag(xp, payload, flag)
        if memory.needs_feedback:
            with s.phase("feedback"):
                journal.set("memory", name, memory.update(xp, p, compressor.decompress(xp, payload, ctx), e))
        return Pending(name, xp, ctx, s.transport.send(name, xp, payload, 0, flag), flag is not None)

    def finish(self, pending: Pending):
        """Wait for the collective(s); the averaged (or summed) gradient."""
        s, xp = self.services, pending.xp
        compressor = s.compression.compressor
        if pending.rounds is not None:
            g_hat, overflow = self._finish_rounds(pending)
        elif s.compression.collective is Collective.ALLREDUCE:
            summed, overflow = self._unflagged(pending, s.transport.wait(pending.handle.wait))
            g_hat = s.averaged(xp, compressor.decompress(xp, summed, pending.ctx), False, pending.out)
        else:
            gathered, overflow = self._unflagged(pending, s.transport.wait(pending.handle.wait))
            g_hat = s.kernels.aggregate(xp, gathered, pending.ctx)
        return s.delivered(xp, g_hat, overflow, pending.out)

    def _payload_flag(self, xp, payload, flag):
        return payload_flag(xp, self.services.compression, [payload]) if self.services.flags_from_payload else flag

    def _unflagged(self, pending: Pending, received):
        """The received payloads without their overflow flags; how many ranks flagged one."""
        if not pending.flagged:
            return received, None
        journal = self.services.journal
        if isinstance(received, tuple):  # allreduce: one summed payload
            return received[:-1], journal.overflow(pending.xp, [received[-1]])
        return [r[:-1] for r in received], journal.overflow(pending.xp, [r[-1] for r in received])

    def _finish_rounds(self, pending: Pending):
        s, name, xp = self.services, pending.name, pending.xp
        memory = s.compression.memory
        summed, overflow = self._unflagged(pending, s.transport.wait(pending.handle.wait))
        g_hat, p_hat, state = later_rounds(
            s, pending.rounds, summed, lambda payload, r: s.transport.wait(s.transport.send(name, xp, payload, r).wait))
        s.journal.set("state", name, state)
        if memory.needs_feedback:
            with s.phase("feedback"):
                s.journal.set("memory", name, memory.update(xp, pending.p, p_hat, pending.memory_state))
        return g_hat, overflow


def payload_flag(xp, compression, payloads):
    """This rank's overflow flag read from its payloads (``Traits.nonfinite_field``)."""
    field = compression.compressor.traits.nonfinite_field
    return xp.nonfinite([payload[field] for payload in payloads])


def later_rounds(services, rounds, summed, collective):
    """A multi-round method's suspended ``rounds`` driven to their end from the first round's
    ``summed``: each next payload launched by ``collective(payload, round)``, which returns its
    sum. The rounds' result."""
    r = 0
    while True:
        with services.phase("compress") as mark:
            try:
                payload = rounds.send(summed)
            except StopIteration as done:
                if mark:
                    mark[0] = "decompress"  # the last round's work: the decompression
                return done.value
        r += 1
        summed = collective(payload, r)
