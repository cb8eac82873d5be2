"""A selection's (value, index) pairs written straight into a fixed layout's frame (the bucket's
own ``SegmentedFrame``), in place of its fields: where the pairs lie (``pair_slots``), and the CPU
selections' pairs put there as the GPU's write kernels put them; and the rooms a CPU bucket call
counts its pairs into, copied from there into a variable-length frame."""
from __future__ import annotations

import ctypes
import functools
import itertools
from dataclasses import dataclass
from typing import Callable

from grace.formats import ITEMSIZE
from grace.native._arrays import c_array, call
from grace.native._common import _check_places, _in_place, _index_codes, _int64s, _int64s_of, _same_kind

PAIR_COLUMNS = 6  # GRACE_PAIR_COLUMNS: a row of a rank's pairs table, per segment (SparseFrames.pair_table)


def frame_pairs(kind, frame, pairs: int):
    """A fixed layout's frame that a selection writes its ``pairs`` pairs into, (buffer, slots,
    zero_from) (``SegmentedFrame.pair_slots``' int64 (4, pairs); the bytes from zero_from on are
    zeroed), as the C arguments (frame, slots, pairs, zero_from, frame size); none: NULLs."""
    if frame is None:
        return _no_frame()
    buffer, slots, zero_from = frame
    fb, sb = _in_place(kind, buffer, "uint8"), _same_kind(kind, slots)
    if sb.dtype != "int64" or sb.n != 4 * pairs or not 0 <= zero_from <= fb.n:
        raise ValueError(f"the frame's slots are int64 (4, {pairs}), its zeros within its {fb.n} bytes")
    return fb.ptr, sb.ptr, int(pairs), int(zero_from), fb.n


def _no_frame():
    return None, None, 0, 0, 0


def pairs_into_frame(kind, values, idx, frame) -> None:
    """A CPU selection's pairs (float32 values, int64 indices, Bufs) written into ``frame`` as
    the GPU's selection writes them (``frame_pairs``)."""
    buffer, slots, pairs, zero_from, size = frame_pairs(kind, frame, values.n)
    call(kind, "pairs_into_frame", values.ptr, idx.ptr, pairs, slots, buffer, zero_from, size)


@dataclass
class FrameRoom:
    """Where a variable-length bucket call writes this rank's frame itself, header, pieces and
    padding (``_Rooms.payloads``): ``flagged``, whether the frame has an overflow flag's byte;
    ``place(dtypes, counts, end, size)``, the uint8 buffer of ``size`` bytes it goes into, told
    the pieces' dtypes and counts and where they end (the exchange's kept frame buffer)."""

    flagged: bool
    place: Callable


