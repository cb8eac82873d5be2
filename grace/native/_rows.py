"""Every rank's payloads of a bucket, the bucket-at-once sums' input (CPU): the pieces of the
received frames as C arrays of pointers, counts and dtypes, field by field (``FrameRows``,
``_field``), made by NumPy with no object per rank and piece; variable-length frames' read from
their headers by one native call (``variable_rows``).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Sequence

import numpy as np

from grace.formats import ITEMSIZE
from grace.native._arrays import INDEX_CODES, NativeUnavailable, c_array, call
from grace.native._common import _c_view, _cpu_kind, _index_codes, _int64s, _int64s_of, _pointers, _same_kind_all


class FrameRows:
    """Every rank's payloads of a bucket in frames end to end in ``data`` (an allgather's result,
    uint8; frame r at byte ``starts[r]``; ``layout``: each piece's (byte offset in a frame, count,
    dtype), payload after payload, ``structure[i]`` pieces in unit i's, alike in every frame),
    for the bucket-at-once sums (CPU) in place of ``payloads[unit][rank]``: field j of every
    unit's payload as one C array of pointers in (unit, rank) order, made by one NumPy sum. The
    Python work does not grow with the ranks (no object per rank and piece). Frames whose
    pieces' lengths differ by rank: ``variable_rows``."""

    def __init__(self, data, starts: Sequence[int], layout: Sequence, structure: Sequence[int]):
        offsets, counts, dtypes, structure, first, end, fields = _layout_arrays(layout, structure)
        b = _frames_buffer(_cpu_kind(data), data)
        if len(starts) and offsets.size:
            lowest, highest = (starts[0], starts[-1]) if isinstance(starts, range) and starts.step > 0 \
                else (min(starts), max(starts))
            if lowest < 0 or highest + end > b.n:
                raise ValueError(f"a piece past the end of {b.n} bytes of frames")
        starts = np.asarray(starts, np.int64)
        self.ranks, self.units, self.keep = len(starts), len(structure), data
        self._offsets, self._counts, self._dtypes, self._structure = offsets, counts, dtypes, structure
        self._first, self._kept = first, fields
        self._frames = b.ptr + starts  # each frame's first byte
        self._fields: dict = {}

    def field(self, j: int):
        """Field j of every unit's payload: a ``_Field`` (its pointers, unit-major; its dtypes per
        unit, and its counts per unit where every frame is laid out alike, else per piece)."""
        if j not in self._fields:
            if any(n <= j for n in self._structure):
                raise ValueError(f"a payload without a field {j}")
            if j not in self._kept:  # (its pieces of field j, their dtypes and counts per unit)
                pieces = self._first + j
                self._kept[j] = (pieces, [self._dtypes[i] for i in pieces], self._counts[0, pieces].tolist())
            pieces, dtypes, unit_counts = self._kept[j]
            pointers = (self._offsets[:, pieces].T + self._frames[None, :]).reshape(-1)
            self._fields[j] = _Field(pointers, unit_counts, dtypes, self.ranks, True,
                                     kept=self._kept.setdefault((j, self.ranks), {}))
        return self._fields[j]


