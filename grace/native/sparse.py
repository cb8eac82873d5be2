"""Sparsification: selection, scatter-add, and their segment-wise, error-feedback and bucket forms.

    topk_indices(x, k, ...), threshold_indices(x, thr, ...), nonzero(mask, ...)
    topk_compress(x, k), threshold_compress(x, thr) -> (values, indices)
    scatter_add(indices, values, numel), scatter_add_many(payloads, numel)
    topk_ef_step(g, r, k, ...), threshold_ef_step(g, r, thr, ...) -> (values, indices, residual)
    segment by segment: topk_compress_segments(x, starts, numels, ks),
    topk_ef_step_segments(g, residual, starts, numels, ks, beta, gamma, out)
    a bucket in one call on the CPU (lists in, lists out): topk_ef_step_many(gs, residuals, ks, beta, gamma,
    outs), threshold_ef_step_many(gs, residuals, thresholds, beta, gamma, outs),
    randomk_ef_step_many(gs, residuals, indices, ...), scatter_add_segments_into(payloads, outs, divisor)
"""
from __future__ import annotations

import ctypes
import functools
import itertools

from grace.formats import index_dtype
from grace.native._arrays import DTYPE_CODES, INDEX_CODES, Buf, NativeUnavailable, c_array, call, kind_of
from grace.native._common import (_addresses, _check_segments, _cpu_kind, _ef_flags, _ef_inputs, _ef_many_inputs,
                                  _every, _flag, _float32, _float32_all, _head, _in_place, _index_buf, _index_codes,
                                  _int64s, _int64s_of, _on_gpu, _outputs, _placed, _pointers, _same_kind,
                                  _same_kind_all, _seed_word_arrays, _wrap)
from grace.native._rows import _field
from grace.native._flags import _flag_of, _HostFlag
from grace.native._frames import PAIR_COLUMNS, _no_frame, _Rooms, frame_pairs, pairs_into_frame


# --- selection ------------------------------------------------------------------------------------
def _select_values_type(kind, b: Buf) -> int:
    code = DTYPE_CODES.get(b.dtype)
    if code is None or (code != 0 and kind.lib.kind == "cuda"):
        raise NativeUnavailable(f"no native selection for {b.dtype} on {kind.lib.kind}")
    return code


def _topk(x, k: int, by_abs: bool, index_dtype: str, with_values: bool):
    kind = kind_of(x)
    b = kind.flat(x)
    vt = _select_values_type(kind, b)
    k = max(0, min(int(k), b.n))
    idx = kind.empty(k, index_dtype)
    values = kind.empty(k, b.dtype) if with_values else None
    got = call(kind, "topk", b.ptr, vt, b.n, k, int(by_abs), idx.ptr, INDEX_CODES[index_dtype],
               values.ptr if values is not None else None)
    if got != k:
        raise RuntimeError(f"native top-k returned {got} of {k}")
    return kind, idx, values


def topk_indices(x, k: int, by_abs: bool = False, index_dtype: str = "int64"):
    """Indices of the k largest elements of x (largest |x| when by_abs), ascending; ties go to
    the lowest index. Linear time (radix select + compaction), not a sort. k >= numel: all."""
    kind, idx, _ = _topk(x, k, by_abs, index_dtype, False)
    return _wrap(kind, idx)


def topk_compress(x, k: int):
    """TopK's payload: (values x[idx], idx in index_dtype(numel)) for the k largest |x|,
    idx ascending."""
    n = kind_of(x).flat(x).n
    kind, idx, values = _topk(x, k, True, index_dtype(n), True)
    return _wrap(kind, values, idx)


