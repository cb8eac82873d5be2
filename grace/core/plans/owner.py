"""What a method does in the two-phase exchange (``grace.core.plans.alltoall``), registered per
compressor class beside its kernels: ``@owner_for(SignSGD)``, ``owner_of(compressor)``.

The default is the method's formula in both roles: every rank compresses each shard as a tensor;
the owner of a shard aggregates the ranks' payloads as an allgather would (``aggregate``: the
mean, or a vote), then compresses that aggregate again with the same compressor (a stochastic
quantizer re-quantizes it), keeping the error of that second compression as its own memory where
the method has error feedback. The forms that differ (an exact vote, a wider second payload)
are in ``grace.kernels.owners``.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

from grace.core.compressor import Compressor, Payload
from grace.core.plans.by_class import ByClass


class Owner:
    #: shard boundaries fall on multiples of this many elements (a method's own blocks)
    align: int = 1
    #: the second compression loses nothing: the owner needs no memory of its error
    exact_again: bool = False

    def __init__(self, compressor: Compressor):
        self.compressor = compressor

    def refusal(self):
        """Why the method cannot take the two-phase exchange, or None."""
        if type(self.compressor).init_state is not Compressor.init_state:
            return f"{type(self.compressor).__name__} keeps per-tensor state, which shards would split"
        return None

    def prepare(self, xp, p, info, state) -> Tuple[Any, Any]:
        """What the bucket's shards are cut from, and the compressor's new state."""
        return p, state

    def compress(self, xp, x, info) -> Tuple[Payload, Any]:
        return self.compressor.compress(xp, x, info)

    def decompress(self, xp, payload: Payload, ctx) -> Any:
        return self.compressor.decompress(xp, payload, ctx)

    def reduce(self, xp, kernels, payloads: Sequence[Payload], ctx) -> Any:
        """The owner's aggregate of every rank's payload of its shard."""
        return kernels.aggregate(xp, payloads, ctx)

    def compress_again(self, xp, aggregate, info) -> Tuple[Payload, Any]:
        return self.compress(xp, aggregate, info)

    def decompress_again(self, xp, payload: Payload, ctx, ranks: int) -> Any:
        return self.decompress(xp, payload, ctx)

    def decompress_again_into(self, xp, payload: Payload, ctx, ranks: int, starts, lengths, outs) -> bool:
        """``decompress_again``'s elements [starts[i], starts[i] + lengths[i]) written into ``outs[i]``
        (flat, contiguous) by one kernel call, where the method has one: whether it wrote them."""
        return False


_REGISTRY = ByClass(Owner)
#: register the decorated ``Owner`` subclass for the given compressor classes (and their subclasses)
owner_for = _REGISTRY.register
#: the owner form of a compressor: the one registered for its class (or the nearest base), else ``Owner``
owner_of = _REGISTRY.of
