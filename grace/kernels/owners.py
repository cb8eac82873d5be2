"""The methods whose two-phase form is not their formula twice (``grace.core.plans.owner``).

QSGD: shards end at whole buckets of its norms.

TernGrad, and signSGD's vote (TernGrad's codes): each owner's second payload decoded straight over
the gradients its shard spans, a kernel call a shard (no decoded shard in between, on a CPU).

signSGD and Signum: the owner of a shard counts the ranks' votes, and its second payload is the
count's outcome itself, exact, as signSGD with majority vote sends it back: the sign of the sum
of the ranks' signs in 2 bits (-1, 0 or +1; a tie is 0, as the allgather exchange gives it: coded
as TernGrad's levels, 0, +1 and -1 at a scale of 1, by its kernels: one pass each way), or
with ``aggregate='mean'`` the sum in the bits it needs. The result is the allgather exchange's,
bit for bit; the owner keeps no memory.

SketchML: a shard's sketch has at most one bucket mean per ``ELEMENTS_PER_MEAN`` elements (from
``MIN_BUCKETS`` up to the method's own count). Every frame carries its sketch's means (32 bits
each), and a rank receives N - 1 shard frames and N - 1 owner frames per bucket: with the
method's 256 means in each, the means alone would grow with N (7% of a 25 MB bucket's bytes at
512 ranks). Sized by the shard, they stay a fixed share of it.

Top-k, DGC, AdaQ, onebit and EF-signSGD: the owner's second payload is ``BUDGET`` times a
shard's first one. The N ranks' selections of a shard, k / N each, sum to up to k non-zeros, and
the mean of N 1-bit payloads has up to 2^N levels; compressing that as hard as the first time
left most of each step in the owner's memory, which cost 1.6 to 7 points of accuracy on the
digits job at 8 ranks in 30 epochs (docs/methods.md). Top-k, DGC and AdaQ select ``BUDGET``
times their ratio; onebit and EF-signSGD send ``BUDGET`` passes of the method, each on what the
passes before it left. A rank then receives about (1 + BUDGET) (N - 1) / N payloads per step
whatever N is, against the allgather's N - 1, and the accuracy is the allgather's.
"""
from __future__ import annotations

import copy

import numpy as np

from grace.compressors.adaq import AdaQ
from grace.compressors.dgc import DGC
from grace.compressors.efsignsgd import EFSignSGD
from grace.compressors.onebit import OneBit
from grace.compressors.qsgd import QSGD
from grace.compressors.signsgd import SignSGD
from grace.compressors.sketchml import SketchML
from grace.compressors.terngrad import TernGrad
from grace.compressors.signum import Signum
from grace.compressors.topk import TopK
from grace.core import bits
from grace.core.compressor import finished, native_or_none
from grace.core.plans.owner import Owner, owner_for
from grace.core.tensors import constant


_TERNARY = TernGrad()  # (its decoding: codes 0, 1, 2 to 0, +s, -s)


def _ternary_into(xp, packed, scale, starts, lengths, outs) -> bool:
    """TernGrad's codes at ``scale``, elements [starts[i], starts[i] + lengths[i]) decoded into
    ``outs[i]`` by the native kernel: whether it ran."""
    return native_or_none(xp, "terngrad_decompress_pieces", outs[0], packed, scale, starts, lengths, outs) is not None