def _threshold(x, threshold: float, by_abs: bool, index_dtype: str, with_values: bool):
    kind = kind_of(x)
    b = kind.flat(x)
    vt = _select_values_type(kind, b)
    idx = kind.empty(b.n, index_dtype)
    values = kind.empty(b.n, b.dtype) if with_values else None
    count = call(kind, "threshold", b.ptr, vt, b.n, float(threshold), int(by_abs), idx.ptr,
                 INDEX_CODES[index_dtype], values.ptr if values is not None else None)
    if count < 0:
        raise RuntimeError("native threshold selection failed")
    return kind, count, idx, values


def threshold_indices(x, threshold: float, by_abs: bool = True, index_dtype: str = "int64"):
    """Indices (ascending) of the elements with |x| >= threshold (x >= threshold unless by_abs),
    compared in x's dtype; one pass, the count included."""
    kind, count, idx, _ = _threshold(x, threshold, by_abs, index_dtype, False)
    return _wrap(kind, _head(kind, idx, count))


def threshold_compress(x, threshold: float):
    """Threshold's payload: (values, idx in index_dtype(numel)) of |x| >= threshold."""
    n = kind_of(x).flat(x).n
    kind, count, idx, values = _threshold(x, threshold, True, index_dtype(n), True)
    return _wrap(kind, _head(kind, values, count), _head(kind, idx, count))


def nonzero(mask, index_dtype: str = "int64"):
    """Indices (ascending) of the non-zero elements of a bool (or uint8) mask."""
    kind = kind_of(mask)
    m = kind.flat(mask)
    if m.dtype not in ("bool", "uint8"):
        raise NativeUnavailable(f"nonzero takes bool or uint8 masks, got {m.dtype}")
    idx = kind.empty(m.n, index_dtype)
    count = call(kind, "nonzero", m.ptr, m.n, idx.ptr, INDEX_CODES[index_dtype])
    if count < 0:
        raise RuntimeError("native nonzero failed")
    return _wrap(kind, _head(kind, idx, count))


