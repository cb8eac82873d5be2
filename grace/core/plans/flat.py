"""The flat plan: a bucket copied into one flat tensor with one flat memory and compressed as
one tensor.

It is the plan of ``scope='bucket'`` (one global top-k, ...: a method of its own) and, on an
accelerator, of the elementwise methods (``Traits.elementwise``: the same results as per
gradient), where one kernel per bucket beats one per gradient. Otherwise the steps are the
per-gradient plan's, with one unit.
"""
from __future__ import annotations

from grace.core.bucket import Segment
from grace.core.plans.base import defers_on_device
from grace.core.plans.per_gradient import PerGradient


class Flat(PerGradient):
    name = "flat"
    flat_memory = True

    def _units(self, xp, grads, flat):
        bucket = self.bucket
        g = flat if flat is not None else self.services.buffers.concat_gradients(bucket, xp, grads)
        return [Segment(bucket.key, (bucket.numel,), 0, bucket.numel)], [g], g

    def _defers(self, xp, g) -> bool:
        return defers_on_device(xp, g)
