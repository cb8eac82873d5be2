"""Natural compression: sign bits packed, uint8 exponent codes (rounded up at random).

    natural_compress(x, u) -> (signs, codes), natural_decompress(signs, codes, numel)
    natural_compress_drawn(x, words): the draws made inside (CPU)
    natural_compress_segments(x, starts, numels, words), natural_decompress_segments(signs, codes,
    numels); natural_decompress_sum(signs_rows, codes_rows, numel), natural_decompress_sum_into(payloads, outs)
"""
from __future__ import annotations

from grace.formats import packed_size
from grace.native._arrays import call, kind_of
from grace.native._common import (_check_payload, _check_sums, _cpu_kind, _decode_out, _decode_segments, _draws,
                                  _finish_args, _float32, _in_place_all, _int64s, _on_gpu, _packed_total, _pointers,
                                  _rows, _same_kind, _drawn_segments, _wrap)
from grace.native._rows import _field


# --- fused compress / decompress ------------------------------------------------------------------
def natural_compress(x, u):
    """Natural compression's payload: (sign bits (x < 0) packed, uint8 exponent codes: the
    biased exponent of |x|, plus one with probability of its mantissa fraction, at most 254)."""
    kind = kind_of(x)
    b = _float32(kind, x)
    ub = _draws(kind, u, b.n)
    signs = kind.empty(packed_size(b.n, 1), "uint8")
    codes = kind.empty(b.n, "uint8")
    call(kind, "natural_compress", b.ptr, ub.ptr, b.n, signs.ptr, codes.ptr)
    return _wrap(kind, signs, codes)


def natural_compress_drawn(x, words):
    """``natural_compress(x, u)`` with u the counter-based draws of the seed words ``words``
    (grace.core.draws: draw i for element i), made where they are used (CPU): no tensor of
    draws written and read back."""
    kind = _cpu_kind(x)
    b = _float32(kind, x)
    signs = kind.empty(packed_size(b.n, 1), "uint8")
    codes = kind.empty(b.n, "uint8")
    call(kind, "natural_compress_drawn", b.ptr, b.n, int(words[0]), int(words[1]), signs.ptr, codes.ptr)
    return _wrap(kind, signs, codes)


def natural_decompress(signs, codes, numel: int):
    """float32 (-1)^sign * 2^(code - 127) (0 for code 0)."""
    kind = kind_of(signs)
    s, c = kind.flat(signs), _same_kind(kind, codes)
    out = _decode_out(kind, numel)
    call(kind, "natural_decode", s.ptr, c.ptr, out.n, out.ptr)
    return _wrap(kind, out)


# --- segment by segment (draws: each segment's own, in a row) -------------------------------------
def natural_compress_segments(x, starts, numels, words):
    """natural_compress of each segment, with the counter-based draws of segment s's seed words
    ``words[s]``: (every segment's sign bits in a row, its codes in a row)."""
    kind, b, s0, s1 = _drawn_segments(x, starts, numels, words, numels)
    signs = kind.empty(_packed_total(tuple(numels), 1), "uint8")
    codes = kind.empty(sum(numels), "uint8")
    if _on_gpu(kind):
        call(kind, "natural_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), s0, s1,
             signs.ptr, codes.ptr)
        return _wrap(kind, signs, codes)
    at, code = 0, 0  # (the codes in a row: a segment's start in x may lie past its first code)
    for s, (start, n) in enumerate(zip(starts, numels)):
        call(kind, "natural_compress_drawn", b.ptr + 4 * start, n, s0[s], s1[s], signs.ptr + at, codes.ptr + code)
        at, code = at + packed_size(n, 1), code + n
    return _wrap(kind, signs, codes)


def natural_decompress_segments(signs, codes, numels):
    kind = kind_of(signs)
    s, c = kind.flat(signs), _same_kind(kind, codes)
    _check_payload(s, _packed_total(tuple(numels), 1), "sign bytes")
    _check_payload(c, sum(numels), "codes")
    out = _decode_out(kind, sum(numels))
    if _on_gpu(kind):
        _decode_segments(kind, "natural_decode", numels, s, c, out)
        return _wrap(kind, out)
    at, start = 0, 0
    for n in numels:
        call(kind, "natural_decode", s.ptr + at, c.ptr + start, n, out.ptr + 4 * start)
        at, start = at + packed_size(n, 1), start + n
    return _wrap(kind, out)


# --- decoded sums: every rank's payload of a gradient decoded and added in one pass (CPU) ---------
def natural_decompress_sum(signs_rows, codes_rows, numel: int):
    """The sum, row after row in float32, of natural_decompress of each rank's row (its sign
    bits and exponent codes, every rank's concatenated)."""
    kind = _cpu_kind(signs_rows)
    sb, cb = kind.flat(signs_rows), _same_kind(kind, codes_rows)
    out = _decode_out(kind, numel)
    if numel <= 0:
        return _wrap(kind, out)
    size = packed_size(numel, 1)
    count = sb.n // size
    _check_sums(sb.dtype == cb.dtype == "uint8" and count >= 1 and sb.n == count * size and cb.n == count * numel,
                f"{numel} sign bits and exponent codes")
    call(kind, "natural_sum_segments", 1, count, _rows(sb, count, 1, size), _rows(cb, count, 1, numel),
         _int64s([numel]), *_finish_args(None), _pointers([out]))
    return _wrap(kind, out)


def natural_decompress_sum_into(payloads, outs, finish=None):
    """natural_decompress_sum of every gradient of a bucket in one call (CPU), written into
    ``outs``: ``payloads[s]`` holds each rank's payload (sign bits, codes) of gradient s; each
    sum then finished as ``finish`` says."""
    kind = _cpu_kind(outs[0])
    ob = _in_place_all(kind, outs, "float32")
    signs, codes = _field(kind, payloads, 0), _field(kind, payloads, 1)
    _check_sums(all(d == "uint8" for d in signs.dtypes + codes.dtypes)
                and signs.counts == signs.per_entry([packed_size(o.n, 1) for o in ob])
                and codes.counts == codes.per_entry([o.n for o in ob]), "sign bits and exponent codes")
    call(kind, "natural_sum_segments", len(ob), signs.ranks, signs.pointers, codes.pointers,
         _int64s([o.n for o in ob]), *_finish_args(finish), _pointers(ob))
    return outs
