"""Plans: the ways an exchange sends a bucket, one file each, chosen once per bucket layout
(and, under 'auto', again where a new world size changes the cheapest way: ``outgrown``).

    reference     one gradient at a time, the GRACE pipeline as written (bucket_mb=0)
    per-gradient  each gradient compressed alone, all payloads in one collective (a CPU)
    flat          the bucket as one flat tensor (scope='bucket'; elementwise methods on an accelerator)
    segmented     one pass over the flat bucket, each gradient with its own result (an accelerator)
    multi-round   PowerSGD's rounds for the whole bucket, one allreduce per round
    alltoall      each rank owns a shard of the bucket: two phases whose bytes per rank do not grow with N
    dense         the compensated bucket by one float32 allreduce (communicator='auto', where that is cheapest)

``choose`` reads the method, the bucket and the device, and names the plan and why; every
bucketed plan gives the reference plan's results bit for bit (the tests hold them to it).
"""
from __future__ import annotations

from dataclasses import dataclass

from grace.core import traffic
from grace.core.compressor import Collective
from grace.core.plans.alltoall import AllToAll
from grace.core.plans.base import BucketPending, BucketPlan, Services
from grace.core.plans.dense import Dense
from grace.core.plans.flat import Flat
from grace.core.plans.multi_round import MultiRound
from grace.core.plans.per_gradient import PerGradient
from grace.core.plans.reference import Pending, Reference
from grace.core.plans.segmented import Segmented


@dataclass(frozen=True)
class PlanChoice:
    """Which plan a gradient takes (``Exchange.plan_of``): its name, its bucket, and why."""

    plan: str
    bucket: str  # the bucket's key ('' for the reference plan)
    why: str

    def __str__(self) -> str:
        return f"{self.plan} ({self.why})"


def choose(services: Services, bucket, xp, like) -> BucketPlan:
    """The plan for ``bucket``, whose gradients are like ``like`` on backend ``xp``."""
    if services.compression.collective is Collective.ALLTOALL:
        return AllToAll(services, bucket, "communicator='alltoall': this rank owns one shard of each bucket")
    way, why = _auto(services, bucket)
    if way == "alltoall":
        return AllToAll(services, bucket, why)
    if way == "dense":
        return Dense(services, bucket, why)
    plan = _own(services, bucket, xp, like)
    if why:
        plan.why = f"{why}; {plan.why}"
    return plan


def outgrown(services: Services, plan: BucketPlan) -> bool:
    """Whether 'auto' would send ``plan``'s bucket another way in the world as it is now (it
    changed size: elastic training). Every rank must take the way a rank that just joined
    takes, and an allgather's bytes grow with N."""
    way, _ = _auto(services, plan.bucket)
    ways = (AllToAll.name, Dense.name)
    return (way if way in ways else None) != (plan.name if plan.name in ways else None)


def _own(services: Services, bucket, xp, like) -> BucketPlan:
    """The plan of the method's own collective."""
    compression = services.compression
    compressor, kind = compression.compressor, type(compression.compressor).__name__
    if compression.scope == "bucket":
        return Flat(services, bucket, "scope='bucket': the bucket is compressed as one tensor")
    why_not = _why_not_segmented(compression, services.kernels, bucket, xp, like)
    if why_not is None:
        return Segmented(services, bucket, f"{kind} compresses an accelerator's bucket in one pass per phase", xp,
                         like)
    if compressor.traits.elementwise and xp.on_accelerator(like):
        return Flat(services, bucket, f"{kind} treats elements alone: one kernel per bucket on an accelerator")
    if compressor.traits.multi_round:
        return MultiRound(services, bucket, f"{kind} sums its factors round by round")
    return PerGradient(services, bucket, why_not)


def _auto(services: Services, bucket):
    """communicator='auto': the way that receives the fewest bytes per rank for this bucket and
    world size, and why; (None, '') where the method keeps its own collective."""
    compression, ranks = services.compression, services.communicator.size
    if not compression.auto or ranks < 2 or compression.collective is Collective.ALLREDUCE:
        return None, ""  # (a summed payload's traffic is already a ring allreduce's)
    costs = traffic.received(compression, bucket.numel, ranks)
    way = traffic.chosen(compression, costs, ranks)
    shown = ", ".join(f"{name} {nbytes}" for name, nbytes in costs.items())
    measured = " (on a probe: its lengths vary)" if compression.compressor.traits.variable_length else ""
    return way, f"communicator='auto' at {ranks} ranks, bytes received per rank{measured}: {shown}"


def _why_not_segmented(compression, kernels, bucket, xp, like):
    """None where the bucket is compressed segment-wise; else the first reason it is not."""
    compressor = compression.compressor
    own_collective = (compression.collective is Collective.ALLREDUCE) == \
        (compressor.collective is Collective.ALLREDUCE)
    on_accelerator = getattr(xp, "segmented", False) and xp.on_accelerator(like)
    rules = [
        (on_accelerator, "on a CPU each gradient goes in turn: cache-sized passes"),
        (kernels.segmented, f"{type(compressor).__name__} has no segment-wise form"),
        (own_collective, "the method runs on another collective than its own"),
        (compression.memory.elementwise, f"{type(compression.memory).__name__} does not treat elements alone"),
        (bucket.dtype == "float32", f"segment-wise kernels read float32, the bucket is {bucket.dtype}"),
        (xp.mutable_tensors or not kernels.variable_segments,
         "variable lengths are read back, which a traced step cannot"),
    ]
    return next((why for holds, why in rules if not holds), None)


__all__ = ["AllToAll", "BucketPending", "BucketPlan", "Dense", "Flat", "MultiRound", "Pending", "PerGradient",
           "PlanChoice", "Reference", "Segmented", "Services", "choose", "outgrown"]
