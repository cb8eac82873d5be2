"""A bucket's aggregate over the ranks in one call: every rank's fields of every segment decoded,
added rank after rank and finished as the compressor says (``Compressor.finish``: (vote, divisors),
its sign where vote, then divided by each divisor in turn); NaN everywhere where the ranks'
overflow count is positive.

    terngrad_mean_segments(packed, scale, numels, ranks, finish, overflow)
    efsignsgd_mean_segments(packed, scale, ...), onebit_mean_segments(packed, means, ...)
    signsgd_mean_segments(packed, numels, ranks, finish, overflow)
    natural_mean_segments(signs, codes, ...), qsgd_mean_segments(packed, norms, ..., levels, bucket_size=0)

The fields hold the ranks' payloads rank after rank, each as ``*_decompress_segments`` takes one
rank's (a received frame's fields, flat); ``overflow``: a one-element int64 tensor (the count left
on the device) or None. On a GPU one launch per 64 segments (grace_cuda_mean_segments: the
decoders' code, every rank's value added in a register, divided as torch divides by a number
there: times its float reciprocal). On a CPU the decoded sums' kernels with each rank's pointers,
divided as torch divides there.
"""
from __future__ import annotations

import ctypes
import functools
import itertools

from grace.formats import code_width, packed_size
from grace.native._arrays import NativeUnavailable, call, kind_of
from grace.native._common import (_DECODE, _addresses, _check_payload, _decode_out, _finish_args, _int64s, _on_gpu,
                                  _same_kind, _wrap)
from grace.native._frames import PAIR_COLUMNS
from grace.native.qsgd import _qsgd_rows
from grace.native.signs import _EFSIGNSGD, _ONEBIT, _SIGNSGD, _TERNGRAD


@functools.lru_cache(maxsize=256)
def _starts(sizes: tuple) -> tuple:
    return tuple(itertools.accumulate(sizes, initial=0))


def _mean_segments(decoder: str, a, b, numels, ranks: int, finish, overflow, code_bits: int, scalars: tuple,
                   cpu_sum, **qsgd):
    """The aggregate of every segment (``numels``) over ``ranks``: ``a`` the codes (``code_bits``
    each, every segment from a byte), ``b`` its ``scalars[s]`` float32 scalars (natural
    compression: bytes, its codes; signSGD: None); ``cpu_sum(a_rows, b_rows, outs, finish)`` the
    CPU's call."""
    kind, numels = kind_of(a), tuple(numels)
    fa = kind.flat(a)
    fb = None if b is None else _same_kind(kind, b, "uint8" if decoder == "natural_decode" else "float32")
    sizes = tuple(packed_size(n, code_bits) for n in numels)
    a_starts, b_starts = _starts(sizes), _starts(scalars)
    _check_payload(fa, ranks * a_starts[-1], f"bytes of {ranks} ranks' codes")
    if fb is not None:
        _check_payload(fb, ranks * b_starts[-1], f"scalars of {ranks} ranks")
    count = None if overflow is None else _same_kind(kind, overflow, "int64")
    out = _decode_out(kind, sum(numels))
    vote, divisors = finish
    if _on_gpu(kind):
        call(kind, "mean_segments", _DECODE[decoder], len(numels), _int64s(numels), int(ranks), fa.ptr,
             fb.ptr if fb is not None else None, int(qsgd.get("levels", 0)), int(qsgd.get("bucket_size", 0)),
             int(qsgd.get("bits", 0)), *_finish_args((vote, tuple(divisors))), count.ptr if count is not None else None,
             out.ptr)
        return _wrap(kind, out)
    if count is not None and ctypes.c_int64.from_address(count.ptr).value > 0:
        divisors = (*divisors, float("nan"))  # (any value over NaN: NaN, as poisoned makes it)
    item, rows = 1 if decoder == "natural_decode" else 4, range(ranks)  # (segment s's rank r at [s * ranks + r])
    a_rows = _addresses(fa, [r * a_starts[-1] + at for at in a_starts[:-1] for r in rows])
    b_rows = None if fb is None else \
        _addresses(fb, [item * (r * b_starts[-1] + at) for at in b_starts[:-1] for r in rows])
    outs = _addresses(out, [4 * at for at in _starts(numels)[:-1]])
    cpu_sum(kind, a_rows, b_rows, outs, _finish_args((vote, tuple(divisors))))
    return _wrap(kind, out)


def _bits_mean(mode: int, decoder: str, per_segment: int):
    def mean_segments(packed, scalars, numels, ranks, finish, overflow):
        def cpu_sum(kind, a_rows, b_rows, outs, finish):
            call(kind, "bits_sum_segments", len(numels), int(ranks), a_rows, b_rows, mode, _int64s(tuple(numels)),
                 *finish, outs)
        return _mean_segments(decoder, packed, scalars, numels, ranks, finish, overflow,
                              2 if mode == _TERNGRAD else 1, (per_segment,) * len(numels), cpu_sum)
    return mean_segments


terngrad_mean_segments = _bits_mean(_TERNGRAD, "terngrad_decode", 1)
efsignsgd_mean_segments = _bits_mean(_EFSIGNSGD, "sign_decode", 1)
onebit_mean_segments = _bits_mean(_ONEBIT, "onebit_decode", 2)


def signsgd_mean_segments(packed, numels, ranks, finish, overflow):
    return _bits_mean(_SIGNSGD, "sign_decode", 0)(packed, None, numels, ranks, finish, overflow)


