"""The sign family: signSGD, EF-signSGD and 1-bit SGD (bits packed 8 to a byte, float32 out).

    signsgd_compress(x) -> packed               signsgd_decompress(packed, numel)
    efsignsgd_compress(x) -> (packed, scale)    efsignsgd_decompress(packed, scale, numel)
    onebit_compress(x) -> (packed, means)       onebit_decompress(packed, means, numel)
    every rank's payload of one tensor decoded and summed (the rows concatenated):
    signsgd_decompress_sum(packed_rows, numel), efsignsgd_decompress_sum(packed_rows, scales, numel),
    onebit_decompress_sum(packed_rows, means, numel); signsgd_, efsignsgd_, onebit_decompress_sum_into(payloads,
    outs): every gradient of a bucket in one call (CPU)
    segment by segment: efsignsgd_compress_segments(x, starts, numels), efsignsgd_decompress_segments(packed,
    scale, numels), onebit_compress_segments(x, starts, numels), onebit_decompress_segments(packed, means, numels);
    with residual memory's step: efsignsgd_, onebit_ef_step_segments(g, residual, starts, numels, beta, gamma)
    error feedback (CPU): efsignsgd_, onebit_ef_step_many(gs, residuals, beta, gamma, outs), the
    subtraction deferred where asked (SignCodes);
    efsignsgd_, onebit_residual_into(p, ..., out)
The bit-code sums (``_bits_sum``, ``_bits_sum_into``) serve TernGrad's 2-bit codes too (terngrad.py).
"""
from __future__ import annotations

import functools
import itertools

from grace.formats import packed_size
from grace.native._arrays import call, kind_of
from grace.native._common import (_FLOATS, _addresses, _check_segments, _cpu_kind, _decode_out, _decode_segments,
                                  _ef_flags, _ef_inputs, _ef_many_inputs, _every, _finish_args, _flag, _float32,
                                  _in_place, _in_place_all, _int64s, _on_gpu, _outputs, _packed_total, _placed,
                                  _pointers, _same_kind, _wrap)
from grace.native._rows import _field
from grace.native._flags import _flag_of, _HostFlag


# --- fused compress / decompress ------------------------------------------------------------------
def signsgd_compress(x):
    """signSGD's payload: bits (x >= 0) packed 8 to a byte. float16/bfloat16/float32."""
    kind = kind_of(x)
    b = _float32(kind, x, _FLOATS)
    out = kind.empty(packed_size(b.n, 1), "uint8")
    call(kind, "sign_pack", b.ptr, b.n, 0, out.ptr)
    return _wrap(kind, out)


def signsgd_decompress(packed, numel: int):
    """float32 +-1 (2 * bit - 1)."""
    return _decode_bits("sign_decode", packed, None, numel)


def efsignsgd_compress(x):
    """EF-signSGD's payload: (bits (x >= 0), scale = [sum |x| / max(1, d)])."""
    return _bits_and_scalars("efsign_compress", x, 1)


def efsignsgd_decompress(packed, scale, numel: int):
    """float32 (2 * bit - 1) * scale[0]."""
    return _decode_bits("sign_decode", packed, scale, numel)


def onebit_compress(x):
    """1-bit SGD's payload: (bits (x >= 0), means [mu0, mu1] of the elements < 0 and >= 0)."""
    return _bits_and_scalars("onebit_compress", x, 2)


def onebit_decompress(packed, means, numel: int):
    """float32 mu0 + bit * (mu1 - mu0)."""
    return _decode_bits("onebit_decode", packed, means, numel)


def _bits_and_scalars(symbol: str, x, scalars: int):
    """One bit per element and ``scalars`` float32 values per tensor, by the kernel ``symbol``."""
    kind = kind_of(x)
    b = _float32(kind, x)
    out = kind.empty(packed_size(b.n, 1), "uint8")
    values = kind.empty(scalars, "float32")
    call(kind, symbol, b.ptr, b.n, out.ptr, values.ptr)
    return _wrap(kind, out, values)