def variable_rows(data, ranks: int, dtypes: Sequence[str], structure: Sequence[int], flagged: bool = False):
    """``ranks`` variable-length frames (each rank's pieces of its own lengths) end to end in
    ``data`` (an allgather's result, uint8), read from their headers by one native call, which
    also counts the frames whose overflow flag is set (``flagged``): (a ``FrameRows`` whose
    fields hold every piece's count, that count). NativeUnavailable where a rank sent its dense
    bucket; RuntimeError where the headers do not add up to the bytes received."""
    kind = _cpu_kind(data)
    b = _frames_buffer(kind, data)
    widths, slots, fields = _variable_arrays(tuple(dtypes), tuple(structure), ranks)
    pointers, counts = np.empty(len(dtypes) * ranks, np.uint64), np.empty(len(dtypes) * ranks, np.int64)
    flags_set = c_array(ctypes.c_int64, 1)()
    done = call(kind, "variable_rows", b.ptr, b.n, ranks, len(dtypes), widths, int(flagged), slots,
                pointers.ctypes.data, counts.ctypes.data, flags_set)
    if done == 1:
        raise NativeUnavailable("a rank sent its dense bucket")
    if done != 0:
        raise RuntimeError(f"grace: the ranks' frame headers do not add up to the {b.n} bytes received "
                           "(are they configured differently?)")
    rows = FrameRows.__new__(FrameRows)
    rows.ranks, rows.units, rows.keep, rows._structure = ranks, len(structure), data, structure
    rows._fields = {j: _Field(pointers[lo:hi], None, field_dtypes, ranks, True, counts[lo:hi], kept)
                    for j, (lo, hi, field_dtypes, kept) in fields.items()}
    return rows, flags_set[0]


def _frames_buffer(kind, data):
    """The received frames as a native buffer of bytes (frames are uint8)."""
    b = kind.flat(data)
    if b.dtype != "uint8":
        raise ValueError(f"frames are uint8, got {b.dtype}")
    return b


def _first_pieces(structure):
    """Each unit's first piece (``structure``: pieces per unit's payload)."""
    return np.cumsum([0, *structure[:-1]]).astype(np.int64)


def _end(offsets, counts, dtypes) -> int:
    """Where a frame's last piece ends, bytes from its start; pieces at negative offsets or
    counts refused."""
    if (offsets < 0).any() or (counts < 0).any():
        raise ValueError("a piece at a negative offset or count")
    return int((offsets + counts * np.asarray([ITEMSIZE[d] for d in dtypes], np.int64)).max(initial=0))


# A bucket's frames repeat their layout every step (``grace.core.bucket.layout`` hands back the
# same tuple): what FrameRows derives from one is made once, kept by that tuple's id with the
# tuple itself (so that the id is not another's while kept).
_LAYOUTS: dict = {}


def _layout_arrays(layout, structure) -> tuple:
    """What ``FrameRows`` derives from a fixed ``layout``: (its offsets, counts, dtypes, structure,
    each unit's first piece, where its last piece ends, the fields' kept parts shared by every
    FrameRows of the layout)."""
    kept = _LAYOUTS.get(id(layout))
    if kept is None or kept[0] is not layout or kept[1] != structure:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        offsets = np.asarray([[offset for offset, _, _ in layout]], np.int64)
        counts = np.asarray([[count for _, count, _ in layout]], np.int64)
        dtypes, structure = [dtype for _, _, dtype in layout], list(structure)
        for array in (offsets, counts):
            array.flags.writeable = False
        kept = _LAYOUTS[id(layout)] = (layout, structure, (
            offsets, counts, dtypes, structure, _first_pieces(structure),
            _end(offsets, counts, dtypes), {}))
    return kept[2]


@functools.lru_cache(maxsize=256)
def _variable_arrays(dtypes: tuple, structure: tuple, ranks: int) -> tuple:
    """What ``variable_rows`` derives from its frames' dtypes, structure and ranks, the same every
    step for a bucket: (the pieces' item sizes, a C array; each piece's first slot in the native
    call's output, a C array: field by field, unit by unit, rank by rank; each field every unit
    has: (its first slot, its end, its dtypes per unit, what its ``_Field`` keeps))."""
    first, slots, fields, at = _first_pieces(structure), [0] * len(dtypes), {}, 0
    for j in range(max(structure, default=0)):
        start, units = at, [u for u, n in enumerate(structure) if n > j]
        for u in units:
            slots[first[u] + j], at = at, at + ranks
        if len(units) == len(structure):
            fields[j] = (start, at, [dtypes[first[u] + j] for u in units], {})
    return _int64s_of(tuple(ITEMSIZE[d] for d in dtypes)), _int64s_of(tuple(slots)), fields


