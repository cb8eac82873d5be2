"""A bucket's quantized payloads in one call (CPU), each gradient at its own pointers.

    compress_many(method, xs, words, levels, bucket_size): signSGD's, TernGrad's, QSGD's, natural's payloads
    fp16_compress_many_into(xs, divisor, outs), fp16_decompress_many_into(halves, factor, divisor, outs),
    divide_many_into(xs, divisor, outs), flag_nonfinite_many(xs, flag)
"""
from __future__ import annotations

import ctypes
import functools

from grace.formats import code_width, packed_size
from grace.native._arrays import NativeUnavailable, c_array, call
from grace.native._common import (_cpu_kind, _every, _flag, _float32_all, _in_place_all, _int64s, _int64s_of,
                                  _placed, _pointers_of, _same_kind_all, _seed_word_arrays)
from grace.native.qsgd import _qsgd_rows


_COMPRESS_MANY = {"signsgd": 0, "terngrad": 1, "qsgd": 2, "natural": 3}


def compress_many(method: str, xs, words=None, levels: int = 0, bucket_size: int = 0, nonfinite=None, into=None):
    """The payloads of every gradient of a bucket in one call (CPU): signsgd_compress, or
    terngrad_, qsgd_ or natural_compress_drawn with each gradient's seed words ``words[s]``, of
    each of the float32 ``xs``. A list of payloads, each a tuple of views of one buffer per
    payload tensor (the same tensors as the per-gradient functions return), or of the buffer
    ``into`` gives (see ``_placed``). The overflow flag into ``nonfinite`` (see ``_flag``)."""
    kind = _cpu_kind(xs[0])
    _, sizes, pointers = _float32_all(kind, xs, "compress_many")
    numels, bits, dtypes, counts, k = _many_layout(method, sizes, int(levels), int(bucket_size))
    addresses, views = _placed(kind, into, dtypes, counts)
    places = [_every(addresses, f, k) for f in range(k)]
    payloads = [tuple(views[k * s:k * s + k]) for s in range(len(sizes))]
    s0, s1 = _seed_word_arrays(words) if words is not None else _no_words(len(sizes))
    if call(kind, "compress_many", _COMPRESS_MANY[method], len(sizes), pointers, numels, s0, s1, places[0],
            places[-1] if len(places) > 1 else None, int(levels), int(bucket_size), bits, _flag(kind, nonfinite)) != 0:
        raise ValueError(f"bad {method} parameters: levels={levels}, bits={bits}")
    return payloads


@functools.lru_cache(maxsize=256)
def _many_layout(method: str, numels: tuple, levels: int, bucket_size: int):
    """What ``compress_many`` derives from a bucket's sizes, the same every step: (the sizes, a C
    array; QSGD's code bits; the payload tensors' dtypes and counts, gradient after gradient; the
    tensors of a payload)."""
    bits = code_width(2 * (levels + 1)) if method == "qsgd" else 0
    fields = {  # each payload tensor: its dtype and size per gradient
        "signsgd": [("uint8", [packed_size(n, 1) for n in numels])],
        "terngrad": [("uint8", [packed_size(n, 2) for n in numels]), ("float32", [1] * len(numels))],
        "qsgd": [("uint8", [packed_size(n, bits) for n in numels]),
                 ("float32", [_qsgd_rows(n, bucket_size) for n in numels])],
        "natural": [("uint8", [packed_size(n, 1) for n in numels]), ("uint8", list(numels))],
    }[method]
    return (_int64s_of(numels), bits, tuple(dtype for _ in numels for dtype, _ in fields),
            tuple(sizes[s] for s in range(len(numels)) for _, sizes in fields), len(fields))


@functools.lru_cache(maxsize=64)
def _no_words(n: int):
    """The seed words of ``n`` gradients of a method that draws nothing: zeros (C arrays, read only)."""
    return c_array(ctypes.c_uint32, n)(), c_array(ctypes.c_uint32, n)()


# --- fp16: a bucket's casts -----------------------------------------------------------------------
def _elementwise_many(symbol: str, ins, in_dtype: str, outs, out_dtype: str, *scalars, tail=()):
    """``grace_cpu_<symbol>`` over a bucket: each of ``ins`` (of ``in_dtype``) into the output
    of the same size in ``outs`` (written in place, ``out_dtype``), then ``scalars``; ``tail``: the
    arguments after the outputs."""
    kind = _cpu_kind(outs[0])
    ib, ob = _same_kind_all(kind, ins), _in_place_all(kind, outs, out_dtype)
    if any(b.dtype != in_dtype for b in ib):
        raise NativeUnavailable(f"{symbol} takes {in_dtype} inputs")
    if len(ib) != len(ob) or any(i.n != o.n for i, o in zip(ib, ob)):
        raise ValueError("one output of the same size per input")
    call(kind, symbol, len(ib), _pointers_of(ins, ib), _int64s(tuple([b.n for b in ib])), *map(float, scalars),
         _pointers_of(outs, ob), *tail)
    return outs


def fp16_compress_many_into(xs, divisor: float, outs, held: int = 0):
    """fp16's payload of every gradient of a bucket in one call (CPU): ``outs[s]`` (float16, as
    many elements as ``xs[s]``) = ``xs[s] / divisor`` rounded to half precision, nearest even, as
    torch's and NumPy's casts round (a NaN's payload bits aside). ``held``: the bytes of payload
    written before these are read back (a step's, every bucket's; 0: these alone), which decide
    whether the halves stay in the caches. Returns ``outs``."""
    return _elementwise_many("half_encode_many", xs, "float32", outs, "float16", divisor, tail=(int(held),))


def divide_many_into(xs, divisor: float, outs):
    """``outs[s]`` = ``xs[s] / divisor`` (float32, as the tensor ops divide) for every tensor of a
    bucket in one call (CPU): summed payloads averaged into the results. Returns ``outs``."""
    return _elementwise_many("divide_many", xs, "float32", outs, "float32", divisor)


def flag_nonfinite_many(xs, flag):
    """``flag`` (a one-element float32 tensor) set to 1 where any of ``xs`` (float32, a bucket's)
    holds an inf or a NaN, left as it is otherwise, in one call (CPU). Returns ``flag``."""
    kind = _cpu_kind(flag)
    _, numels, pointers = _float32_all(kind, xs, "flag_nonfinite_many")
    call(kind, "flag_nonfinite_many", len(numels), pointers, _int64s(numels), _flag(kind, flag))
    return flag


def fp16_decompress_many_into(halves, factor: float, divisor: float, outs):
    """``outs[s]`` (float32) = ``(float(halves[s]) * factor) / divisor`` for every gradient of a
    bucket in one call (CPU): fp16's decompressed sums, averaged. Returns ``outs``."""
    return _elementwise_many("half_decode_many", halves, "float16", outs, "float32", factor, divisor)
