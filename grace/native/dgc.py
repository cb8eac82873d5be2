"""Deep gradient compression: the momentum correction, a bucket's selection segment by segment, and
(CPU) a bucket's whole step in one call.

    dgc_compensate_into(u, v, g, momentum, u_out, v_out)
    dgc_cut_segments(p, starts, numels, sizes, needs, words)
    dgc_select(p, sample_size, need, k, words)
    dgc_select_segments(p, u, starts, numels, ks, cut, nonfinite=None)
    dgc_step_many(gs, us, vs, momentum, ratio, sample_ratio, words, u_outs, v_outs)
"""
from __future__ import annotations

import ctypes
import functools
import math

from grace.formats import index_dtype
from grace.native._arrays import NativeUnavailable, c_array, call, kind_of
from grace.native._common import (_check_segments, _cpu_kind, _flag, _float32_all, _head, _in_place, _int64s,
                                  _same_kind, _seed_word_arrays, _wrap)
from grace.native._flags import _flag_of
from grace.native._frames import _Rooms, frame_pairs


def dgc_compensate_into(u, v, g, momentum: float, u_out, v_out):
    """DGC's momentum correction in one pass (one launch on a GPU): p = v + (momentum * u + g)
    written into ``v_out`` and p - v into ``u_out`` (float32, all of one size; outputs may be
    inputs). Returns (u_out, v_out)."""
    kind = kind_of(u)
    ub, vb, gb = (_same_kind(kind, t) for t in (u, v, g))
    uo, vo = _in_place(kind, u_out, "float32"), _in_place(kind, v_out, "float32")
    if any(b.dtype != "float32" for b in (ub, vb, gb)):
        raise NativeUnavailable("dgc_compensate_into takes float32 tensors")
    if not ub.n == vb.n == gb.n == uo.n == vo.n:
        raise ValueError("u, v, g and the outputs must have one size")
    call(kind, "dgc_compensate", ub.ptr, vb.ptr, gb.ptr, ub.n, float(momentum), uo.ptr, vo.ptr)
    return u_out, v_out


def dgc_cut_segments(p, starts, numels, sizes, needs, words):
    """DGC's threshold of every segment of a bucket (float32 ``p``), as ``DGC.segment_cut`` finds
    it: the needs[s]-th largest |p| of a sample of sizes[s] elements, drawn at floor(u_j * d)
    from the seed words ``words[s]`` (grace.core.draws) where fewer than the segment's d, else
    all of them. A float32 array of one per segment; on a GPU a launch per 64 segments."""
    kind = kind_of(p)
    pb = _same_kind(kind, p)
    if pb.dtype != "float32":
        raise NativeUnavailable("dgc_cut_segments takes float32")
    cut = kind.empty(len(numels), "float32")
    s0, s1 = _seed_word_arrays(words)
    if call(kind, "dgc_cut_segments", pb.ptr, pb.n, len(numels), _int64s(starts), _int64s(numels), _int64s(sizes),
            _int64s(needs), s0, s1, cut.ptr) != 0:
        raise ValueError("each segment must lie in the bucket, with 1 <= need <= sample size <= its size")
    return _wrap(kind, cut)


def dgc_select(p, sample_size: int, need: int, k: int, words):
    """DGC.select of the 1-d float32 ``p`` in one call (CPU): the threshold, the ``need``-th
    largest |p| of ``sample_size`` elements drawn at floor(u_j * d) from the seed ``words``
    (grace.core.draws; every element where the sample is the whole tensor), the elements with |p|
    at or above it, ascending, cut to the ``k`` largest (ties to the lowest index) where more:
    their indices (int64)."""
    kind = _cpu_kind(p)
    pb = _same_kind(kind, p)
    if pb.dtype != "float32":
        raise NativeUnavailable("dgc_select takes float32")
    idx = kind.empty(min(k, pb.n), "int64")
    count = call(kind, "dgc_select", pb.ptr, pb.n, sample_size, need, k, *words, idx.ptr)
    if count < 0:
        raise ValueError("1 <= need <= sample size <= d and 1 <= k <= d, unless d is 0")
    return _wrap(kind, _head(kind, idx, count))


