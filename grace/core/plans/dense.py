"""The dense plan: the compensated bucket sent as it is, by one float32 ring allreduce, as
Horovod sends an uncompressed gradient. ``communicator='auto'`` takes it where compressing would
make every rank receive more bytes than that (``grace.core.traffic``). The memory sends all it
held, so it ends empty (``update(p, p)``).
"""
from __future__ import annotations

from typing import Any, List

from grace.core.plans.base import BucketPending, WholeBucket


class Dense(WholeBucket):
    name = "dense"

    def start(self, xp, grads, flat) -> BucketPending:
        s, memory = self.services, self.services.compression.memory
        pending, g_units, _, _ = self.begin(xp, grads, flat)
        g = g_units[0]
        flag = xp.nonfinite([g]) if s.journal.guarded else None
        p = memory.compensate(xp, g, pending.old[0])
        if memory.needs_feedback:
            s.journal.set("memory", pending.units[0].name, memory.update(xp, p, p, pending.old[0]))
        pending.wait, nbytes = s.transport.allreduce_units(xp, self.bucket.key, [(xp.cast(p, "float32"),)], flag)
        s.transport.stats.add(nbytes, 0)
        return pending

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        s, xp = self.services, pending.xp
        summed, overflow, fresh = pending.wait()
        g_hat = s.averaged(xp, summed[0][0], fresh, None)
        return self.deliver(pending, [g_hat], overflow, pending.outs or [None] * len(self.bucket.segments), into)