def payload_ranks(payloads) -> int:
    """How many ranks' payloads a bucket-at-once sum gets (``payloads[unit][rank]``, each unit
    with as many, or a ``FrameRows``)."""
    if isinstance(payloads, FrameRows):
        return payloads.ranks
    ranks = len(payloads[0])
    if any(len(rows) != ranks for rows in payloads):
        raise ValueError(f"each gradient needs {ranks} ranks' payloads")
    return ranks


class _Field:
    """Field j of a bucket's payloads for a sum's C call (``_field``): the pointers of every
    unit's ranks' pieces (unit, rank order), and the counts and dtypes of its entries: one per
    piece, or one per unit (``per_unit``) where a ``FrameRows`` gives them, every rank's alike;
    where the frames' lengths vary, dtypes per unit and every piece's count (``piece_counts``,
    an int64 array; ``counts`` None)."""

    def __init__(self, pointers, counts, dtypes, ranks: int, per_unit: bool, piece_counts=None, kept=None):
        if isinstance(pointers, np.ndarray):  # (addresses made by NumPy: a C array over them, kept with it)
            pointers = _c_view(ctypes.c_void_p, np.ascontiguousarray(pointers, np.uint64))
        self.pointers, self.counts, self.dtypes, self.piece_counts = pointers, counts, dtypes, piece_counts
        self.ranks, self.per_unit = ranks, per_unit
        # (a layout's field: its C arrays of lengths and index codes, made once, kept with the layout)
        self.kept = {} if kept is None else kept

    def per_entry(self, unit_values) -> list:
        """Per-unit values as one per entry (to compare with ``counts`` and ``dtypes``)."""
        return list(unit_values) if self.per_unit else [v for v in unit_values for _ in range(self.ranks)]

    def per_piece(self, entry_values) -> tuple:
        """Per-entry values as one per piece."""
        return tuple(v for v in entry_values for _ in range(self.ranks if self.per_unit else 1))

    def pieces(self) -> int:
        return len(self.pointers)

    def same_counts(self, other: "_Field") -> bool:
        """Whether two fields' pieces hold as many elements, piece by piece."""
        if self.piece_counts is None and other.piece_counts is None:
            return self.per_unit == other.per_unit and list(self.counts) == list(other.counts)
        # (int64 arrays, compared as bytes: np.array_equal costs five times as much, run cold here)
        return self.piece_counts is not None and other.piece_counts is not None \
            and self.piece_counts.shape == other.piece_counts.shape \
            and self.piece_counts.tobytes() == other.piece_counts.tobytes()

    def lengths(self):
        """The pieces' element counts, a C array."""
        if self.piece_counts is not None:
            return _c_view(ctypes.c_int64, self.piece_counts)
        if "lengths" not in self.kept:
            self.kept["lengths"] = _int64s(self.per_piece(self.counts))
        return self.kept["lengths"]

    def index_codes(self):
        """The pieces' index type codes, a C array."""
        if not self.per_unit:
            return _index_codes(self.dtypes)
        if "codes" not in self.kept:
            codes = np.repeat(np.asarray([INDEX_CODES[d] for d in self.dtypes], np.intc), self.ranks)
            self.kept["codes"] = _c_view(ctypes.c_int, codes)
        return self.kept["codes"]


def _field(kind, payloads, j: int, dtype: str = None) -> _Field:
    """Field j of every unit's ranks' payloads (``payloads[unit][rank]``, or a ``FrameRows``);
    NativeUnavailable where a piece is not of ``dtype``."""
    ranks = payload_ranks(payloads)
    if isinstance(payloads, FrameRows):
        field = payloads.field(j)
        if dtype is not None and any(d != dtype for d in field.dtypes):
            raise NativeUnavailable(f"a frame's piece of another dtype than {dtype}")
        return field
    bufs = _same_kind_all(kind, [p[j] for rows in payloads for p in rows], dtype)
    return _Field(_pointers(bufs), [b.n for b in bufs], [b.dtype for b in bufs], ranks, False)
