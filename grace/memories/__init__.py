"""Memories (error feedback), selectable by name with ``memory=``."""
from __future__ import annotations

from grace.core.memory import Memory
from grace.memories.none import NoMemory
from grace.memories.residual import ResidualMemory

MEMORIES = {"none": NoMemory, "residual": ResidualMemory}


def make_memory(spec) -> Memory:
    """``spec`` is a name from MEMORIES, None (no memory) or a Memory object."""
    if isinstance(spec, Memory):
        return spec
    if spec is None:
        return NoMemory()
    if isinstance(spec, str) and spec in MEMORIES:
        return MEMORIES[spec]()
    raise ValueError(f"memory must be one of {', '.join(map(repr, MEMORIES))} or a Memory object, got {spec!r}")
