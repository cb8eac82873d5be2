"""QSGD: codes level * 2 + sign at code_width(2 * (levels + 1)) bits, one norm per bucket.

    qsgd_compress(x, u, levels, bucket_size=0, norms=None) -> (packed, norms)
    qsgd_decompress(packed, norms, numel, levels, bucket_size=0)
    qsgd_compress_drawn(x, words, levels, bucket_size): the draws made inside (CPU); norm(x) (CPU)
    qsgd_compress_segments(x, starts, numels, words, levels, bucket_size), qsgd_decompress_segments(
    packed, norms, numels, levels, bucket_size); qsgd_decompress_sum(packed_rows, norms_rows, numel, levels,
    bucket_size), qsgd_decompress_sum_into(payloads, outs, levels, bucket_size, finish) (CPU)
"""
from __future__ import annotations

import functools

from grace.formats import code_width, packed_size, qsgd_bucket
from grace.native._arrays import NativeUnavailable, call, kind_of
from grace.native._common import (_check_payload, _check_sums, _cpu_kind, _decode_out, _decode_segments, _draws,
                                  _finish_args, _float32, _in_place_all, _int64s, _on_gpu, _packed_total, _pointers,
                                  _rows, _same_kind, _drawn_segments, _wrap)
from grace.native._rows import _field