def _decode_bits(symbol: str, packed, scalars, numel: int):
    """float32 values of ``numel`` bits, decoded by the kernel ``symbol`` with the tensor's
    float32 ``scalars`` (None: signSGD's +-1)."""
    kind = kind_of(packed)
    p = kind.flat(packed)
    s = None if scalars is None else _same_kind(kind, scalars, "float32")
    out = _decode_out(kind, numel)
    call(kind, symbol, p.ptr, out.n, None if s is None else s.ptr, out.ptr)
    return _wrap(kind, out)


# --- the sign family's aggregate: every rank's bits decoded and added in one pass -----------------
# the kernels' modes (as the C code's row_values) and the float32 scalars each row carries
_SIGNSGD, _EFSIGNSGD, _ONEBIT, _TERNGRAD = 0, 1, 2, 3
_SCALARS = {_SIGNSGD: 0, _EFSIGNSGD: 1, _ONEBIT: 2, _TERNGRAD: 1}  # none, a scale, two means, a scale
_CODE_BITS = {_SIGNSGD: 1, _EFSIGNSGD: 1, _ONEBIT: 1, _TERNGRAD: 2}


def _bits_sum(mode: int, packed_rows, scalars, numel: int):
    per_row = _SCALARS[mode]
    kind = kind_of(packed_rows)
    p = kind.flat(packed_rows)
    out = _decode_out(kind, numel)
    if numel <= 0:
        return _wrap(kind, out)
    row = packed_size(numel, _CODE_BITS[mode])
    count = p.n // row
    s = _same_kind(kind, scalars, "float32") if per_row else None
    if p.dtype != "uint8" or count < 1 or p.n != count * row or (s is not None and s.n != per_row * count):
        raise ValueError(f"{p.n} packed bytes ({p.dtype}) and {s.n if s else 0} scalars are not rows of "
                         f"{numel} {_CODE_BITS[mode]}-bit codes with {per_row} scalars each")
    call(kind, "bits_sum", p.ptr, count, int(numel), s.ptr if s is not None else None, mode, out.ptr)
    return _wrap(kind, out)


def signsgd_decompress_sum(packed_rows, numel: int):
    """The sum, row after row in float32, of signsgd_decompress of each row of ``packed_rows``
    (every rank's packed bits of one tensor, concatenated)."""
    return _bits_sum(_SIGNSGD, packed_rows, None, numel)


def efsignsgd_decompress_sum(packed_rows, scales, numel: int):
    """The sum, row after row, of efsignsgd_decompress of each row with its scale."""
    return _bits_sum(_EFSIGNSGD, packed_rows, scales, numel)


def onebit_decompress_sum(packed_rows, means, numel: int):
    """The sum, row after row, of onebit_decompress of each row with its two means."""
    return _bits_sum(_ONEBIT, packed_rows, means, numel)


def _bits_sum_into(mode: int, payloads, outs, finish=None):
    per_row = _SCALARS[mode]
    kind = _cpu_kind(outs[0])
    ob = _in_place_all(kind, outs, "float32")
    packed = _field(kind, payloads, 0)
    scalars = _field(kind, payloads, 1, "float32") if per_row else None
    if any(d != "uint8" for d in packed.dtypes) \
            or packed.counts != packed.per_entry([packed_size(o.n, _CODE_BITS[mode]) for o in ob]) \
            or (scalars is not None and scalars.counts != scalars.per_entry([per_row] * len(ob))):
        raise ValueError(f"each gradient needs {packed.ranks} rows of its bits, with {per_row} scalars each")
    call(kind, "bits_sum_segments", len(ob), packed.ranks, packed.pointers, scalars.pointers if scalars else None,
         mode, _int64s([o.n for o in ob]), *_finish_args(finish), _pointers(ob))
    return outs


def signsgd_decompress_sum_into(payloads, outs, finish=None):
    """signsgd_decompress_sum of every gradient of a bucket in one call (CPU), written into
    ``outs``: ``payloads[s]`` holds each rank's payload of gradient s (its packed bits); each
    sum then finished as ``finish`` says ((vote, divisors): Compressor.finish)."""
    return _bits_sum_into(_SIGNSGD, payloads, outs, finish)


