"""The warm-up plan: a method's first ``warmup_steps`` steps send each bucket (or gradient) as
it is, by one allreduce in its own dtype, as Horovod sends an uncompressed gradient. The early
steps' gradients are large and change fast; compressing them costs accuracy for little time
(PyTorch's PowerSGD hook allreduces until ``start_powerSGD_iter``; DGC's authors train their
first epochs dense).

The memory is not touched: the method starts from an empty memory at step ``warmup_steps``.
The step is counted (under the key the method counts its steps by), so a checkpoint resumes
past the warm-up; an overflow undoes the count like any other state, so a skipped step does
not shorten the warm-up.
"""
from __future__ import annotations

from typing import Any, List

from grace.core.bucket import Bucket, Segment
from grace.core.plans.base import BucketPending, BucketPlan


class WarmUp(BucketPlan):
    name = "warmup"

    @classmethod
    def of_gradient(cls, services, name: str, xp, g) -> "WarmUp":
        """The plan for gradient ``g`` exchanged on its own (``bucket_mb=0``), counted under its name."""
        segment = Segment(name, tuple(xp.shape(g)), 0, xp.numel(g))
        return cls(services, Bucket(name, xp.dtype(g), (segment,)), "warm-up: one gradient")

    def start(self, xp, grads, flat) -> BucketPending:
        s, bucket = self.services, self.bucket
        s.journal.next_step(bucket.key, grads[0])
        flag = xp.nonfinite(list(grads)) if s.journal.guarded else None
        pending = BucketPending(bucket, xp, list(bucket.segments), grads[0], [])
        pending.wait, nbytes = s.transport.allreduce_units(xp, bucket.key, [(g,) for g in grads], flag)
        s.transport.stats.add(nbytes, 4 * bucket.numel)
        return pending

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        s, xp = self.services, pending.xp
        summed, overflow, fresh = pending.wait()
        g_hat = [s.averaged(xp, payload[0], fresh, None) for payload in summed]
        return self.deliver(pending, g_hat, overflow, pending.outs or [None] * len(self.bucket.segments), into)