# --- fused compress / decompress ------------------------------------------------------------------
def qsgd_compress(x, u, levels: int, bucket_size: int = 0, norms=None):
    """QSGD's payload: (codes level * 2 + (x < 0) packed at code_width(2 * (levels + 1)) bits,
    norms: one float32 per bucket of ``bucket_size`` elements, 0: one bucket). ``u``: one draw
    per element (the compressor draws one per padded element; the first numel are used).
    ``norms``: precomputed (skips that pass; the GPU tests pass the reference's)."""
    kind = kind_of(x)
    b = _float32(kind, x)
    ub = _draws(kind, u, b.n)
    bits = code_width(2 * (levels + 1))
    bucket = qsgd_bucket(b.n, bucket_size)
    rows = -(-b.n // bucket)
    have_norms = norms is not None
    nb = _same_kind(kind, norms, "float32") if have_norms else kind.empty(rows, "float32")
    out = kind.empty(packed_size(b.n, bits), "uint8")
    if b.n:  # the norms too, unless given (short buckets: in the same pass as their codes)
        rc = call(kind, "qsgd_compress", b.ptr, ub.ptr, b.n, int(levels), bucket, bits, nb.ptr, int(have_norms),
                  out.ptr)
        if rc != 0:
            raise ValueError(f"bad QSGD parameters: levels={levels}, bits={bits}")
    return _wrap(kind, out, nb)


def norm(x):
    """The Euclidean norm of a float32 tensor (CPU), as one float32 element: the square root of
    NumPy's pairwise sum of the squares (each computed in float64 and rounded once), so the
    NumPy backend's ``norm`` bit for bit, with no microcode assist for tiny elements."""
    kind = _cpu_kind(x)
    b = kind.flat(x)
    if b.dtype != "float32":
        raise NativeUnavailable("norm takes float32 tensors")
    out = kind.empty(1, "float32")
    call(kind, "qsgd_norms", b.ptr, b.n, 0, out.ptr)
    return _wrap(kind, out)


def qsgd_decompress(packed, norms, numel: int, levels: int, bucket_size: int = 0):
    """float32 norm[bucket] * sign * level / levels."""
    kind = kind_of(packed)
    p, nb = kind.flat(packed), _same_kind(kind, norms, "float32")
    bits = code_width(2 * (levels + 1))
    out = _decode_out(kind, numel)
    if numel:
        bucket = qsgd_bucket(int(numel), bucket_size)
        call(kind, "qsgd_decode", p.ptr, out.n, int(levels), bucket, bits, nb.ptr, out.ptr)
    return _wrap(kind, out)


def qsgd_compress_drawn(x, words, levels: int, bucket_size: int = 0):
    """``qsgd_compress(x, u, levels, bucket_size)`` with u the counter-based draws of the seed
    words ``words`` (as ``natural_compress_drawn``; draw i for element i), the norms found in
    the same call (CPU)."""
    kind = _cpu_kind(x)
    b = _float32(kind, x)
    bits = code_width(2 * (levels + 1))
    bucket = qsgd_bucket(b.n, bucket_size)
    norms = kind.empty(-(-b.n // bucket), "float32")
    out = kind.empty(packed_size(b.n, bits), "uint8")
    if call(kind, "qsgd_compress_drawn", b.ptr, b.n, int(words[0]), int(words[1]), int(levels), bucket, bits,
            norms.ptr, out.ptr) != 0:
        raise ValueError(f"bad QSGD parameters: levels={levels}, bits={bits}")
    return _wrap(kind, out, norms)


# --- segment by segment (draws: each segment's own, in a row) -------------------------------------
def _qsgd_rows(n: int, bucket_size: int) -> int:
    return -(-n // qsgd_bucket(n, bucket_size))


@functools.lru_cache(maxsize=1024)
def _qsgd_rows_total(numels: tuple, bucket_size: int) -> int:
    return sum(_qsgd_rows(n, bucket_size) for n in numels)


def qsgd_compress_segments(x, starts, numels, words, levels: int, bucket_size: int = 0):
    """qsgd_compress of each segment, with the counter-based draws of segment s's seed words
    ``words[s]`` (one per element of its rows): (every segment's codes in a row, its norms in a row)."""
    padded = [_qsgd_rows(n, bucket_size) * qsgd_bucket(n, bucket_size) for n in numels]
    kind, b, s0, s1 = _drawn_segments(x, starts, numels, words, padded)
    bits = code_width(2 * (levels + 1))
    out = kind.empty(_packed_total(tuple(numels), bits), "uint8")
    norms = kind.empty(_qsgd_rows_total(tuple(numels), int(bucket_size)), "float32")
    if _on_gpu(kind):
        call(kind, "qsgd_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), s0, s1,
             int(levels), int(bucket_size), bits, out.ptr, norms.ptr)
        return _wrap(kind, out, norms)
    at, row = 0, 0
    for s, (start, n) in enumerate(zip(starts, numels)):
        if call(kind, "qsgd_compress_drawn", b.ptr + 4 * start, n, s0[s], s1[s], int(levels),
                qsgd_bucket(n, bucket_size), bits, norms.ptr + 4 * row, out.ptr + at) != 0:
            raise ValueError(f"bad QSGD parameters: levels={levels}, bits={bits}")
        at, row = at + packed_size(n, bits), row + _qsgd_rows(n, bucket_size)
    return _wrap(kind, out, norms)


def qsgd_decompress_segments(packed, norms, numels, levels: int, bucket_size: int = 0):
    kind = kind_of(packed)
    p, nb = kind.flat(packed), _same_kind(kind, norms, "float32")
    bits = code_width(2 * (levels + 1))
    _check_payload(p, _packed_total(tuple(numels), bits), "packed bytes")
    _check_payload(nb, _qsgd_rows_total(tuple(numels), int(bucket_size)), "norms")
    out = _decode_out(kind, sum(numels))
    if _on_gpu(kind):
        _decode_segments(kind, "qsgd_decode", numels, p, nb, out, levels, bucket_size, bits)
        return _wrap(kind, out)
    at, row, start = 0, 0, 0
    for n in numels:
        call(kind, "qsgd_decode", p.ptr + at, n, int(levels), qsgd_bucket(n, bucket_size), bits, nb.ptr + 4 * row,
             out.ptr + 4 * start)
        at, row, start = at + packed_size(n, bits), row + _qsgd_rows(n, bucket_size), start + n
    return _wrap(kind, out)


# --- decoded sums: every rank's payload of a gradient decoded and added in one pass (CPU) ---------
def qsgd_decompress_sum(packed_rows, norms_rows, numel: int, levels: int, bucket_size: int = 0):
    """The sum, row after row in float32, of qsgd_decompress of each rank's row (its packed
    codes and norms, every rank's concatenated)."""
    kind = _cpu_kind(packed_rows)
    p, nb = kind.flat(packed_rows), _same_kind(kind, norms_rows, "float32")
    out = _decode_out(kind, numel)
    if numel <= 0:
        return _wrap(kind, out)
    bits, rows = code_width(2 * (levels + 1)), _qsgd_rows(numel, bucket_size)
    size = packed_size(numel, bits)
    count = p.n // size
    _check_sums(p.dtype == "uint8" and count >= 1 and p.n == count * size and nb.n == count * rows,
                f"{numel} {bits}-bit codes with {rows} norms each")
    rc = call(kind, "qsgd_sum_segments", 1, count, _rows(p, count, 1, size), _rows(nb, count, 4, rows),
              _int64s([numel]), int(levels), int(bucket_size), bits, *_finish_args(None), _pointers([out]))
    if rc != 0:
        raise ValueError(f"bad QSGD parameters: levels={levels}")
    return _wrap(kind, out)


def qsgd_decompress_sum_into(payloads, outs, levels: int, bucket_size: int = 0, finish=None):
    """qsgd_decompress_sum of every gradient of a bucket in one call (CPU), written into
    ``outs``: ``payloads[s]`` holds each rank's payload (codes, norms) of gradient s; each sum
    then finished as ``finish`` says ((vote, divisors): Compressor.finish)."""
    kind = _cpu_kind(outs[0])
    bits = code_width(2 * (levels + 1))
    ob = _in_place_all(kind, outs, "float32")
    packed, norms = _field(kind, payloads, 0), _field(kind, payloads, 1, "float32")
    _check_sums(all(d == "uint8" for d in packed.dtypes)
                and packed.counts == packed.per_entry([packed_size(o.n, bits) for o in ob])
                and norms.counts == norms.per_entry([_qsgd_rows(o.n, bucket_size) for o in ob]),
                f"{bits}-bit codes with their norms")
    rc = call(kind, "qsgd_sum_segments", len(ob), packed.ranks, packed.pointers, norms.pointers,
              _int64s([o.n for o in ob]), int(levels), int(bucket_size), bits, *_finish_args(finish), _pointers(ob))
    if rc != 0:
        raise ValueError(f"bad QSGD parameters: levels={levels}")
    return outs
