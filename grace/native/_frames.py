"""A selection's (value, index) pairs written straight into a fixed layout's frame (the bucket's
own ``SegmentedFrame``), in place of its fields: where the pairs lie (``pair_slots``), and the CPU
selections' pairs put there as the GPU's write kernels put them."""
from __future__ import annotations

from grace.native._arrays import call
from grace.native._common import _in_place, _same_kind

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
