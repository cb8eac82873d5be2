"""Segment-wise packing: every segment of a bucket's flat buffer packed as it packs alone (its
codes from a byte boundary, its last byte padded with zeros) by one pack of the whole bucket,
the segments first spread to whole bytes where their sizes are not (a gather, by maps made once
per bucket layout). What a method's whole-bucket formula sends is then, byte for byte, what
its gradients' own payloads send (``MethodKernels.encode_segments``).
"""
from __future__ import annotations

import numpy as np

from grace.core import bits as packing
from grace.core.bucket import _zeros
from grace.core.segments import SegmentTable


def pack(xp, codes, width: int, table: SegmentTable):
    """Each segment's ``width``-bit codes packed as ``bits.pack`` packs them alone (its last
    byte padded with zeros), the segments' bytes in a row: one pack of the whole bucket."""
    if 8 % width:  # as bits.pack: the codes' bit planes, packed one bit each
        planes = packing.bit_planes(xp, xp.cast(codes, "uint8"), width)
        return packing.pack(xp, padded(xp, planes, table, width, 8), 1)
    return packing.pack(xp, padded(xp, codes, table, 1, 8 // width), width)


def unpack(xp, packed, width: int, table: SegmentTable):
    """``pack``'s inverse: every segment's codes (uint8), in a row."""
    if 8 % width:
        padding = _padding(xp, table, width, 8)
        planes = packing.unpack(xp, packed, 1, padding[0] if padding else table.numel * width)
        return packing.from_bit_planes(xp, unpadded(xp, planes, table, width, 8), width)
    padding = _padding(xp, table, 1, 8 // width)
    codes = packing.unpack(xp, packed, width, padding[0] if padding else table.numel)
    return unpadded(xp, codes, table, 1, 8 // width)


def _padding(xp, table: SegmentTable, per: int, multiple):
    """Segments of ``per`` items per element, each padded to a multiple of ``multiple`` items
    (a number, or one per segment): None where none needs any, else (the padded length, each
    item's place there, and for each place its item, or the item count for padding), the maps
    on the device."""
    def make():
        sizes = np.asarray(table.numels, np.int64) * per
        whole = np.maximum(np.asarray(multiple, np.int64), 1)
        padded = -(-sizes // whole) * whole
        if np.array_equal(sizes, padded):
            return None
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        places = np.arange(sizes.sum()) + np.repeat(np.cumsum(padded) - padded - starts, sizes)
        items = np.full(padded.sum(), sizes.sum(), np.int64)
        items[places] = np.arange(sizes.sum())
        return int(padded.sum()), xp.asarray(places, like=table.counts), xp.asarray(items, like=table.counts)
    key = multiple if isinstance(multiple, int) else tuple(int(m) for m in multiple)
    return table.cached(("padding", per, key), make)


def padded(xp, items, table: SegmentTable, per: int, multiple):
    """``items`` (``per`` to an element) with each segment's zero-padded to a multiple of
    ``multiple`` (booleans as uint8)."""
    padding = _padding(xp, table, per, multiple)
    if padding is None:
        return items
    return xp.gather(xp.concat([items, _zeros(xp, 1, items)]), padding[2])


def unpadded(xp, items, table: SegmentTable, per: int, multiple):
    """``padded``'s inverse: the first ``per`` times size items of each segment's."""
    padding = _padding(xp, table, per, multiple)
    return items if padding is None else xp.gather(items, padding[1])
