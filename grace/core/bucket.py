"""Buckets: a step's gradients in a few flat buffers, each exchanged with one collective.

A bucket is a run of gradients of one dtype on one device, in the order backward produces
them, up to a size cap (as Horovod's fusion buffer and DDP's gradient buckets). The layout is
a pure function of the tensors' names, shapes and dtypes, so every rank plans the same buckets.

What a rank sends for a bucket is one contiguous uint8 tensor, its *frame*:

    [header: int64 element count per piece]   (variable-length methods only)
    [pieces: every payload tensor of every segment, widest element type first]
    [overflow flag: one uint8, 1 if the rank's gradients held an inf or a NaN]   (when guarded)
    [zeros up to a multiple of 8 bytes]

Widest first and the 8-byte total keep every piece aligned for its dtype, in this rank's
frame and in the concatenation of all ranks' frames that allgather returns, so the receiver
reads pieces as views, without copies. A frame whose header starts with -1 carries the dense
bucket instead (a variable-length encoding that came out larger than the gradient).
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from grace.core.communicator import _lengths
from grace.core.compressor import FLOAT_DTYPES, Payload, Shape, name_key_of
from grace.core.tensors import constant
from grace.formats import ITEMSIZE

ALIGN = 8
DENSE = -1  # first header entry of a frame that carries the dense bucket


@dataclass(frozen=True)
class Segment:
    """One gradient's place in its bucket's flat buffer."""

    name: str
    shape: Tuple[int, ...]
    offset: int  # in elements
    numel: int


@dataclass(frozen=True)
class Bucket:
    key: str  # names the bucket's collectives: the same on every rank
    dtype: str
    segments: Tuple[Segment, ...]
    # the bytes of every bucket of its layout (a step's gradients), which are compressed before
    # the first one's results are read; 0 where buckets come one at a time (DDP's)
    step_bytes: int = 0

    # (asked for per bucket and step: made once)
    @functools.cached_property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @functools.cached_property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    @functools.cached_property
    def numels(self) -> Tuple[int, ...]:
        return tuple(s.numel for s in self.segments)

    @functools.cached_property
    def shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return tuple(s.shape for s in self.segments)

    @functools.cached_property
    def name_keys(self) -> Tuple[int, ...]:
        """Each gradient's ``TensorInfo.name_key``."""
        return tuple(map(name_key_of, self.names))

    @functools.cached_property
    def ctx_shapes(self) -> Tuple[Shape, ...]:
        """Each gradient's ``Shape``, the ctx every method's payload carries."""
        return tuple(Shape(s.shape, self.dtype) for s in self.segments)


def plan(tensors: Sequence[Tuple[str, Tuple[int, ...], str, Any]], cap_bytes: float) -> List[Bucket]:
    """Buckets for ``(name, shape, dtype, group)`` tuples given in backward order.

    Gradients of one (dtype, group) fill a bucket until the next one would take it past
    ``cap_bytes``; a gradient larger than the cap gets a bucket of its own. ``group`` keeps
    apart what cannot share a buffer (the device). Empty tensors are in no bucket."""
    open_: dict = {}  # (dtype, group) -> (members, bytes)
    closed: List[List[tuple]] = []
    position = {}
    for name, shape, dtype, group in tensors:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"grace compresses floating-point gradients ({', '.join(FLOAT_DTYPES)}); "
                            f"{name!r} has dtype {dtype}")
        position[name] = len(position)
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if nbytes == 0:
            continue
        members, size = open_.get((dtype, group), ([], 0))
        if members and size + nbytes > cap_bytes:
            closed.append(members)
            members, size = [], 0
        members.append((name, tuple(shape), dtype, group))
        open_[(dtype, group)] = (members, size + nbytes)
    closed.extend(members for members, _ in open_.values())
    closed.sort(key=lambda members: position[members[0][0]])  # launch order
    step_bytes = sum(math.prod(shape) * ITEMSIZE[dtype] for members in closed for _, shape, dtype, _ in members)
    buckets = []
    for index, members in enumerate(closed):
        segments, offset = [], 0
        for name, shape, _, _ in members:
            segments.append(Segment(name, shape, offset, math.prod(shape)))
            offset += math.prod(shape)
        buckets.append(Bucket(bucket_key(index, [s.name for s in segments]), members[0][2], tuple(segments),
                              step_bytes))
    return buckets