def natural_mean_segments(signs, codes, numels, ranks, finish, overflow):
    def cpu_sum(kind, a_rows, b_rows, outs, finish):
        call(kind, "natural_sum_segments", len(numels), int(ranks), a_rows, b_rows, _int64s(tuple(numels)), *finish,
             outs)
    return _mean_segments("natural_decode", signs, codes, numels, ranks, finish, overflow, 1, tuple(numels),
                          cpu_sum)


def qsgd_mean_segments(packed, norms, numels, ranks, finish, overflow, levels: int, bucket_size: int = 0):
    bits = code_width(2 * (levels + 1))

    def cpu_sum(kind, a_rows, b_rows, outs, finish):
        if call(kind, "qsgd_sum_segments", len(numels), int(ranks), a_rows, b_rows, _int64s(tuple(numels)),
                int(levels), int(bucket_size), bits, *finish, outs) != 0:
            raise ValueError(f"bad QSGD parameters: levels={levels}")
    return _mean_segments("qsgd_decode", packed, norms, numels, ranks, finish, overflow, bits,
                          tuple(_qsgd_rows(n, bucket_size) for n in numels), cpu_sum, levels=levels,
                          bucket_size=bucket_size, bits=bits)


# --- sparse pairs: the ranks' (value, index) pairs added rank after rank --------------------------

def sparse_frames_mean(frames, ranks: int, frame_size: int, slots, flag_at: int, divisor: float, numel: int):
    """The mean of ``ranks`` frames of a bucket whose segments send k (value, index) pairs each
    (uint8, end to end, ``frame_size`` bytes each), read where they lie: a float32 array of
    ``numel`` zeros, NaN everywhere where a rank's flag byte (at ``flag_at``; -1: none) is set;
    else each rank's pairs added in turn, value / divisor at index; and how many ranks flagged
    an overflow (one float32). ``slots``: int64 (4, k), each pair's value byte, index byte,
    index width and segment start (``SegmentedFrame.pair_slots``). One cooperative launch on a
    GPU (a fill and a launch per rank where the device refuses one)."""
    kind = kind_of(frames)
    fb, sb = kind.flat(frames), _same_kind(kind, slots)
    if fb.dtype != "uint8" or fb.n != ranks * frame_size:
        raise ValueError(f"{fb.n} {fb.dtype} bytes are not {ranks} frames of {frame_size} bytes")
    if sb.dtype != "int64" or sb.n % 4:
        raise ValueError("slots are int64, four rows")
    out, flagged = kind.empty(int(numel), "float32"), kind.empty(1, "float32")
    if call(kind, "sparse_frames_mean", fb.ptr, int(ranks), int(frame_size), sb.ptr, sb.n // 4, int(flag_at),
            float(divisor), int(numel), out.ptr, flagged.ptr) != 0:
        raise IndexError(f"an index of a rank's frame is out of range for {numel} elements")
    return _wrap(kind, out), _wrap(kind, flagged)


def sparse_variable_mean(frames, table, ranks: int, divisor: float, numel: int):
    """The mean of ``ranks`` frames of a bucket whose segments send a number of (value, index)
    pairs that varies by rank (uint8, end to end in ``frames``), read where they lie: a float32
    array of ``numel`` zeros, then each rank's pairs added in turn, value / divisor at index.
    ``table``: int64, a row of PAIR_COLUMNS per (rank, segment), ranks first: the byte of the
    segment's first float32 value, of its first index, its first pair among the rank's pairs,
    its count, the segment's start and its index width (``SparseFrames.pair_table``). One
    cooperative launch on a GPU (a fill and a launch per rank where the device refuses one)."""
    kind = kind_of(frames)
    fb, tb = kind.flat(frames), _same_kind(kind, table)
    if fb.dtype != "uint8":
        raise ValueError(f"frames are bytes, not {fb.dtype}")
    if tb.dtype != "int64" or ranks < 1 or tb.n % (PAIR_COLUMNS * ranks):
        raise ValueError(f"the table is int64, {PAIR_COLUMNS} columns per rank and segment")
    out = kind.empty(int(numel), "float32")
    if call(kind, "sparse_variable_mean", fb.ptr, fb.n, tb.ptr, tb.n // (PAIR_COLUMNS * ranks), int(ranks),
            float(divisor), int(numel), out.ptr) != 0:
        raise IndexError(f"a rank's pieces or indices are out of range for its frame or {numel} elements")
    return _wrap(kind, out)


def sparse_sum_mean(values, idx, divisor: float, flag, numel: int):
    """The mean of an allreduced sparse sum (random-k's): a float32 array of ``numel`` zeros,
    NaN everywhere where ``flag`` (the ranks' summed overflow flags, one float32 on the same
    device; None: none) is above 0; else each of the summed float32 ``values`` / divisor added
    at its int64 index of ``idx`` (distinct): 0 + v / n, the decompressed sum divided to the
    bit. One fill and one launch on a GPU."""
    kind = kind_of(values)
    vb, ib = kind.flat(values), _same_kind(kind, idx)
    fb = _same_kind(kind, flag) if flag is not None else None
    if vb.dtype != "float32" or ib.dtype != "int64" or vb.n != ib.n:
        raise NativeUnavailable("sparse_sum_mean takes float32 values and as many int64 indices")
    if fb is not None and (fb.dtype != "float32" or fb.n != 1):
        raise NativeUnavailable("sparse_sum_mean takes one float32 flag")
    out = kind.empty(int(numel), "float32")
    if call(kind, "sparse_sum_mean", vb.ptr, ib.ptr, vb.n, float(divisor), fb.ptr if fb is not None else None,
            int(numel), out.ptr) != 0:
        raise IndexError(f"an index of the sum is out of range for {numel} elements")
    return _wrap(kind, out)
