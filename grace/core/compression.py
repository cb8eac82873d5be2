"""What a user passes as ``compression=``: a compressor, a memory and a collective.

``GradientCompression`` is configuration only. The state it needs at run time (error-feedback
memory, per-tensor step counters) lives in an ``Exchange`` owned by the optimizer wrapper, so
one configuration can serve several optimizers and the state is saved with each of them.
"""
from __future__ import annotations

from typing import Optional, Union

from grace.core.compressor import Collective, Compressor, check_steps
from grace.core.memory import Memory


#: DDP's default bucket cap
DEFAULT_BUCKET_MB = 25.0
SCOPES = ("tensor", "bucket")


class GradientCompression:
    """``bucket_mb``: the cap of a bucket of gradients exchanged together (0: one exchange per
    gradient). ``scope``: 'tensor' compresses each gradient as its own tensor; 'bucket'
    compresses a bucket's flat buffer as one tensor (for example one global top-k), which is
    a different method with its own accuracy. ``warmup_steps``: the first steps send every
    gradient uncompressed, by a plain allreduce, leaving the memory untouched."""

    def __init__(self, compressor: Compressor, memory: Memory,
                 communicator: Optional[Union[str, Collective]] = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, scope: str = "tensor", warmup_steps: int = 0):
        self.compressor = compressor
        self.memory = memory
        if not memory.fits(compressor):
            raise ValueError(f"memory {type(memory).__name__} cannot be used with {type(compressor).__name__}: it is "
                             "the error feedback of another method; use memory='residual' or 'none'")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 <= bucket_mb < float("inf"):
            raise ValueError(f"bucket_mb must be a finite number >= 0 (0: one exchange per gradient), got {bucket_mb!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")
        if scope == "bucket" and not bucket_mb:
            raise ValueError("scope='bucket' compresses whole buckets: it needs bucket_mb > 0")
        if scope == "bucket" and compressor.traits.multi_round:
            raise ValueError(f"scope='bucket' cannot be used with {type(compressor).__name__}: "
                             "it works on each gradient's matrix shape")
        self.bucket_mb = float(bucket_mb)
        self.scope = scope
        self.warmup_steps = check_steps(warmup_steps)
        #: 'auto' (the default of every allgather method): per bucket and world size, the method's own
        #: collective (below), the two-phase alltoall or dense, by the bytes received (grace.core.traffic)
        self.auto = communicator == "auto" or (communicator is None and compressor.collective is Collective.ALLGATHER)
        self.collective = compressor.collective if communicator in (None, "auto") else Collective.parse(communicator)
        if self.collective is Collective.ALLREDUCE and not compressor.traits.supports_allreduce:
            raise ValueError(
                f"communicator='allreduce' cannot carry {type(compressor).__name__} payloads "
                "(their decompress is not linear or their shapes differ between ranks); "
                "use 'allgather' or 'broadcast'"
            )
        if compressor.traits.multi_round and self.collective is not Collective.ALLREDUCE:
            raise ValueError(f"{type(compressor).__name__} sums its factors between rounds: "
                             "it runs only with communicator='allreduce'")
        if self.collective is Collective.ALLTOALL:
            _check_alltoall(compressor, self.bucket_mb, scope)

    def via(self, communicator: Union[str, Collective]) -> "GradientCompression":
        """This method and these buckets on ``communicator`` (``via(c.collective)``: its own
        collective, where it would default to 'auto')."""
        return GradientCompression(self.compressor, self.memory, communicator, self.bucket_mb, self.scope,
                                   self.warmup_steps)

    @property
    def flags_overflow(self) -> bool:
        """Whether each exchange carries an overflow flag and is undone on an inf or NaN: every
        method but those that pass an inf through by themselves and keep no memory (``none``,
        ``fp16``), which have nothing to undo, unless they count warm-up steps."""
        return not (self.compressor.traits.passes_nonfinite and not self.memory.needs_feedback) \
            or self.warmup_steps > 0

    def __repr__(self) -> str:
        scope = f", scope='{self.scope}'" if self.scope != "tensor" else ""
        scope += f", warmup_steps={self.warmup_steps}" if self.warmup_steps else ""
        communicator = "auto" if self.auto else self.collective.value
        return (f"grace({self.compressor!r}, memory={self.memory!r}, communicator='{communicator}', "
                f"bucket_mb={self.bucket_mb:g}{scope})")

    # Horovod's own hook calls these when it got a grace object without grace's wrapper.
    def compress(self, tensor):
        raise RuntimeError(
            "a grace compression reached Horovod's dense allreduce hook, which cannot carry it. "
            "Create the optimizer as hvd.DistributedOptimizer(...) after `import grace` "
            "(with `import horovod.torch as hvd`), or with grace.torch.DistributedOptimizer(...)"
        )

    decompress = compress


def _check_alltoall(compressor: Compressor, bucket_mb: float, scope: str) -> None:
    """communicator='alltoall' shards buckets among the ranks (grace.core.plans.alltoall)."""
    from grace.core.plans.owner import owner_of  # (the plans import this module)

    if not bucket_mb:
        raise ValueError("communicator='alltoall' shards buckets among the ranks: it needs bucket_mb > 0")
    if scope != "tensor":
        raise ValueError("communicator='alltoall' compresses each rank's shard of a bucket as one tensor: "
                         "leave scope='tensor'")
    refusal = owner_of(compressor).refusal()
    if refusal:
        raise ValueError(f"communicator='alltoall' cannot be used with {type(compressor).__name__}: {refusal}")
