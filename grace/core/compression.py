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