def bucket_key(index: int, names: Sequence[str], prefix: str = "grace.bucket") -> str:
    """A bucket's name for its collectives: the same on every rank that plans the same buckets,
    another when the members change (its launch index and a checksum of their names)."""
    return f"{prefix}{index}.{zlib.crc32(chr(0).join(names).encode()):08x}"


# --- frames ------------------------------------------------------------------------------
def _order(dtypes: Sequence[str]) -> List[int]:
    return _order_of(tuple(dtypes))


@functools.lru_cache(maxsize=64)
def _order_of(dtypes: Tuple[str, ...]) -> List[int]:
    # a bucket's frames repeat every step: the order is sorted once per bucket
    return sorted(range(len(dtypes)), key=lambda i: -ITEMSIZE[dtypes[i]])  # stable


def frame(xp, pieces: Sequence, with_header: bool, like, flag=None, concat=None, dtypes=None, counts=None) -> Any:
    """One rank's frame for the payload tensors ``pieces`` (all units' payloads, in order),
    with the overflow ``flag`` (a one-element tensor) where given; ``concat`` joins its byte
    parts (default ``xp.concat``; the exchange's joins into a reused buffer); ``dtypes`` and
    ``counts``: the pieces', where the caller has them. Under a TensorFlow trace a variable
    length is a tensor: the frame is built with ops."""
    parts = []
    if with_header:
        counts = [xp.numel(t) for t in pieces] if counts is None else counts
        if all(isinstance(c, int) for c in counts):
            parts.append(header_bytes(xp, counts, like))
        else:  # lengths known only when a traced step runs
            parts.append(xp.to_bytes(_lengths(xp, [xp.flatten(t) for t in pieces])))
    order = _order([xp.dtype(t) for t in pieces] if dtypes is None else dtypes)
    parts.extend(xp.flat_bytes([pieces[i] for i in order]))
    return _padded(xp, parts, like, flag, concat)


def header_bytes(xp, counts: Sequence[int], like):
    """A variable-length frame's header: its pieces' counts (int64), as bytes (one host-to-device
    copy, not one per piece)."""
    return xp.to_bytes(xp.cast(xp.asarray(counts, like=like), "int64"))


def dense_header(xp, pieces: int, like):
    """The header of a dense variable-length frame: DENSE, then zeros (int64; made once per device)."""
    return constant(xp, ("dense header", pieces), lambda: xp.cast(
        xp.asarray([DENSE] + [0] * (pieces - 1), like=like), "int64"), like)


def dense_frame(xp, flat, pieces: int, like, flag=None, concat=None) -> Any:
    """A variable-length frame that carries the bucket's dense values instead of its encoding."""
    return _padded(xp, [xp.to_bytes(dense_header(xp, pieces, like)), xp.to_bytes(flat)], like, flag, concat)


def _padded(xp, parts, like, flag=None, concat=None):
    if flag is not None:
        parts = [*parts, xp.cast(flag, "uint8")]
    size = sum(xp.numel(p) for p in parts)
    pad = -size % ALIGN
    if not isinstance(pad, int) or pad:
        parts = [*parts, _zeros(xp, pad, like)]
    return (concat or xp.concat)(parts) if len(parts) > 1 else parts[0]


def _zeros(xp, pad, like):
    """``pad`` zero bytes, made once per device (no fill launched per frame)."""
    if not isinstance(pad, int):  # (a length known only when a traced step runs)
        return xp.zeros(pad, "uint8", like=like)
    return constant(xp, ("zero bytes", pad), lambda: xp.zeros(pad, "uint8", like=like), like)


