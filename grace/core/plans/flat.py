"""The flat plan: a bucket copied into one flat tensor with one flat memory and compressed as
one tensor.

It is the plan of ``scope='bucket'`` (one global top-k, ...: a method of its own) and, on an
accelerator, of the elementwise methods (``Traits.elementwise``: the same results as per
gradient), where one kernel per bucket beats one per gradient. Otherwise the steps are the
per-gradient plan's, with one unit.
"""
from __future__ import annotations

from grace.core.plans.base import WholeBucket, defers_on_device
from grace.core.plans.per_gradient import PerGradient


class Flat(WholeBucket, PerGradient):
    name = "flat"

    def _defers(self, xp, g) -> bool:
        return defers_on_device(xp, g)
