"""TernGrad: codes 0 / +s / -s at 2 bits, one scale (max |x|) per tensor.

    terngrad_compress(x, u, scale=None) -> (packed, scale), terngrad_decompress(packed, scale, numel)
    terngrad_decompress_pieces(packed, scale, starts, lengths, outs): ranges of the decoding into outs (CPU)
    terngrad_compress_drawn(x, words): the same with the draws made inside (CPU)
    terngrad_compress_segments(x, starts, numels, words), terngrad_decompress_segments(packed, scale,
    numels); terngrad_decompress_sum(packed_rows, scales, numel), terngrad_decompress_sum_into(payloads, outs)
"""
from __future__ import annotations

from grace.formats import packed_size
from grace.native._arrays import call, kind_of
from grace.native._common import (_check_payload, _cpu_kind, _decode_out, _decode_segments, _draws, _float32,
                                  _in_place_all, _int64s, _on_gpu, _packed_total, _pointers, _same_kind,
                                  _drawn_segments, _wrap)
from grace.native.signs import _TERNGRAD, _bits_sum, _bits_sum_into


# --- fused compress / decompress ------------------------------------------------------------------
def terngrad_compress(x, u, scale=None):
    """TernGrad's payload: (codes 0 / 1 (+s) / 2 (-s) at 2 bits, scale = [max |x|]), keeping
    element i when u[i] < |x[i]| / s. ``scale``: a precomputed [max |x|] (skips that pass)."""
    kind = kind_of(x)
    b = _float32(kind, x)
    ub = _draws(kind, u, b.n)
    if scale is None:
        s = kind.empty(1, "float32")
        call(kind, "maxabs", b.ptr, b.n, s.ptr)
    else:
        s = _same_kind(kind, scale, "float32")
    out = kind.empty(packed_size(b.n, 2), "uint8")
    call(kind, "terngrad_compress", b.ptr, ub.ptr, b.n, s.ptr, out.ptr)
    return _wrap(kind, out, s)


def terngrad_decompress(packed, scale, numel: int):
    """float32 {0, +s, -s} from the 2-bit codes."""
    kind = kind_of(packed)
    p, s = kind.flat(packed), _same_kind(kind, scale, "float32")
    out = _decode_out(kind, numel)
    call(kind, "terngrad_decode", p.ptr, out.n, s.ptr, out.ptr)
    return _wrap(kind, out)


def terngrad_decompress_pieces(packed, scale, starts, lengths, outs):
    """Elements [starts[s], starts[s] + lengths[s]) of one TernGrad payload decoded into
    ``outs[s]`` (float32, contiguous, written in place), the values terngrad_decompress gives
    them (CPU): a shard's decoding written straight over the gradients it spans. Returns ``outs``."""
    kind = _cpu_kind(outs[0])
    p, s = _same_kind(kind, packed, "uint8"), _same_kind(kind, scale, "float32")
    ob = _in_place_all(kind, outs, "float32")
    if len(starts) != len(ob) or len(lengths) != len(ob) or any(
            n < 0 or start < 0 or o.n != n or start + n > 4 * p.n for start, n, o in zip(starts, lengths, ob)):
        raise ValueError("one output of each piece's length, every piece inside the codes")
    call(kind, "terngrad_decode_pieces", p.ptr, s.ptr, len(ob), _int64s(starts), _int64s(lengths), _pointers(ob))
    return outs


def terngrad_compress_drawn(x, words):
    """``terngrad_compress(x, u)`` with u the counter-based draws of the seed words ``words``
    (as ``natural_compress_drawn``), its scale found in the same call (CPU)."""
    kind = _cpu_kind(x)
    b = _float32(kind, x)
    scale = kind.empty(1, "float32")
    out = kind.empty(packed_size(b.n, 2), "uint8")
    call(kind, "terngrad_compress_drawn", b.ptr, b.n, int(words[0]), int(words[1]), scale.ptr, out.ptr)
    return _wrap(kind, out, scale)


# --- segment by segment (draws: each segment's own, in a row) -------------------------------------
def terngrad_compress_segments(x, starts, numels, words):
    """terngrad_compress of each segment of the flat float32 ``x``, with the counter-based draws
    of segment s's seed words ``words[s]`` (as terngrad_compress_drawn): (every segment's codes
    in a row, one scale per segment)."""
    kind, b, s0, s1 = _drawn_segments(x, starts, numels, words, numels)
    out = kind.empty(_packed_total(tuple(numels), 2), "uint8")
    scale = kind.empty(len(numels), "float32")
    if _on_gpu(kind):
        call(kind, "terngrad_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), s0, s1,
             out.ptr, scale.ptr)
        return _wrap(kind, out, scale)
    at = 0
    for s, (start, n) in enumerate(zip(starts, numels)):
        call(kind, "terngrad_compress_drawn", b.ptr + 4 * start, n, s0[s], s1[s], scale.ptr + 4 * s, out.ptr + at)
        at += packed_size(n, 2)
    return _wrap(kind, out, scale)


def terngrad_decompress_segments(packed, scale, numels):
    kind = kind_of(packed)
    p, sc = kind.flat(packed), _same_kind(kind, scale, "float32")
    _check_payload(p, _packed_total(tuple(numels), 2), "packed bytes")
    _check_payload(sc, len(numels), "scales")
    out = _decode_out(kind, sum(numels))
    if _on_gpu(kind):
        _decode_segments(kind, "terngrad_decode", numels, p, sc, out)
        return _wrap(kind, out)
    at, start = 0, 0
    for s, n in enumerate(numels):
        call(kind, "terngrad_decode", p.ptr + at, n, sc.ptr + 4 * s, out.ptr + 4 * start)
        at, start = at + packed_size(n, 2), start + n
    return _wrap(kind, out)


# --- decoded sums: every rank's payload decoded and added in one pass (the sign family's kernels) -
def terngrad_decompress_sum(packed_rows, scales, numel: int):
    """The sum, row after row, of terngrad_decompress of each row (2-bit codes) with its scale."""
    return _bits_sum(_TERNGRAD, packed_rows, scales, numel)


def terngrad_decompress_sum_into(payloads, outs, finish=None):
    """terngrad_decompress_sum of every gradient of a bucket in one call: payloads (codes, scale)."""
    return _bits_sum_into(_TERNGRAD, payloads, outs, finish)
