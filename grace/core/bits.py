"""Bit packing: small unsigned codes, several to a byte, written once on backend operations.

A code of ``bits`` bits (1, 2, 4 or 8) sits at bit offset ``bits * j`` of byte ``i`` for
element ``per * i + j`` (per = 8 // bits), little-endian within the byte. The last byte is
padded with zero codes; the element count comes from ctx, so it never travels.
"""
from __future__ import annotations

import math

WIDTHS = (1, 2, 4, 8)


def code_width(levels: int) -> int:
    """The narrowest packing width that holds ``levels`` distinct codes."""
    need = max(1, math.ceil(math.log2(levels)))
    for bits in WIDTHS:
        if bits >= need:
            return bits
    raise ValueError(f"{levels} levels do not fit in one byte")


def packed_size(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


def _place_values(xp, bits: int, like):
    """uint8 [1, 2**bits, 2**(2*bits), ...]: the value of a code's slot in its byte."""
    return xp.cast(xp.asarray([1 << (bits * j) for j in range(8 // bits)], like=like), "uint8")


def pack(xp, codes, bits: int):
    """uint8 codes (each < 2**bits) -> uint8 bytes."""
    per = 8 // bits
    codes = xp.cast(xp.flatten(codes), "uint8")
    if per == 1:
        return codes
    pad = -xp.numel(codes) % per
    if pad:
        codes = xp.concat([codes, xp.zeros(pad, "uint8", like=codes)])
    return xp.cast(xp.sum(xp.reshape(codes, (-1, per)) * _place_values(xp, bits, codes), axis=1), "uint8")


def unpack(xp, packed, bits: int, numel: int):
    """uint8 bytes -> the first ``numel`` uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed
    codes = (xp.reshape(packed, (-1, 1)) // _place_values(xp, bits, packed)) % (1 << bits)
    return xp.flatten(codes)[:numel]
