"""Memories (error feedback), selectable by name with ``memory=``."""
from __future__ import annotations

from grace.core.memory import Memory
from grace.memories.dgc import DGCMemory
from grace.memories.efsignsgd import EFSignSGDMemory
from grace.memories.none import NoMemory
from grace.memories.powersgd import PowerSGDMemory
from grace.memories.residual import ResidualMemory

MEMORIES = {"none": NoMemory, "residual": ResidualMemory, "dgc": DGCMemory, "efsignsgd": EFSignSGDMemory,
            "powersgd": PowerSGDMemory}


def make_memory(spec, **options) -> Memory:
    """``spec`` is a name from MEMORIES, None (no memory) or a Memory object. ``options``
    are the method's settings a memory of that name takes (e.g. efsignsgd's lr)."""
    if isinstance(spec, Memory):
        return spec
    if spec is None:
        return NoMemory()
    if isinstance(spec, str) and spec in MEMORIES:
        try:
            return MEMORIES[spec](**options)
        except TypeError:
            raise ValueError(f"memory {spec!r} cannot be used with this method") from None
    raise ValueError(f"memory must be one of {', '.join(map(repr, MEMORIES))} or a Memory object, got {spec!r}")