@owner_for(SignSGD)
class Vote(Owner):
    exact_again = True

    @staticmethod
    def _width(ranks: int) -> int:
        """Bits per element of the mean's second payload: the sum in [-ranks, ranks], plus ranks."""
        return (2 * ranks).bit_length()

    def compress_again(self, xp, aggregate, info):
        ranks = info.world_size
        if self.compressor.aggregate_by == "majority":
            # TernGrad's codes of the vote, exactly: each |x| / max|x| is 0 or 1, which no draw in [0, 1) changes
            (packed, _), _ = _TERNARY.compress(xp, aggregate, info)
            return (packed,), None
        codes = xp.floor(aggregate * ranks + (ranks + 0.5))  # (a mean times ranks is a sum, to rounding)
        width = self._width(ranks)
        if width <= 8:
            return (bits.pack(xp, xp.cast(codes, "uint8"), width),), None
        return (xp.cast(codes, "int16"),), None

    def decompress_again(self, xp, payload, ctx, ranks: int):
        if self.compressor.aggregate_by == "majority":  # (TernGrad's levels 0, +s, -s at s = 1)
            return _TERNARY.decompress(xp, (payload[0], self._one(xp, payload)), ctx)
        width, numel = self._width(ranks), ctx.numel
        codes = bits.unpack(xp, payload[0], width, numel) if width <= 8 else payload[0]
        total = xp.reshape(xp.cast(codes, "float32") - ranks, ctx.shape)
        return finished(self.compressor, xp, total, ranks, True)

    def decompress_again_into(self, xp, payload, ctx, ranks: int, starts, lengths, outs) -> bool:
        return self.compressor.aggregate_by == "majority" and \
            _ternary_into(xp, payload[0], self._one(xp, payload), starts, lengths, outs)

    @staticmethod
    def _one(xp, payload):
        """The vote's TernGrad scale, 1."""
        return constant(xp, "vote scale", lambda: xp.asarray(np.float32([1]), like=payload[0]), payload[0])


@owner_for(TernGrad)
class TernaryOwner(Owner):
    """TernGrad: the owner's codes decoded straight over the gradients its shard spans."""

    def decompress_again_into(self, xp, payload, ctx, ranks: int, starts, lengths, outs) -> bool:
        packed, scale = payload
        return _ternary_into(xp, packed, scale, starts, lengths, outs)


@owner_for(Signum)
class MomentumVote(Vote):
    """Signum: each rank's momentum over its whole bucket, then the vote as signSGD's."""

    def refusal(self):
        return None

    def prepare(self, xp, p, info, m):
        momentum = self.compressor.momentum
        m = momentum * m + (1 - momentum) * p
        return m, m


@owner_for(QSGD)
class QSGDOwner(Owner):
    """QSGD: shards cut at whole buckets of its norms."""

    @property
    def align(self) -> int:
        return self.compressor.bucket_size or 1


#: a shard's SketchML sketch: a 32-bit mean per 512 elements at most (1/16 bit each), and no fewer than MIN_BUCKETS
ELEMENTS_PER_MEAN, MIN_BUCKETS = 512, 16


@owner_for(SketchML)
class ShardSketch(Owner):
    """Each shard's sketch (and the owner's, of the shard's aggregate) sized by the shard."""

    def _sketch(self, xp, x) -> SketchML:
        own = self.compressor.buckets
        return SketchML(min(own, max(MIN_BUCKETS, xp.numel(x) // ELEMENTS_PER_MEAN)))

    def compress(self, xp, x, info):  # (and compress_again, of the aggregate)
        return self._sketch(xp, x).compress(xp, x, info)


#: the owner's second payload in first payloads: top-k, DGC and AdaQ's ratio times it, onebit and EF-signSGD's passes
BUDGET = 4


@owner_for(TopK, DGC, AdaQ)
class WiderSelection(Owner):
    """The second selection keeps ``BUDGET`` times the first's ratio (at most every element)."""

    def __init__(self, compressor):
        super().__init__(compressor)
        self.again = copy.copy(compressor)
        self.again.ratio = min(1.0, compressor.ratio * BUDGET)

    def compress_again(self, xp, aggregate, info):
        return self.again.compress(xp, aggregate, info)

    def decompress_again(self, xp, payload, ctx, ranks: int):
        return self.again.decompress(xp, payload, ctx)


@owner_for(OneBit, EFSignSGD)
class Refined(Owner):
    """``BUDGET`` passes of the method, each on what the ones before it left of the aggregate."""

    def compress_again(self, xp, aggregate, info):
        payload, rest = (), aggregate
        for _ in range(BUDGET):
            part, ctx = self.compressor.compress(xp, rest, info)
            payload += part
            rest = rest - self.compressor.decompress(xp, part, ctx)
        return payload, ctx

    def decompress_again(self, xp, payload, ctx, ranks: int):
        width = len(payload) // BUDGET
        parts = [self.compressor.decompress(xp, payload[i:i + width], ctx) for i in range(0, len(payload), width)]
        return sum(parts[1:], parts[0])