def efsignsgd_decompress_sum_into(payloads, outs, finish=None):
    """efsignsgd_decompress_sum of every gradient of a bucket in one call: payloads (bits, scale)."""
    return _bits_sum_into(_EFSIGNSGD, payloads, outs, finish)


def onebit_decompress_sum_into(payloads, outs, finish=None):
    """onebit_decompress_sum of every gradient of a bucket in one call: payloads (bits, means)."""
    return _bits_sum_into(_ONEBIT, payloads, outs, finish)


# --- the sign family, segment by segment: a bucket's gradients in one call ------------------------
# Each segment goes through the very kernels of the per-tensor functions above (its bits packed
# from a byte of its own, its own scale), so the results are the per-tensor ones, with one
# Python call per bucket instead of several per gradient. On a GPU one launch per kernel serves
# all segments (grace_cuda_*_segments: the per-tensor kernels' code on each segment's blocks);
# on a CPU (where buckets go gradient by gradient) the per-tensor kernels run segment by segment.
def _sign_segments(symbol: str, scalars: int, x, starts, numels):
    kind = kind_of(x)
    b = _float32(kind, x, ("float32",))
    _check_segments(b.n, starts, numels)
    out = kind.empty(_packed_total(tuple(numels), 1), "uint8")
    scale = kind.empty(scalars * len(numels), "float32")
    if _on_gpu(kind):
        call(kind, f"{symbol}_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), out.ptr, scale.ptr)
        return _wrap(kind, out, scale)
    at = 0
    for s, (start, n) in enumerate(zip(starts, numels)):
        call(kind, symbol, b.ptr + 4 * start, n, out.ptr + at, scale.ptr + 4 * scalars * s)
        at += packed_size(n, 1)
    return _wrap(kind, out, scale)


def _sign_decode_segments(symbol: str, scalars: int, packed, scale, numels):
    kind = kind_of(packed)
    p, sc = kind.flat(packed), _same_kind(kind, scale, "float32")
    if p.n != _packed_total(tuple(numels), 1) or sc.n != scalars * len(numels):
        raise ValueError(f"{p.n} packed bytes and {sc.n} scales for segments of {list(numels)} elements")
    out = _decode_out(kind, sum(numels))
    if _on_gpu(kind):
        _decode_segments(kind, symbol, numels, p, sc, out)
        return _wrap(kind, out)
    at, start = 0, 0
    for s, n in enumerate(numels):
        call(kind, symbol, p.ptr + at, n, sc.ptr + 4 * scalars * s, out.ptr + 4 * start)
        at += packed_size(n, 1)
        start += n
    return _wrap(kind, out)


def efsignsgd_compress_segments(x, starts, numels):
    """efsignsgd_compress of each segment (``starts``, ``numels``) of the flat float32 ``x``:
    (every segment's bits in a row, one scale per segment)."""
    return _sign_segments("efsign_compress", 1, x, starts, numels)


def efsignsgd_decompress_segments(packed, scale, numels):
    """efsignsgd_decompress of each segment, the results in a row."""
    return _sign_decode_segments("sign_decode", 1, packed, scale, numels)


def onebit_compress_segments(x, starts, numels):
    """onebit_compress of each segment: (every segment's bits in a row, two means per segment)."""
    return _sign_segments("onebit_compress", 2, x, starts, numels)


def onebit_decompress_segments(packed, means, numels):
    """onebit_decompress of each segment, the results in a row."""
    return _sign_decode_segments("onebit_decode", 2, packed, means, numels)


def _sign_ef_segments(mode: int, symbol: str, scalars: int, g, residual, starts, numels, beta, gamma, out,
                      nonfinite=None):
    """Residual memory's step with a sign compression on every segment of the flat ``g``:
    (bits in a row, scalars in a row, the new residual of the whole buffer); the overflow flag
    into ``nonfinite`` where given (see ``_flag_of``)."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    _check_segments(gb.n, starts, numels)
    sizes = [packed_size(n, 1) for n in numels]
    packed, sc = kind.empty(sum(sizes), "uint8"), kind.empty(scalars * len(numels), "float32")
    flags = _ef_flags(beta, gamma)
    if _on_gpu(kind):
        call(kind, f"{symbol}_ef_segments", gb.ptr, rb.ptr, len(numels), _int64s(starts), _int64s(numels),
             float(beta), float(gamma), flags, packed.ptr, sc.ptr, ob.ptr, *_flag_of(kind, nonfinite))
        return _wrap(kind, packed, sc, ob)
    at, flag = [0, *itertools.accumulate(sizes)][:-1], _HostFlag(kind, nonfinite)
    call(kind, "bits_ef_many", len(numels), _addresses(gb, [4 * s for s in starts]),
         _addresses(rb, [4 * s for s in starts]), None, None, _addresses(ob, [4 * s for s in starts]), _int64s(numels),
         float(beta), float(gamma), flags, mode, _addresses(packed, at),
         _addresses(sc, [4 * scalars * s for s in range(len(numels))]), None, None, flag.arg)
    flag.put()
    return _wrap(kind, packed, sc, ob)


def efsignsgd_ef_step_segments(g, residual, starts, numels, beta: float = 1.0, gamma: float = 1.0, out=None,
                               nonfinite=None):
    """Residual memory's step with efsignsgd_compress on each segment (``starts``, ``numels``):
    p = g * gamma + residual * beta; (bits in a row, a scale per segment, p - its decoding)."""
    return _sign_ef_segments(_EFSIGNSGD, "efsign", 1, g, residual, starts, numels, beta, gamma, out, nonfinite)


def onebit_ef_step_segments(g, residual, starts, numels, beta: float = 1.0, gamma: float = 1.0, out=None,
                            nonfinite=None):
    """The same with onebit_compress: (bits in a row, two means per segment, p - its decoding)."""
    return _sign_ef_segments(_ONEBIT, "onebit", 2, g, residual, starts, numels, beta, gamma, out, nonfinite)


# --- error feedback, a bucket in one call (CPU) ---------------------------------------------------
def _bits_residual(mode: int, p, packed, scalars, out):
    per_row = _SCALARS[mode]
    kind = _cpu_kind(p)
    pb, bits = _same_kind(kind, p), _same_kind(kind, packed)
    ob = _in_place(kind, out, "float32")
    sb = _same_kind(kind, scalars, "float32") if per_row else None
    if pb.dtype != "float32" or pb.n != ob.n or bits.dtype != "uint8" or bits.n != packed_size(pb.n, 1) \
            or (sb is not None and sb.n != per_row):
        raise ValueError(f"{pb.n} float32 elements need {packed_size(pb.n, 1)} bytes of bits, {per_row} scalars "
                         "and an output of their size")
    call(kind, "bits_residual", pb.ptr, bits.ptr, pb.n, sb.ptr if sb is not None else None, mode, ob.ptr)
    return out


class SignCodes:
    """The bits and scalars of a bucket call's payloads, kept for residuals whose subtraction was
    deferred (``keep`` of efsignsgd_, onebit_ef_step_many): the next call reads them back
    (``deferred``) and subtracts their decoded values in its own pass. One new uint8 buffer a
    call: every gradient's scalars (float32), then every gradient's bits."""

    def __init__(self, kind, numels, mode: int):
        self.numels, self.mode = tuple(numels), mode
        self.scalars_at, self.bits_at, size = _codes_layout(self.numels, _SCALARS[mode])
        self.buffer = kind.empty(size, "uint8")

    def payload(self, i: int):
        """Gradient ``i``'s (bits, scalars), views of the buffer."""
        kind, per_row = kind_of(self.buffer.obj), _SCALARS[self.mode]
        scalars = kind.typed(self.buffer.obj[:self.bits_at[0]], "float32")
        at = self.bits_at[i]
        return self.buffer.obj[at:at + packed_size(self.numels[i], 1)], scalars[i * per_row:(i + 1) * per_row]


@functools.lru_cache(maxsize=256)
def _codes_layout(numels: tuple, per_row: int):
    """SignCodes' byte offsets: (each gradient's scalars, each one's bits, the size)."""
    sizes = [packed_size(n, 1) for n in numels]
    first_bits = 4 * per_row * len(numels)
    bits_at = tuple(first_bits + at for at in itertools.accumulate([0, *sizes[:-1]]))
    return tuple(4 * per_row * i for i in range(len(numels))), bits_at, first_bits + sum(sizes)


def _bits_ef_many(mode: int, gs, residuals, beta: float, gamma: float, outs, nonfinite, into, deferred, keep):
    kind, gb, rb, ob, numels, (g_ptrs, r_ptrs, o_ptrs) = _ef_many_inputs(gs, residuals, outs)
    sizes, per_row = [packed_size(n, 1) for n in numels], _SCALARS[mode]
    if deferred is not None and (deferred.numels != numels or deferred.mode != mode):
        raise ValueError(f"deferred codes of {len(deferred.numels)} gradients (mode {deferred.mode}) do not match "
                         f"these {len(numels)} (mode {mode})")
    kept = SignCodes(kind, numels, mode) if keep else None
    addresses, views = _placed(kind, into, ["uint8", "float32"] * len(gb), [c for n in sizes for c in (n, per_row)])
    bit_ptrs, scalar_ptrs = _every(addresses, 0, 2), _every(addresses, 1, 2)
    payloads = list(zip(views[::2], views[1::2]))
    read, write = _code_addresses(deferred), _code_addresses(kept)
    call(kind, "bits_ef_many", len(gb), g_ptrs, r_ptrs, *read, o_ptrs, _int64s(numels),
         float(beta), float(gamma), _ef_flags(beta, gamma), mode, bit_ptrs, scalar_ptrs, *write,
         _flag(kind, nonfinite))
    return (payloads, _outputs(ob, outs)) + ((kept,) if keep else ())


def _code_addresses(codes):
    """(each gradient's bits, each one's scalars) in ``codes`` as C arrays; (None, None) for none."""
    if codes is None:
        return None, None
    return _addresses(codes.buffer, codes.bits_at), _addresses(codes.buffer, codes.scalars_at)


def efsignsgd_ef_step_many(gs, residuals, beta: float, gamma: float, outs, nonfinite=None, into=None, deferred=None,
                           keep=False):
    """EF-signSGD's residual step for every gradient of a bucket in one call (CPU): p = g*gamma
    + residual*beta written into ``outs`` (where given), its payload (sign bits, scale), then
    p - decode over it: (the payloads, the new residuals); the overflow flag into ``nonfinite``
    (see ``_flag``); the payloads where ``into`` places them (see ``_placed``). ``keep``: the
    subtraction deferred, ``outs`` left holding p: (the payloads, the p's, their SignCodes);
    ``deferred``: such SignCodes, the residuals being the p's their call left."""
    return _bits_ef_many(_EFSIGNSGD, gs, residuals, beta, gamma, outs, nonfinite, into, deferred, keep)


def onebit_ef_step_many(gs, residuals, beta: float, gamma: float, outs, nonfinite=None, into=None, deferred=None,
                        keep=False):
    """1-bit SGD's residual step for every gradient of a bucket in one call (CPU), as
    ``efsignsgd_ef_step_many`` with its payload (bits, the two means)."""
    return _bits_ef_many(_ONEBIT, gs, residuals, beta, gamma, outs, nonfinite, into, deferred, keep)


def efsignsgd_residual_into(p, packed, scale, out):
    """p - efsignsgd_decompress(packed, scale), written into ``out`` (CPU; may be ``p``)."""
    return _bits_residual(_EFSIGNSGD, p, packed, scale, out)


def onebit_residual_into(p, packed, means, out):
    """p - onebit_decompress(packed, means), written into ``out`` (CPU; may be ``p``)."""
    return _bits_residual(_ONEBIT, p, packed, means, out)
