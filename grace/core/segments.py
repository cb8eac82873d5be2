"""Segmented operations: all gradients of a bucket in one pass over its flat buffer.

A bucket's gradients lie one after another in a flat buffer. A ``SegmentTable`` says where
(each segment's offset and size, on the bucket's device), built once per bucket. The
operations here give each segment exactly what the per-tensor code gives it alone (the
per-tensor path is their oracle, bit for bit), with a number of kernel launches and Python
calls that does not grow with the number of segments: what a GPU needs, where a launch costs
more than a small gradient's arithmetic. (Methods with native kernels run those per segment
instead, from one call: ``MethodKernels.segment_kernel``; the sorted selection here is top-k's
tensor-op fallback.)

``SegmentedFrame`` writes and reads a bucket's frame (``grace.core.bucket``) from whole
fields (one per payload position, every segment's piece in a row), byte for byte the frame
that the segments' own payloads make; ``grace.core.sparse_frames`` does so for a variable
number of (value, index) pairs per segment (a threshold's selection).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Tuple

import numpy as np

from grace.core.bucket import ALIGN, ITEMSIZE, _order, _padded, _zeros
from grace.core.tensors import constant

KEY_BITS = 31  # |x| of a float32, read as an integer: order-preserving, NaN above inf


@dataclass
class SegmentTable:
    """Where each segment lies in a flat buffer of ``numel`` elements. It keeps nothing per
    element (a per-element segment index would cost twice the bucket's memory): per-segment
    values are spread over the elements with ``xp.repeat`` when needed."""

    numels: Tuple[int, ...]
    starts: Tuple[int, ...]
    numel: int
    counts: Any  # int64 per segment, on the device: its size
    start: Any  # int64 per segment: its first element
    cache: dict = field(default_factory=dict)  # what a method derives from the layout, per name

    @classmethod
    def build(cls, xp, numels: Sequence[int], like) -> "SegmentTable":
        starts = np.concatenate([[0], np.cumsum(numels)[:-1]]).astype(np.int64)
        return cls(tuple(int(n) for n in numels), tuple(int(s) for s in starts), int(sum(numels)),
                   xp.asarray(np.asarray(numels, dtype=np.int64), like=like), xp.asarray(starts, like=like))

    def per_element(self, xp, per_segment):
        """A per-segment tensor spread over the elements."""
        return xp.repeat(per_segment, self.counts, self.numel, self.start)

    def cached(self, name, make):
        """``make()``, computed once per table."""
        if name not in self.cache:
            self.cache[name] = make()
        return self.cache[name]

    def latest(self, name, key, make):
        """``make()`` for ``key``, kept for the latest key only (values that change for a while,
        as DGC's k during its warm-up: one kept, not one per step)."""
        held = self.cache.get(name)
        if held is None or held[0] != key:
            held = self.cache[name] = (key, make())
        return held[1]

    def counts_at_least_one(self, xp):
        """The segments' sizes as float32, 0 taken as 1: what a per-segment mean divides by."""
        return self.cached("counts as divisors", lambda: xp.clip_min(xp.cast(self.counts, "float32"), 1))

    def repeated(self, xp, times: int) -> "SegmentTable":
        """The table of ``times`` such buckets end to end (every rank's fields in a row)."""
        return self.cached(f"{times} times", lambda: SegmentTable.build(xp, self.numels * times, self.counts))


def row_lengths(numel: int, row: int) -> list:
    """``numel`` elements cut in rows of ``row``: the rows' lengths (the last may be shorter;
    none for no elements)."""
    full, rest = divmod(int(numel), int(row))
    return [int(row)] * full + ([rest] if rest else [])


def rows(xp, numel: int, row: int, like) -> SegmentTable:
    """The table of one tensor of ``numel`` elements cut in rows of ``row``: a per-tensor
    formula's reductions by the segment ops, which give a row alone what they give it among a
    bucket's (made once per device)."""
    return constant(xp, ("rows", int(numel), int(row)),
                    lambda: SegmentTable.build(xp, row_lengths(numel, row), like), like)


def whole(xp, numel: int, like) -> SegmentTable:
    """The table of one tensor as one segment (an empty one too)."""
    if numel:
        return rows(xp, numel, numel, like)
    return constant(xp, ("rows", 0, 0), lambda: SegmentTable.build(xp, [0], like), like)


def magnitude_keys(xp, x):
    """|x| of a float32 tensor as int32: larger magnitude, larger key (NaN above inf)."""
    return xp.from_bytes(xp.to_bytes(xp.abs(x)), "int32")


def top_mask(xp, keys, table: SegmentTable, ks: Sequence[int]):
    """True at each segment's ``ks[s]`` largest of its ``keys`` (non-negative int32); among keys
    equal to the k-th, the first ones: the rule of grace.native's top-k selection. One stable
    sort of the bucket by (segment, key descending): segment s holds places [start, start + n)
    of that order whatever its keys, so its first k places are the ones taken."""
    def make():
        base = (np.arange(len(table.numels), dtype=np.int64) << KEY_BITS) + (2**KEY_BITS - 1)
        places = np.concatenate([np.arange(start, start + k, dtype=np.int64) for start, k in zip(table.starts, ks)])
        return (xp.asarray(base, like=table.counts), xp.asarray(places, like=table.counts),
                xp.asarray(np.ones((), bool), like=table.counts))
    base, places, true = table.cached(("top places", tuple(ks)), make)
    order = xp.argsort(table.per_element(xp, base) - xp.cast(keys, "int64"))  # (segment, key descending)
    return xp.put(xp.zeros(table.numel, "bool", like=keys), xp.gather(order, places), true)


class SegmentedFrame:
    """The frame of a bucket whose every segment sends pieces of fixed sizes: ``fields[j]`` is
    (element count per segment, wire dtype per segment) of payload position j. The frame is
    the one ``bucket.frame`` makes of the pieces in segment order (segment 0's payload, then
    segment 1's...): pieces widest first, then the overflow flag, then padding.

    Where a field's elements lie in the frame in its own order and at its own width, they are
    written and read as they are. Otherwise (a sparsifier's values between its indices, indices
    sent at each segment's width) the frame is one gather of bytes from the fields' bytes, and a
    field one gather of bytes from the ranks' frames: a few operations per bucket, whatever its
    widths and segments. (Integers are little-endian and non-negative: an index cast to a
    narrower width is its low bytes, widened again its high bytes are zeros.)"""

    def __init__(self, xp, fields: Sequence[Tuple[Sequence[int], Sequence[str]]], flagged: bool, like):
        segments = len(fields[0][0])
        pieces = [(j, s) for s in range(segments) for j in range(len(fields))]
        dtypes = [fields[j][1][s] for j, s in pieces]
        counts = [int(fields[j][0][s]) for j, s in pieces]
        self.field_sizes = [int(sum(c)) for c, _ in fields]
        # what read() gives: a field's wire dtype, or int64 for indices sent at several widths
        self.field_dtypes = [d[0] if len(set(d)) == 1 else "int64" for _, d in fields]
        field_starts = [np.concatenate([[0], np.cumsum(c)[:-1]]).astype(np.int64) for c, _ in fields]
        self.flagged = flagged
        # each field element's first byte in the frame and its width there
        self._at = [np.zeros(size, np.int64) for size in self.field_sizes]
        self._width = [np.zeros(size, np.int64) for size in self.field_sizes]
        by_width: dict = {}  # width -> [(field, positions in the field)] in frame order
        for i in _order(dtypes):
            j, s = pieces[i]
            by_width.setdefault(ITEMSIZE[dtypes[i]], []).append((j, field_starts[j][s] + np.arange(counts[i])))
        offset = 0
        for width, sources in by_width.items():
            for j, positions in sources:
                self._at[j][positions] = offset + width * np.arange(len(positions))
                self._width[j][positions] = width
                offset += width * len(positions)
        self.pad = -(offset + flagged) % ALIGN
        self.size = offset + flagged + self.pad
        self._flag_at = offset
        # the fields laid in the frame as they are: j -> (first byte, bytes)
        self._whole = {}
        for j, size in enumerate(self.field_sizes):
            width = ITEMSIZE[self.field_dtypes[j]]
            if not size:
                self._whole[j] = (0, 0)
            elif np.all(self._width[j] == width) and \
                    np.array_equal(self._at[j], self._at[j][0] + width * np.arange(size)):
                self._whole[j] = (int(self._at[j][0]), width * size)
        # where every field lies whole: the fields in frame order (the frame is their join)
        self._in_order = sorted(self._whole, key=lambda j: self._whole[j][0]) \
            if len(self._whole) == len(self.field_sizes) else None
        self._like = like
        self._write_maps: dict = {}  # the fields' dtypes -> the frame's bytes in their bytes
        self._read_maps: dict = {}  # field -> (its bytes in a frame, the mask of bytes widened, or None)
        self._counts = [list(c) for c, _ in fields]  # each field's elements per segment
        self._slots = None  # pair_slots'

    def write(self, xp, fields: Sequence, flag=None):
        """This rank's frame from its ``fields`` (1-d, in segment order; integer fields are
        cast to each segment's wire dtype, floats keep theirs)."""
        flag = flag if self.flagged else None
        if self._in_order is not None:  # every field as it is
            parts = [xp.to_bytes(_as_words(xp, fields[j], ITEMSIZE[self.field_dtypes[j]])) for j in self._in_order]
            return _padded(xp, parts, self._like, flag)
        dtypes = tuple(xp.dtype(f) for f in fields)
        if dtypes not in self._write_maps:
            self._write_maps[dtypes] = xp.asarray(self._write_map(dtypes), like=self._like)
        parts = [xp.to_bytes(f) for f in fields] + ([] if flag is None else [xp.cast(flag, "uint8")])
        return xp.gather(xp.concat(parts + [_zeros(xp, 1, self._like)]), self._write_maps[dtypes])

    def _write_map(self, dtypes) -> np.ndarray:
        """For each byte of the frame, where it lies in the fields' bytes laid end to end, then
        the flag byte, then a zero byte."""
        sizes = [ITEMSIZE[d] for d in dtypes]
        starts = np.cumsum([0] + [n * size for n, size in zip(self.field_sizes, sizes)])
        zero = starts[-1] + self.flagged
        out = np.full(self.size, zero, np.int64)
        for j, size in enumerate(sizes):
            byte = np.arange(int(self._width[j].max(initial=0)))
            taken = byte[None, :] < np.minimum(self._width[j], size)[:, None]  # an element's bytes on the wire
            frame = self._at[j][:, None] + byte[None, :]
            source = starts[j] + size * np.arange(self.field_sizes[j])[:, None] + byte[None, :]
            out[frame[taken]] = source[taken]
        if self.flagged:
            out[self._flag_at] = starts[-1]
        return out

    def read(self, xp, received, ranks: int):
        """The fields of ``ranks`` frames laid end to end, as (ranks, field size) tensors (of the
        wire dtype; int64 for indices sent at several widths), and each rank's overflow flag
        (uint8) or None."""
        rows = xp.reshape(received, (ranks, self.size))
        out = []
        for j, dtype in enumerate(self.field_dtypes):
            if j in self._whole:
                at, nbytes = self._whole[j]
                values = xp.from_bytes(xp.flatten(rows[:, at:at + nbytes]), dtype)
            else:
                if j not in self._read_maps:
                    self._read_maps[j] = self._read_map(xp, j)
                positions, mask = self._read_maps[j]
                taken = xp.gather(rows, positions, axis=1)
                values = xp.from_bytes(xp.flatten(taken if mask is None else taken * mask), dtype)
            out.append(xp.reshape(values, (ranks, self.field_sizes[j])))
        return out, self.flags(xp, received, ranks)

    def flags(self, xp, received, ranks: int):
        """Each rank's overflow flag byte in ``ranks`` frames end to end: a view, or None."""
        return xp.flatten(xp.reshape(received, (ranks, self.size))[:, self._flag_at:self._flag_at + 1]) \
            if self.flagged else None

    def pair_slots(self, xp, starts):
        """For frames of (values, indices) pairs, what the native mean reads in place
        (``grace.native.sparse_frames_mean``): each pair's value byte in a frame, its index's
        byte and width, and its segment's start (``starts``: each segment's in the bucket), as
        one int64 (4, pairs) tensor on the device, made once; and the flag's byte (-1: none)."""
        if self._slots is None:
            assert set(self._width[0].tolist()) <= {4}, "float32 values"
            base = np.repeat(np.asarray(starts, np.int64), self._counts[1])
            self._slots = xp.asarray(np.stack([self._at[0], self._at[1], self._width[1], base]), like=self._like)
        return self._slots, (self._flag_at if self.flagged else -1)

    def _read_map(self, xp, j: int):
        """Field j's bytes in a frame (read at its dtype's width; a byte past an element's width
        on the wire is taken as frame byte 0, then zeroed by the mask)."""
        size = ITEMSIZE[self.field_dtypes[j]]
        byte = np.arange(size)
        taken = byte[None, :] < self._width[j][:, None]
        positions = np.where(taken, self._at[j][:, None] + byte[None, :], 0).reshape(-1)
        mask = None if taken.all() else xp.asarray(taken.reshape(-1).astype(np.uint8), like=self._like)
        return xp.asarray(positions, like=self._like), mask


_WORD = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_words(xp, field, width: int):
    """A field as integers of ``width`` bytes: floats bit for bit, integers cast (the segments
    that send this width hold values that fit)."""
    dtype = xp.dtype(field)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        assert ITEMSIZE[dtype] == width
        return xp.from_bytes(xp.to_bytes(field), _WORD[width])
    return xp.cast(field, _WORD[width])