def dgc_select_segments(p, u, starts, numels, ks, cut, nonfinite=None, frame=None):
    """DGC's selection of every segment of a bucket from its compensated ``p`` (float32): each
    segment's ks[s] largest |p| (ties to the lowest index), p sent where |p| >= cut[s] (float32,
    one per segment, on p's device) and +0.0 under it: (values in a row, indices in their
    segment (int64) in a row); momentum factor masking where sent, in place: p = p - (0 +
    value) (the new v), u = u * 0 where 0 + value != 0 (the new u). The overflow flag into
    ``nonfinite`` where given (see ``_flag_of``): whether any p is an inf or a NaN. Where
    ``frame`` is given, the pairs are written there instead (``frame_pairs``): (None, None). On a
    GPU top-k's segment kernels."""
    kind = kind_of(p)
    pb, ub, cb = _in_place(kind, p, "float32"), _in_place(kind, u, "float32"), _same_kind(kind, cut)
    if ub.n != pb.n or cb.dtype != "float32" or cb.n != len(numels):
        raise ValueError("u of p's size, and a float32 cut per segment")
    _check_segments(pb.n, starts, numels)
    if any(not 0 <= k <= n for k, n in zip(ks, numels)):
        raise ValueError("each segment's k must lie in [0, its size]")
    values, idx = (None, None) if frame else (kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64"))
    if call(kind, "dgc_select_segments", pb.ptr, ub.ptr, len(numels), _int64s(starts), _int64s(numels), _int64s(ks),
            cb.ptr, values and values.ptr, idx and idx.ptr, *_flag_of(kind, nonfinite),
            *frame_pairs(kind, frame, sum(ks))) != 0:
        raise RuntimeError("native DGC selection failed")
    return (None, None) if frame else _wrap(kind, values, idx)


def dgc_step_many(gs, us, vs, momentum: float, ratio: float, sample_ratio: float, words, u_outs, v_outs,
                  nonfinite=None, scales=None, into=None):
    """DGC's step for every gradient of a bucket in one call (CPU), as DGCFeedback.fused_step with
    DGC's selection makes it gradient by gradient: the momentum correction (p = v + (momentum * u
    + g) into ``v_outs``, p - v into ``u_outs``; outputs may be inputs), the threshold from a
    sample of |p| drawn from the gradient's seed words ``words[s]`` (grace.core.draws), the
    elements at or above it (the k = max(1, ceil(ratio d)) largest where more) and momentum factor
    masking. Lists of values and indices (in index_dtype(d)), per gradient; the overflow flag
    into ``nonfinite`` (see ``_flag``); copied where ``into`` lays them out instead (see
    ``_Rooms.payloads``). ``scales`` (floats, optional): each g taken as g * scales[s] where it is
    read (DGC's clipping: one float32 product, as the tensor op makes it)."""
    kind = _cpu_kind(gs[0])
    # (buffers, sizes and pointers: made once for the states and outputs, an exchange's kept lists)
    checked = [_float32_all(kind, ts, "dgc_step_many", in_place=out)
               for ts, out in ((gs, False), (us, False), (vs, False), (u_outs, True), (v_outs, True))]
    numels = checked[0][1]
    if any(sizes != numels for _, sizes, _ in checked):  # (tuples: a bucket's compared at once)
        raise ValueError("every gradient, state and output of a bucket must have one size")
    if not (0 < ratio <= 1 and 0 < sample_ratio <= 1):
        raise ValueError(f"ratio and sample_ratio must be in (0, 1], got {ratio!r}, {sample_ratio!r}")
    # (new rooms where the payloads are views of them)
    rooms = _Rooms(kind, *_rooms_of(numels, ratio)) if into is None else \
        _Rooms.kept_with(u_outs, kind, *_rooms_of(numels, ratio))
    s0, s1 = _seed_word_arrays(words)
    if call(kind, "dgc_step_many", len(numels), *[pointers for _, _, pointers in checked], _int64s(numels),
            float(momentum), float(ratio), float(sample_ratio), s0, s1, *rooms.arguments(),
            None if scales is None else c_array(ctypes.c_float, len(numels))(*scales), _flag(kind, nonfinite)) != 0:
        raise RuntimeError("native DGC steps failed")
    return rooms.payloads(kind, into)


@functools.lru_cache(maxsize=256)
def _rooms_of(numels: tuple, ratio: float):
    """A bucket's rooms for DGC's pairs (k = max(1, ceil(ratio d)) each, at most d) and their
    index dtypes: the same every step after the warm-up."""
    return tuple(min(d, max(1, math.ceil(ratio * d))) for d in numels), tuple(index_dtype(d) for d in numels)