def frame_size(counts: Sequence, dtypes: Sequence[str], with_header: bool, flagged: bool = False):
    size = (8 * len(counts) if with_header else 0) + sum(c * ITEMSIZE[d] for c, d in zip(counts, dtypes)) + flagged
    return size + (-size % ALIGN)


def dense_frame_size(numel: int, dtype: str, header_pieces: int, flagged: bool = False) -> int:
    """Bytes of a frame that carries ``numel`` dense values of ``dtype`` instead of an encoding:
    ``dense_frame``'s, whose header keeps a count per payload tensor (0 for fixed-length frames)."""
    return 8 * header_pieces + frame_size([numel], [dtype], False, flagged)


@dataclass
class Dense:
    """What a dense frame carried: the sending rank's whole bucket."""

    values: Any


def read_frame(xp, data, start, dtypes: Sequence[str], counts: Sequence, variable: bool,
               dense_numel: int, dense_dtype: str, flagged: bool = False):
    """The frame at byte ``start`` of ``data``: (its pieces in payload order, or ``Dense``;
    its overflow flag, a one-element uint8 tensor, or None where not ``flagged``; the byte
    where the next frame starts). ``counts`` are this rank's own element counts, which every
    rank shares unless the method is variable-length."""
    pos = start
    if variable:
        counts = xp.host_ints(xp.from_bytes(data[pos:pos + 8 * len(dtypes)], "int64"), len(dtypes))
        pos += 8 * len(dtypes)
        if isinstance(counts[0], int) and counts[0] == DENSE:  # (a traced step never sends dense)
            end = pos + dense_numel * ITEMSIZE[dense_dtype]
            flag = data[end:end + 1] if flagged else None
            return Dense(xp.from_bytes(data[pos:end], dense_dtype)), flag, \
                pos + frame_size([dense_numel], [dense_dtype], False, flagged)
    pieces: List[Any] = [None] * len(dtypes)
    for i in _order(dtypes):
        nbytes = counts[i] * ITEMSIZE[dtypes[i]]
        pieces[i] = xp.from_bytes(data[pos:pos + nbytes], dtypes[i])
        pos += nbytes
    flag = data[pos:pos + 1] if flagged else None
    return pieces, flag, start + frame_size(counts, dtypes, variable, flagged)


def layout(dtypes: Sequence[str], counts: Sequence[int], with_header: bool, flagged: bool = False):
    """Where a frame of pieces of ``counts`` elements puts them: (each piece's (byte offset,
    count, dtype), in payload order, a tuple; the flag's byte offset, or None; the frame's size).
    A bucket's frames repeat every step: laid out once per layout, the same tuple handed back
    (``FrameRows`` keeps what it derives from it by that tuple)."""
    dtypes, counts = tuple(dtypes), tuple(counts)
    try:
        return _layout_of(dtypes, counts, with_header, flagged)
    except TypeError:  # (a count that is not hashable: a traced program's symbolic size)
        return _layout(dtypes, counts, with_header, flagged)


def _layout(dtypes: Tuple[str, ...], counts: tuple, with_header: bool, flagged: bool):
    pieces: List[Any] = [None] * len(dtypes)
    pos = 8 * len(dtypes) if with_header else 0
    for i in _order_of(dtypes):
        pieces[i] = (pos, counts[i], dtypes[i])
        pos += counts[i] * ITEMSIZE[dtypes[i]]
    return tuple(pieces), pos if flagged else None, frame_size(counts, dtypes, with_header, flagged)


_layout_of = functools.lru_cache(maxsize=256)(_layout)


def split_payloads(pieces: Sequence, structure: Sequence[int]) -> List[Payload]:
    """Pieces back into per-unit payload tuples (``structure``: tensors per payload)."""
    payloads, i = [], 0
    for n in structure:
        payloads.append((pieces[i],) if n == 1 else tuple(pieces[i:i + n]))  # (one: no slice made)
        i += n
    return payloads
