"""What a user passes as ``compression=``: a compressor, a memory and a collective.

``GradientCompression`` is configuration only. The state it needs at run time (error-feedback
memory, per-tensor step counters) lives in an ``Exchange`` owned by the optimizer wrapper, so
one configuration can serve several optimizers and the state is saved with each of them.
"""
from __future__ import annotations

from typing import Optional, Union

from grace.core.compressor import Collective, Compressor
from grace.core.memory import Memory


class GradientCompression:
    def __init__(self, compressor: Compressor, memory: Memory,
                 communicator: Optional[Union[str, Collective]] = None):
        self.compressor = compressor
        self.memory = memory
        self.collective = compressor.collective if communicator is None else Collective.parse(communicator)
        if self.collective is Collective.ALLREDUCE and not compressor.supports_allreduce:
            raise ValueError(
                f"communicator='allreduce' cannot carry {type(compressor).__name__} payloads "
                "(their decompress is not linear or their shapes differ between ranks); "
                "use 'allgather' or 'broadcast'"
            )
        if compressor.multi_round and self.collective is not Collective.ALLREDUCE:
            raise ValueError(f"{type(compressor).__name__} sums its factors between rounds: "
                             "it runs only with communicator='allreduce'")

    def __repr__(self) -> str:
        return f"grace({self.compressor!r}, memory={self.memory!r}, communicator='{self.collective.value}')"

    # Horovod's own hook calls these when it got a grace object without grace's wrapper.
    def compress(self, tensor):
        raise RuntimeError(
            "a grace compression reached Horovod's dense allreduce hook, which cannot carry it. "
            "Create the optimizer as hvd.DistributedOptimizer(...) after `import grace` "
            "(with `import horovod.torch as hvd`), or with grace.torch.DistributedOptimizer(...)"
        )

    decompress = compress


def check_horovod_arguments(compression, op, average, sum_, adasum, groups=None, num_groups=0) -> None:
    """What every Horovod adapter refuses at construction (``average``, ``sum_``, ``adasum``:
    that toolkit's op constants)."""
    if not isinstance(compression, GradientCompression):
        raise TypeError(f"compression must be a grace method such as grace.topk(0.01), got {compression!r}")
    if op == adasum:
        raise ValueError("op=hvd.Adasum cannot be used with a grace compression: Adasum combines "
                         "dense gradients pairwise; use op=hvd.Average or op=hvd.Sum")
    if op not in (average, sum_):
        raise ValueError(f"op must be hvd.Average or hvd.Sum with a grace compression, got {op!r}")
    if groups is not None or num_groups:
        raise ValueError("groups/num_groups (grouped allreduce) cannot be used with a grace "
                         "compression: each gradient is exchanged with its method's collective")