# --- scatter-add ----------------------------------------------------------------------------------
def threshold_select_segments(g, residual, starts, threshold: float, beta: float = 1.0, gamma: float = 1.0,
                              out=None, nonfinite=None):
    """Threshold's selection of a bucket's segments in a row (``starts``: each one's first
    element, int64 on g's device) before its frame is made: (p = gamma * g + beta * residual,
    into ``out`` where given; the mask |p| >= threshold (uint8); each segment's count (int64);
    the header, each count twice (int64), with the overflow flag as bit 62 of the last where
    ``nonfinite`` is given, which receives it too (see ``_flag_of``)). A memset and one launch
    on a GPU."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    sb = _same_kind(kind, starts)
    if sb.dtype != "int64" or sb.n < 1:
        raise ValueError("starts are int64, one per segment (at least one)")
    take, counts, header = kind.empty(gb.n, "uint8"), kind.empty(sb.n, "int64"), kind.empty(2 * sb.n, "int64")
    if call(kind, "threshold_select_segments", gb.ptr, rb.ptr, gb.n, sb.ptr, sb.n, float(threshold), float(beta),
            float(gamma), _ef_flags(beta, gamma), ob.ptr, take.ptr, counts.ptr, header.ptr,
            *_flag_of(kind, nonfinite)) != 0:
        raise ValueError(f"segments starting at {sb.n} places are not a bucket of {gb.n} elements in a row")
    return _wrap(kind, ob, take, counts, header)


def threshold_write_segments(p, take, table, frame_size: int, tail: int, flag=None):
    """Threshold's frame from its selection (``threshold_select_segments``' p and mask): a new
    uint8 array of ``frame_size`` bytes, each segment's taken values and indices within the
    segment where its row of ``table`` lays them (int64, a row of PAIR_COLUMNS per segment, as
    ``SparseFrames.pair_table`` makes one rank's), then at byte ``tail`` the flag byte
    (``flag``: one uint8 on p's device, or None) and zeros. ``p`` becomes the new residual in
    place: p - (0 + p) where taken. Four launches on a GPU."""
    kind = kind_of(p)
    pb, mb, tb = _in_place(kind, p, "float32"), _same_kind(kind, take), _same_kind(kind, table)
    fb = _same_kind(kind, flag) if flag is not None else None
    if mb.dtype != "uint8" or mb.n != pb.n or tb.dtype != "int64" or tb.n < PAIR_COLUMNS or tb.n % PAIR_COLUMNS:
        raise ValueError(f"a uint8 mask of p's size, and an int64 table of {PAIR_COLUMNS} columns")
    if fb is not None and (fb.dtype != "uint8" or fb.n != 1):
        raise NativeUnavailable("the frame's flag is one byte")
    frame = kind.empty(int(frame_size), "uint8")
    if call(kind, "threshold_write_segments", pb.ptr, mb.ptr, pb.n, tb.ptr, tb.n // PAIR_COLUMNS, frame.ptr,
            int(frame_size), int(tail), fb.ptr if fb is not None else None) != 0:
        raise ValueError("the table's pairs do not fit the mask or the frame")
    return _wrap(kind, frame)


def scatter_add_many(payloads, numel: int):
    """sum over payloads (values, indices) of scatter(indices, values) into ``numel`` zeros,
    added in order (as scatter_add of the concatenation): Sparsifier.aggregate without the
    concatenation. Values float32 or float64 (all the same); indices any integer type."""
    payloads = list(payloads)
    if not payloads:
        raise ValueError("scatter_add_many needs at least one payload")
    kind = kind_of(payloads[0][0])
    vals = [_same_kind(kind, v) for v, _ in payloads]
    idxs = [_index_buf(kind, i) for _, i in payloads]
    dtype = vals[0].dtype
    if dtype not in DTYPE_CODES or any(v.dtype != dtype for v in vals):
        raise NativeUnavailable(f"scatter_add takes float32 or float64 values of one dtype, got {dtype}")
    for v, i in zip(vals, idxs):
        if v.n != i.n:
            raise ValueError(f"{v.n} values for {i.n} indices")
    count = len(payloads)
    out = kind.empty(int(numel), dtype)
    rc = call(kind, "scatter_add", count, _pointers(idxs), _index_codes([i.dtype for i in idxs]), _pointers(vals),
              _int64s([v.n for v in vals]), DTYPE_CODES[dtype], int(numel), out.ptr)
    if rc != 0:
        raise IndexError(f"an index is out of range for {numel} elements")
    return _wrap(kind, out)


def scatter_add(indices, values, numel: int):
    """A dense 1-d array of ``numel`` zeros with ``values`` added at ``indices`` (in order)."""
    return scatter_add_many([(values, indices)], numel)


def scatter_add_segments_into(payloads, outs, divisor: float = 1.0):
    """Every gradient's sparse aggregate in one call (CPU): ``outs[s]`` = zeros, then each
    rank's (values, indices) in ``payloads[s]`` divided by ``divisor`` and added, rank after
    rank (as scatter_add_many of the divided values). Returns ``outs``."""
    kind = _cpu_kind(outs[0])
    ob, numels, out_pointers = _float32_all(kind, outs, "scatter_add_segments_into", in_place=True)
    vals, idxs = _field(kind, payloads, 0), _field(kind, payloads, 1)
    if any(d != "float32" for d in vals.dtypes) or any(d not in INDEX_CODES for d in idxs.dtypes):
        raise NativeUnavailable("scatter_add_segments_into takes float32 values and integer indices")
    if not vals.same_counts(idxs) or vals.pieces() != len(ob) * vals.ranks:
        raise ValueError("as many values as indices, per payload, and every rank's payload of each gradient")
    rc = call(kind, "scatter_add_segments", len(ob), vals.ranks, idxs.pointers, idxs.index_codes(), vals.pointers,
              vals.lengths(), float(divisor), _int64s(numels), out_pointers)
    if rc != 0:
        raise IndexError("an index is out of range for its gradient")
    return outs


# --- top-k, segment by segment --------------------------------------------------------------------
def topk_compress_segments(x, starts, numels, ks):
    """topk_compress of each segment (k = ks[s]) of the flat float32 ``x``: (every segment's
    values in a row, its indices in the segment (int64) in a row)."""
    kind = kind_of(x)
    b = _float32(kind, x, ("float32",))
    _check_segments(b.n, starts, numels)
    values, idx = kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64")
    if _on_gpu(kind):  # the bucket's kernels (topk_ef_step_segments' with no residual: flag 4)
        if any(not 0 <= k <= n for k, n in zip(ks, numels)):
            raise ValueError("each segment's k must lie in [0, its size]")
        scratch = kind.empty(b.n, "float32")
        call(kind, "topk_ef_segments", b.ptr, 0, len(numels), _int64s(starts), _int64s(numels), _int64s(ks), 1.0,
             1.0, 4, values.ptr, idx.ptr, scratch.ptr, None, 0, *_no_frame())
        return _wrap(kind, values, idx)
    at = 0
    for start, n, k in zip(starts, numels, ks):
        got = call(kind, "topk", b.ptr + 4 * start, 0, n, k, 1, idx.ptr + 8 * at, INDEX_CODES["int64"],
                   values.ptr + 4 * at)
        if got != k:
            raise RuntimeError(f"native top-k returned {got} of {k}")
        at += k
    return _wrap(kind, values, idx)


def topk_ef_step_segments(g, residual, starts, numels, ks, beta: float = 1.0, gamma: float = 1.0, out=None,
                          nonfinite=None, frame=None):
    """topk_ef_step of each segment: (values in a row, indices in the segment (int64) in a row,
    the new residual of the whole buffer); the overflow flag into ``nonfinite`` where given (see
    ``_flag_of``), from the pass that compensates. Where ``frame`` is given, the pairs are
    written there instead (``frame_pairs``): (None, None, the new residual)."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    _check_segments(gb.n, starts, numels)
    if any(not 0 <= k <= n for k, n in zip(ks, numels)):
        raise ValueError("each segment's k must lie in [0, its size]")
    if _on_gpu(kind):  # (the pairs into values and idx, or into the frame)
        values, idx = (None, None) if frame else (kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64"))
        call(kind, "topk_ef_segments", gb.ptr, rb.ptr, len(numels), _int64s(starts), _int64s(numels), _int64s(ks),
             float(beta), float(gamma), _ef_flags(beta, gamma), values and values.ptr, idx and idx.ptr, ob.ptr,
             *_flag_of(kind, nonfinite), *frame_pairs(kind, frame, sum(ks)))
        return (None, None, _wrap(kind, ob)) if frame else _wrap(kind, values, idx, ob)
    values, idx = kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64")
    at = [0, *itertools.accumulate(ks[:-1])]  # (a CPU: the bucket step, each segment at its own pointers)
    flag = _HostFlag(kind, nonfinite)
    if call(kind, "topk_ef_many", len(numels), *(_addresses(b, [4 * s for s in starts]) for b in (gb, rb, ob)),
            _int64s(numels), _int64s(ks), float(beta), float(gamma), _ef_flags(beta, gamma),
            _addresses(values, [4 * a for a in at]), _addresses(idx, [8 * a for a in at]),
            _index_codes(["int64"] * len(ks)), flag.arg) != 0:
        raise RuntimeError("native top-k steps failed")
    flag.put()
    if frame:
        pairs_into_frame(kind, values, idx, frame)
        return None, None, _wrap(kind, ob)
    return _wrap(kind, values, idx, ob)


def randomk_ef_step_segments(g, residual, starts, numels, ks, words, scales=None, beta: float = 1.0,
                             gamma: float = 1.0, out=None, nonfinite=None):
    """Random-k's residual step of every segment of a flat bucket, its indices drawn as on a GPU
    (the ks[s] smallest hashes of draws 0 .. numels[s] - 1 of the seed words ``words[s]``, ties
    to the lowest index, ascending; grace.core.draws): (values p[i] times ``scales[s]`` where
    given, in a row; their indices in the bucket (int64); the new residual, p with p - (0 +
    value) at them); the overflow flag into ``nonfinite`` as topk_ef_step_segments. On a GPU
    the top-k segment kernels rank the draws by their hashes."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    _check_segments(gb.n, starts, numels)
    values, idx = kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64")
    s0, s1 = _seed_word_arrays(words)
    scale = None if scales is None else c_array(ctypes.c_float, len(ks))(*scales)
    if call(kind, "randomk_ef_segments", gb.ptr, rb.ptr, len(numels), _int64s(starts), _int64s(numels), _int64s(ks),
            s0, s1, scale, float(beta), float(gamma), _ef_flags(beta, gamma), values.ptr, idx.ptr, ob.ptr,
            *_flag_of(kind, nonfinite)) != 0:
        raise ValueError("each segment's k must lie in [0, its size]")
    return _wrap(kind, values, idx, ob)


# --- fused error feedback -------------------------------------------------------------------------
def topk_ef_step(g, residual, k: int, beta: float = 1.0, gamma: float = 1.0, out=None):
    """Residual memory + TopK in one kernel: p = g*gamma + residual*beta (each factor applied
    only when != 1, as ResidualMemory), the k largest |p| (ties to the lowest index);
    returns (values p[idx], idx ascending in index_dtype(numel), new residual = p with the sent
    elements zeroed, i.e. p - decompress(compress(p))), all flat. ``out``: where to write the
    new residual (may be ``residual`` itself)."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    n = gb.n
    k = max(0, min(int(k), n))
    dtype = index_dtype(n)
    values, idx = kind.empty(k, "float32"), kind.empty(k, dtype)
    got = call(kind, "topk_ef", gb.ptr, rb.ptr, n, k, float(beta), float(gamma), _ef_flags(beta, gamma),
               values.ptr, idx.ptr, INDEX_CODES[dtype], ob.ptr)
    if got != k:
        raise RuntimeError(f"native top-k step returned {got} of {k}")
    return _wrap(kind, values, idx, ob)


def threshold_ef_step(g, residual, threshold: float, beta: float = 1.0, gamma: float = 1.0, out=None):
    """Residual memory + Threshold in one pass: p as in topk_ef_step, the elements with
    |p| >= threshold; returns (values, idx ascending in index_dtype(numel), new residual)."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    n = gb.n
    dtype = index_dtype(n)
    values, idx = kind.empty(n, "float32"), kind.empty(n, dtype)
    count = call(kind, "threshold_ef", gb.ptr, rb.ptr, n, float(threshold), float(beta), float(gamma),
                 _ef_flags(beta, gamma), values.ptr, idx.ptr, INDEX_CODES[dtype], ob.ptr)
    if count < 0:
        raise RuntimeError("native threshold step failed")
    return _wrap(kind, _head(kind, values, count), _head(kind, idx, count), ob)


# --- a bucket in one call on the CPU: each gradient at its own pointers ---------------------------
def topk_ef_step_many(gs, residuals, ks, beta: float = 1.0, gamma: float = 1.0, outs=None, nonfinite=None,
                      into=None):
    """topk_ef_step of every gradient of a bucket, in one call (CPU): lists of values, indices
    and new residuals, per gradient (the new residuals written into ``outs`` where given; the
    overflow flag into ``nonfinite``, see ``_flag``; the values and indices where ``into``
    places them, see ``_placed``)."""
    kind, gb, rb, ob, numels, pointers = _ef_many_inputs(gs, residuals, outs)
    numels, ks, codes, pieces, counts = _topk_layout(numels, tuple(ks))
    addresses, views = _placed(kind, into, pieces, counts)
    value_ptrs, idx_ptrs = _every(addresses, 0, 2), _every(addresses, 1, 2)
    value_views, idx_views = views[::2], views[1::2]
    rc = call(kind, "topk_ef_many", len(gb), *pointers, numels, ks, float(beta),
              float(gamma), _ef_flags(beta, gamma), value_ptrs, idx_ptrs, codes, _flag(kind, nonfinite))
    if rc != 0:
        raise RuntimeError("native top-k steps failed")
    return value_views, idx_views, _outputs(ob, outs)


@functools.lru_cache(maxsize=256)
def _topk_layout(numels: tuple, ks: tuple):
    """What ``topk_ef_step_many`` derives from a bucket's sizes and k's, the same every step: (the
    sizes and the k's, within them, as C arrays; the index types' codes, a C array; the payload
    pieces' dtypes and counts, value and index of each gradient in turn)."""
    ks = tuple(max(0, min(int(k), n)) for k, n in zip(ks, numels))
    dtypes = tuple(index_dtype(n) for n in numels)
    return (_int64s_of(numels), _int64s_of(ks), _index_codes(dtypes), tuple(t for d in dtypes for t in ("float32", d)),
            tuple(k for k in ks for _ in "vi"))


def threshold_ef_step_many(gs, residuals, thresholds, beta: float = 1.0, gamma: float = 1.0, outs=None,
                           nonfinite=None, into=None):
    """threshold_ef_step of every gradient of a bucket, in one call (CPU; one threshold for
    all): lists of values, indices and new residuals, per gradient (the new residuals written
    into ``outs`` where given; the overflow flag into ``nonfinite``, see ``_flag``; the values
    and indices copied where ``into`` lays them out, see ``_Rooms.payloads``). The values and
    indices are views of buffers with room for every element, of which only the pages written
    are touched (the frame copies them at once)."""
    if len(set(map(float, thresholds))) > 1:
        raise ValueError("one threshold for every gradient of a bucket")
    kind, gb, rb, ob, numels, pointers = _ef_many_inputs(gs, residuals, outs)
    rooms = _Rooms(kind, numels, [index_dtype(n) for n in numels])
    rc = call(kind, "threshold_ef_many", len(gb), *pointers, _int64s(numels),
              float(thresholds[0]), float(beta), float(gamma), _ef_flags(beta, gamma), *rooms.arguments(),
              _flag(kind, nonfinite))
    if rc != 0:
        raise RuntimeError("native threshold steps failed")
    return (*rooms.payloads(kind, into), _outputs(ob, outs))


def randomk_ef_step_many(gs, residuals, indices, beta: float = 1.0, gamma: float = 1.0, scales=None, outs=None,
                         nonfinite=None):
    """Random-k's residual step for every gradient of a bucket in one call (CPU): p = g*gamma +
    residual*beta (each factor applied only when != 1) written into ``outs`` where given, the
    values of p at each gradient's distinct ``indices`` (int64, drawn by the caller; times
    ``scales[s]``, where given), and the new residual, p with p - (0 + value) there: lists of
    values and new residuals (the overflow flag into ``nonfinite``, see ``_flag``)."""
    kind, gb, rb, ob, numels, pointers = _ef_many_inputs(gs, residuals, outs)
    ib = _same_kind_all(kind, indices, "int64")
    ks = [b.n for b in ib]
    starts = [0, *itertools.accumulate(ks[:-1])]
    values = kind.empty(sum(ks), "float32")
    scale = None if scales is None else c_array(ctypes.c_float, len(ks))(*scales)
    rc = call(kind, "randomk_ef_many", len(gb), *pointers, _int64s(numels), _int64s(ks), _pointers(ib), float(beta),
              float(gamma), _ef_flags(beta, gamma), scale, _addresses(values, [4 * s for s in starts]),
              _flag(kind, nonfinite))
    if rc != 0:
        raise IndexError("an index is out of range for its gradient")
    return [values.obj[s:s + k] for s, k in zip(starts, ks)], _outputs(ob, outs)
