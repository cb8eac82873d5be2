"""Bit packing (grace.core.bits' format).

    pack(codes, bits) -> packed, unpack(packed, bits, numel) -> codes
"""
from __future__ import annotations

from grace.formats import packed_size
from grace.native._arrays import call, kind_of
from grace.native._common import _wrap


# --- bit packing ----------------------------------------------------------------------------------
def pack(codes, bits: int):
    """uint8 codes (each < 2**bits; bool or other dtypes are cast to uint8) -> packed uint8,
    ceil(numel * bits / 8) bytes; grace.core.bits.pack's format."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    kind = kind_of(codes)
    c = kind.flat(codes)
    if c.dtype != "uint8" and not (c.dtype == "bool" and bits < 8):
        c = kind.flat(c.obj, "uint8")
    if bits == 8:
        return _wrap(kind, c)
    out = kind.empty(packed_size(c.n, bits), "uint8")
    call(kind, "pack", c.ptr, c.n, bits, out.ptr)
    return _wrap(kind, out)


def unpack(packed, bits: int, numel: int):
    """packed uint8 -> the first ``numel`` codes (uint8); 8 bits: ``packed`` itself, as
    grace.core.bits.unpack returns it."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits == 8:
        return packed
    kind = kind_of(packed)
    p = kind.flat(packed)
    if p.dtype != "uint8":
        raise TypeError(f"packed codes are uint8, got {p.dtype}")
    if p.n < packed_size(numel, bits):
        raise ValueError(f"{p.n} bytes hold fewer than {numel} codes of {bits} bits")
    out = kind.empty(numel, "uint8")
    call(kind, "unpack", p.ptr, numel, bits, out.ptr)
    return _wrap(kind, out)

