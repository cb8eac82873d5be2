"""Bit packing: small unsigned codes, several to a byte, written once on backend operations.

The packed stream is little-endian at every level: bit b of element i's ``bits``-bit code is
bit number ``bits * i + b`` of the stream, and stream bit n is bit ``n % 8`` of byte ``n // 8``.
The last byte is padded with zeros; the element count comes from ctx, so it never travels.

Widths 1, 2, 4 and 8 divide a byte and pack with one multiply-add per byte. Other widths
(3, 5, 6, 7 bits) are spread into their bit planes and packed as 1-bit codes: the same stream
at several times the temporary memory.

``pack`` and ``unpack`` are backend operations (``xp.pack``, ``xp.unpack``): a backend with a
native kernel for its tensors (PyTorch: csrc/, grace.native, when built) runs it, one pass and
the same bytes; the others run ``pack_codes`` / ``unpack_codes``, the tensor-op formula here.
"""
from __future__ import annotations

from grace.core.tensors import constant
from grace.formats import code_width, packed_size  # noqa: F401  (re-exported)

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)


def bit_planes(xp, codes, bits: int):
    """(numel * bits,) uint8 0/1: bit b of code i at position bits * i + b."""
    planes = xp.reshape(codes, (-1, 1)) // _place_values(xp, 1, codes)[:bits] % 2
    return xp.flatten(planes)


def from_bit_planes(xp, planes, bits: int):
    """``bit_planes``' inverse: the uint8 codes."""
    planes = xp.reshape(planes, (-1, bits))  # 0/1 times 2**b fits uint8
    return xp.cast(xp.sum(planes * _place_values(xp, 1, planes)[:bits], axis=1), "uint8")


def _place_values(xp, bits: int, like):
    """uint8 [1, 2**bits, 2**(2*bits), ...]: the value of a code's slot in its byte (made once
    per device)."""
    return constant(xp, ("place values", bits), lambda: xp.cast(
        xp.asarray([1 << (bits * j) for j in range(8 // bits)], like=like), "uint8"), like)


def pack(xp, codes, bits: int):
    """uint8 codes (each < 2**bits) -> uint8 bytes."""
    return xp.pack(codes, bits)


def unpack(xp, packed, bits: int, numel: int):
    """uint8 bytes -> the first ``numel`` uint8 codes."""
    return xp.unpack(packed, bits, numel)


def pack_codes(xp, codes, bits: int):
    """``pack`` in tensor operations."""
    codes = xp.cast(xp.flatten(codes), "uint8")
    if 8 % bits:
        return pack_codes(xp, bit_planes(xp, codes, bits), 1)
    per = 8 // bits
    if per == 1:
        return codes
    pad = -xp.numel(codes) % per
    if pad:
        codes = xp.concat([codes, xp.zeros(pad, "uint8", like=codes)])
    return xp.cast(xp.sum(xp.reshape(codes, (-1, per)) * _place_values(xp, bits, codes), axis=1), "uint8")


def unpack_codes(xp, packed, bits: int, numel: int):
    """``unpack`` in tensor operations."""
    if 8 % bits:
        return from_bit_planes(xp, unpack_codes(xp, packed, 1, numel * bits), bits)
    per = 8 // bits
    if per == 1:
        return packed
    codes = (xp.reshape(packed, (-1, 1)) // _place_values(xp, bits, packed)) % (1 << bits)
    return xp.flatten(codes)[:numel]