class _Rooms:
    """Room for up to ``sizes[s]`` values (float32) and indices (``dtypes[s]``) of each gradient
    of a bucket, whose counts the kernel tells: one buffer for the values, one per index dtype.
    (Where they lie is worked out once per bucket layout, ``_room_layout``.)"""

    def __init__(self, kind, sizes, dtypes):
        self.layout = sizes, dtypes = tuple(sizes), tuple(dtypes)
        self.dtypes = dtypes
        (self.starts, self.index_starts, totals, value_bytes, index_bytes, self.codes, self.piece_dtypes,
         self.widths) = _room_layout(sizes, dtypes)
        self.values = kind.empty(sum(sizes), "float32")
        self.indices = {d: kind.empty(n, d) for d, n in totals.items()}
        self.counts = c_array(ctypes.c_int64, len(sizes))()
        self.value_at = [self.values.ptr + b for b in value_bytes]
        self.index_at = [self.indices[d].ptr + b for d, b in zip(dtypes, index_bytes)]

    @classmethod
    def kept_with(cls, outs, kind, sizes, dtypes) -> "_Rooms":
        """Rooms kept with a bucket call's outputs ``outs`` where a kept list (``Pieces``: one
        bucket's, step after step), made again only for another layout; new rooms for another
        list. Only for a call whose pairs are copied out of them (an ``into``): the rooms are
        written over at its next call."""
        derived = getattr(outs, "derived", None)
        rooms = None if derived is None else derived.get("rooms")
        if rooms is None or rooms.layout != (sizes, dtypes):
            rooms = cls(kind, sizes, dtypes)
            if derived is not None:
                derived["rooms"] = rooms  # (the latest layout's only: k changes every step of a warm-up)
        return rooms

    @functools.cached_property
    def _arguments(self):
        return (c_array(ctypes.c_void_p, len(self.dtypes))(*self.value_at),
                c_array(ctypes.c_void_p, len(self.dtypes))(*self.index_at), self.codes, self.counts)

    def arguments(self):
        """The C arguments: value and index addresses, index type codes, counts (made once)."""
        return self._arguments

    def payloads(self, kind, into=None):
        """Each gradient's values and indices, as many as the kernel counted: views; or, where
        ``into(dtypes, counts)`` lays them out in a buffer of the caller's (see ``_placed``),
        copied there in one call, and None for each (no view made: on small gradients the views
        cost more than the kernel); or, where ``into`` is a ``FrameRoom``, written as a
        variable-length frame (``_framed``)."""
        if isinstance(into, FrameRoom):
            return self._framed(kind, into)
        counts = list(self.counts)
        if into is None:
            return ([self.values.obj[s:s + c] for s, c in zip(self.starts, counts)],
                    [self.indices[d].obj[s:s + c] for d, s, c in zip(self.dtypes, self.index_starts, counts)])
        pieces = [c for c in counts for _ in "vi"]
        buffer, offsets, *_ = into(self.piece_dtypes, pieces)
        b = _in_place(kind, buffer, "uint8")
        _check_places(b, self.piece_dtypes, pieces, offsets)
        nbytes = [c * ITEMSIZE[d] for c, d in zip(pieces, self.piece_dtypes)]
        call(kind, "copy_pieces", len(pieces), self._sources, _int64s(nbytes), b.ptr, _int64s(offsets))
        return [None] * len(counts), [None] * len(counts)

    def _framed(self, kind, room: FrameRoom):
        """The pieces as a variable-length frame (header, pieces widest first, zeros to its end)
        in the buffer ``room`` places: sized and written by native calls, not laid out here (run
        just after the kernel's pass, whose caches are cold, Python costs several times its
        usual). Nones for the payloads, as for ``into``."""
        sizes = c_array(ctypes.c_int64, 2)()
        arguments = (len(self.piece_dtypes), 2, self._sources, self.counts, self.widths, int(room.flagged))
        if call(kind, "variable_frame", *arguments, None, 0, sizes) < 0:
            raise ValueError("a variable-length frame of pieces the kernel did not count")
        size, end = sizes
        counts = list(self.counts)
        b = _in_place(kind, room.place(self.piece_dtypes, [c for c in counts for _ in "vi"], end, size), "uint8")
        if b.n != size or call(kind, "variable_frame", *arguments, b.ptr, b.n, sizes) != 1:
            raise ValueError(f"a variable-length frame of {size} bytes placed in {b.n}")
        return [None] * len(counts), [None] * len(counts)

    @functools.cached_property
    def _sources(self):
        """The pieces' addresses, a C array: each gradient's values, then its indices."""
        return c_array(ctypes.c_void_p, 2 * len(self.dtypes))(
            *[a for pair in zip(self.value_at, self.index_at) for a in pair])


@functools.lru_cache(maxsize=256)
def _room_layout(sizes: tuple, dtypes: tuple):
    """Where ``_Rooms`` puts each gradient's values and indices: (value starts, index starts in
    the buffer of its dtype, each index buffer's size, the values' and indices' byte offsets, the
    index types' C codes); a bucket's are the same every step."""
    starts = [0, *itertools.accumulate(sizes[:-1])]
    totals = dict.fromkeys(dtypes, 0)  # each gradient's room in the buffer of its index dtype
    index_starts = []
    for n, d in zip(sizes, dtypes):
        index_starts.append(totals[d])
        totals[d] += n
    index_bytes = [ITEMSIZE[d] * i for d, i in zip(dtypes, index_starts)]
    pieces = tuple(t for d in dtypes for t in ("float32", d))  # (the pieces a frame gets: values, indices)
    widths = _int64s_of(tuple(ITEMSIZE[d] for d in pieces))  # (a C array: the frame's item sizes)
    return starts, index_starts, totals, [4 * i for i in starts], index_bytes, _index_codes(dtypes), pieces, widths
