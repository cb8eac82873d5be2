"""What grace's two Horovod adapters (grace/torch, grace/tensorflow) share; imports no toolkit."""
from __future__ import annotations

from grace.core.compression import GradientCompression


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
