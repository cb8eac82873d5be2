"""The helpers the kernel families share: inputs as flat buffers of the first input's kind and
results wrapped back, outputs written in place, C arrays of a bucket's pointers and sizes, payload
tensors placed in one buffer, segment checks, the overflow flag and the decoded sums' finish."""
from __future__ import annotations

import ctypes
import functools

from grace.formats import ITEMSIZE, packed_size
from grace.native import _arrays
from grace.native._arrays import INDEX_CODES, Buf, NativeUnavailable, TensorBuf, c_array, call, kind_of, same_device


# the float dtypes the fused functions take (the quantizers other than signSGD also float64)
_FLOATS = ("float16", "bfloat16", "float32")


# --- inputs as buffers, results as arrays ---------------------------------------------------------
def _float32(kind, x, allow=_FLOATS + ("float64",)) -> Buf:
    b = kind.flat(x)
    if b.dtype not in allow:
        raise TypeError(f"native kernels take {', '.join(allow)} tensors, got {b.dtype}")
    return b if b.dtype == "float32" else kind.flat(b.obj, "float32")


def _same_kind(kind, x, dtype=None) -> Buf:
    """``x`` as a flat buffer for ``kind`` (same toolkit and device as the first input)."""
    if type(x) is Buf:  # a buffer already: taken as it is
        if dtype is not None and x.dtype != dtype:
            raise NativeUnavailable(f"a frame's {x.dtype} piece where {dtype} is needed")
        return x
    other = kind_of(x)
    if not same_device(kind, other):
        raise NativeUnavailable("inputs are on different devices")
    return other.flat(x, dtype)


def _same_kind_all(kind, xs, dtype=None) -> list:
    """``_same_kind`` of each of ``xs``: a bucket's many tensors. Contiguous CPU torch tensors
    of the dtype wanted (the pieces of a received frame, a bucket's gradients) take a short
    path: the per-tensor checks cost more than the kernels on small tensors. Views an exchange
    keeps (``grace.core.buffers.Pieces``) are checked once: their buffers are kept with them."""
    if getattr(xs, "derive", None) is not None:
        return list(xs.derive(("bufs", dtype), lambda: _same_kind_all(kind, list(xs), dtype)))
    if kind.name == "torch" and kind.lib.kind == "cpu":
        tensor, names, bufs = kind.torch.Tensor, _arrays._TORCH_NAMES, []
        for x in xs:
            if type(x) is Buf and (dtype is None or x.dtype == dtype):  # a frame's piece
                bufs.append(x)
                continue
            name = names.get(x.dtype) if type(x) is tensor else None
            if name is None or (dtype is not None and name != dtype) or not x.is_cpu or x.requires_grad \
                    or not x.is_contiguous():
                bufs.append(_same_kind(kind, x, dtype))
            else:
                bufs.append(TensorBuf(x, x.data_ptr(), x.numel(), name))
        return bufs
    return [_same_kind(kind, x, dtype) for x in xs]


def _index_buf(kind, idx, b: Buf = None) -> Buf:
    """Indices as a buffer of an index type the kernels take (int64 otherwise); ``b``:
    ``_same_kind``'s buffer of idx, where made already."""
    b = _same_kind(kind, idx) if b is None else b
    if b.dtype not in INDEX_CODES and b.obj is None:
        raise NativeUnavailable(f"a frame's {b.dtype} indices")
    if b.dtype not in INDEX_CODES:
        b = _same_kind(kind, b.obj, "int64")
    return b


def _in_place(kind, x, dtype: str, b: Buf = None) -> Buf:
    """``x`` as a buffer the kernel writes into: x's own memory, contiguous, of ``dtype``
    (``b``: ``_same_kind``'s buffer of x, where made already)."""
    b = _same_kind(kind, x) if b is None else b
    own = x.data_ptr() if kind.name == "torch" else getattr(getattr(x, "ctypes", None), "data", None)
    if b.dtype != dtype or b.ptr != own and b.obj is not x:
        raise NativeUnavailable(f"cannot write into a {b.dtype} or non-contiguous tensor in place")
    return b


def _in_place_all(kind, xs, dtype: str) -> list:
    """``_in_place`` of each of ``xs``: checked once for a kept list (its buffers are
    ``_same_kind_all``'s)."""
    # a TensorBuf is a contiguous tensor's own memory: in place as it is, where of ``dtype``
    return list(_derived_once(xs, ("in place", dtype), lambda: [
        b if type(b) is TensorBuf and b.dtype == dtype else _in_place(kind, x, dtype, b)
        for x, b in zip(xs, _same_kind_all(kind, xs))]))


def _derived_once(xs, key, make):
    """``make()``, made once for a kept list ``xs`` (``grace.core.buffers.Pieces``: the same
    tensors step after step, ``derive`` keeps it with them under ``key``); made each time for
    another list."""
    derive = getattr(xs, "derive", None)
    return make() if derive is None else derive(key, make)


def _cpu_kind(x):
    kind = kind_of(x)
    if kind.lib.kind != "cpu":
        raise NativeUnavailable("a CPU-only entry point (bucket at once, or draws made inside)")
    return kind


def _head(kind, buf: Buf, count: int):
    """The first ``count`` elements of a capacity buffer, as a compact array."""
    obj = buf.obj[:count]
    if count < buf.n // 2:
        obj = obj.clone() if kind.name == "torch" else (obj.copy() if hasattr(obj, "copy") else obj)
    return obj


def _wrap(kind, *results):
    kind.sync()
    out = tuple(kind.wrap(r.obj if isinstance(r, Buf) else r) for r in results)
    return out[0] if len(out) == 1 else out


def _decode_out(kind, numel: int) -> Buf:
    return kind.empty(int(numel), "float32")


# --- C arrays of a bucket's pointers and sizes ----------------------------------------------------
def _pointers(bufs):
    """A C array of the buffers' pointers."""
    return c_array(ctypes.c_void_p, len(bufs))(*[b.ptr for b in bufs])


def _pointers_of(xs, bufs):
    """``_pointers(bufs)``, ``bufs`` being ``_same_kind_all(kind, xs)`` (or ``_in_place_all``'s: the
    same buffers): made once for a kept list ``xs``."""
    return _derived_once(xs, "pointers", lambda: _pointers(bufs))


def _float32_all(kind, xs, what: str, in_place: bool = False):
    """A bucket's list of float32 tensors as (their buffers, ``_in_place_all``'s where ``in_place``;
    their sizes, a tuple; a C array of their pointers): checked and made once for a kept list."""
    def make():
        bufs = _in_place_all(kind, xs, "float32") if in_place else _same_kind_all(kind, xs)
        return bufs, _derived_once(xs, "float32 sizes", lambda: _float32_sizes(bufs, what)), _pointers_of(xs, bufs)

    return _derived_once(xs, ("float32", in_place), make)


def _float32_sizes(bufs, what: str) -> tuple:
    """The buffers' sizes, each checked float32 (``what`` takes no other)."""
    if any(b.dtype != "float32" for b in bufs):
        raise NativeUnavailable(f"{what} takes float32 tensors")
    return tuple(b.n for b in bufs)


def _addresses(buf: Buf, byte_offsets):
    """A C array of the addresses at ``byte_offsets`` in ``buf``: each gradient's place in an
    output shared by a bucket."""
    return c_array(ctypes.c_void_p, len(byte_offsets))(*[buf.ptr + o for o in byte_offsets])


def _c_view(ctype, array):
    """A C array over a NumPy array's memory (which the caller keeps until the call)."""
    return c_array(ctype, len(array)).from_buffer(array)


def _every(addresses, first: int, step: int):
    """A C array of ``addresses[first::step]``: one payload tensor's place for each gradient."""
    chosen = addresses[first::step]
    return c_array(ctypes.c_void_p, len(chosen))(*chosen)


def _int64s(values):
    """A C array of ``values``; made once per tuple (a bucket's segment sizes and starts: the
    segment wrappers are called per bucket and rank every step, and read it only)."""
    return _int64s_of(values) if type(values) is tuple else c_array(ctypes.c_int64, len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _int64s_of(values: tuple):
    return c_array(ctypes.c_int64, len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _packed_total(numels: tuple, bits: int) -> int:
    """The bytes of every segment's codes of ``bits`` bits, packed segment by segment."""
    return sum(packed_size(n, bits) for n in numels)


def _index_codes(dtypes):
    """A C array of the index types' codes (INDEX_CODES)."""
    return c_array(ctypes.c_int, len(dtypes))(*[INDEX_CODES[d] for d in dtypes])


def _seed_word_arrays(words):
    """Seeds' two 32-bit words (grace.core.draws.seed_words) as two C arrays (over the uint32
    arrays of a bucket's, ``grace.core.draws.BucketWords``, where given)."""
    columns = getattr(words, "columns", None)
    if columns is not None:
        return tuple(_c_view(ctypes.c_uint32, c) for c in columns)
    return (c_array(ctypes.c_uint32, len(words))(*[w[i] for w in words]) for i in (0, 1))


# --- payload tensors placed in one buffer ---------------------------------------------------------
def _one_buffer(kind):
    """The ``into`` of a bucket call given none: its payload tensors in one new uint8 buffer,
    the widest items first (so each tensor is aligned to its item)."""
    def into(dtypes, counts):
        offsets, end = [0] * len(dtypes), 0
        for i in sorted(range(len(dtypes)), key=lambda i: -ITEMSIZE[dtypes[i]]):
            offsets[i], end = end, end + counts[i] * ITEMSIZE[dtypes[i]]
        return kind.empty(end, "uint8").obj, offsets

    return into


def _placed(kind, into, dtypes, counts):
    """A bucket call's payload tensors (``dtypes`` and ``counts``: each one's, gradient after
    gradient) where ``into(dtypes, counts)`` places them in a uint8 buffer of the caller's:
    (that buffer, each tensor's byte offset in it[, a dict the caller keeps with the buffer]),
    say a bucket's frame, which then needs no join of its pieces; in one new buffer where
    ``into`` is None. (each tensor's address, each tensor as a view of the buffer). A kept
    buffer's views are made once per layout and kept in its dict (a view per piece costs more
    than the kernel on small gradients); it holds the latest layout's only."""
    buffer, offsets, *with_buffer = (into or _one_buffer(kind))(dtypes, counts)
    b = _in_place(kind, buffer, "uint8")
    if with_buffer:
        kept, key = with_buffer[0], (tuple(dtypes), tuple(counts), tuple(offsets))
        made = kept.get(key)
        if made is not None and made[0] == (b.ptr, b.n):
            return made[1], made[2]
        kept.clear()
        addresses, views = _placed_views(kind, b, dtypes, counts, offsets)
        kept[key] = made = ((b.ptr, b.n), tuple(addresses), tuple(views))  # (read only: shared by the steps)
        return made[1], made[2]
    return _placed_views(kind, b, dtypes, counts, offsets)


def _check_places(b: Buf, dtypes, counts, offsets) -> None:
    """Each piece of ``counts[i]`` ``dtypes[i]`` at byte ``offsets[i]`` aligned and inside ``b``
    (the kernels write through its address)."""
    for dtype, count, offset in zip(dtypes, counts, offsets):
        size = ITEMSIZE[dtype]
        if offset % size or offset < 0 or offset + count * size > b.n:
            raise ValueError(f"{count} {dtype} at byte {offset} do not fit a buffer of {b.n} bytes")


def _placed_views(kind, b: Buf, dtypes, counts, offsets):
    _check_places(b, dtypes, counts, offsets)
    typed, views = {}, []
    for dtype, count, offset in zip(dtypes, counts, offsets):
        size = ITEMSIZE[dtype]
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = kind.typed(b.obj[:b.n - b.n % size], dtype)
        views.append(whole[offset // size:offset // size + count])
    return [b.ptr + offset for offset in offsets], views


# --- segments: a bucket's gradients in one flat buffer --------------------------------------------
def _on_gpu(kind) -> bool:
    return kind.lib.kind == "cuda"


_DECODE = {"sign_decode": 0, "onebit_decode": 1, "terngrad_decode": 2, "qsgd_decode": 3, "natural_decode": 4}


def _decode_segments(kind, symbol: str, numels, a: Buf, b, out: Buf, levels: int = 0, bucket_size: int = 0,
                     bits: int = 0):
    """Every segment's ``symbol`` decompression into ``out``, in one call (GPU)."""
    call(kind, "decode_segments", _DECODE[symbol], len(numels), _int64s(numels), a.ptr,
         b.ptr if b is not None else None, int(levels), int(bucket_size), int(bits), out.ptr)


def _check_segments(n: int, starts, numels, what: str = "elements") -> None:
    """Every segment inside the buffer of ``n`` elements (the kernels write through pointers)."""
    if type(starts) is tuple and type(numels) is tuple:
        _segments_fit(n, starts, numels, what)  # (a bucket's layout, checked once)
    else:
        _segments_fit.__wrapped__(n, starts, numels, what)


@functools.lru_cache(maxsize=1024)
def _segments_fit(n: int, starts, numels, what: str) -> None:
    if len(starts) != len(numels) or any(s < 0 or c < 0 or s + c > n for s, c in zip(starts, numels)):
        raise ValueError(f"segments (starts {list(starts)[:4]}..., sizes {list(numels)[:4]}...) "
                         f"do not fit in {n} {what}")


def _drawn_segments(x, starts, numels, words, draws):
    """The flat float32 ``x`` with every segment in it checked, and each segment's seed words
    (``draws[s]`` draws of them, at most 2**32) as two C arrays: (kind, x, s0, s1)."""
    kind = kind_of(x)
    b = _float32(kind, x, ("float32",))
    _check_segments(b.n, starts, numels)
    if len(words) != len(numels) or any(d > 2**32 for d in draws):
        raise ValueError(f"{len(words)} seeds for {len(numels)} segments (at most 2**32 draws each)")
    return (kind, b, *_seed_word_arrays(words))


def _draws(kind, u, n: int) -> Buf:
    ub = _same_kind(kind, u, "float32")
    if ub.n < n:
        raise ValueError(f"{ub.n} uniform draws for {n} elements")
    return ub


def _check_payload(buf, want: int, what: str) -> None:
    if buf.n != want:
        raise ValueError(f"{buf.n} {what} where the segments need {want}")


# --- error feedback and decoded sums, a bucket in one call (CPU) ----------------------------------
def _flag(kind, nonfinite):
    """The bucket calls' ``nonfinite`` argument as the C one: a one-element float32 tensor that
    receives the overflow flag (1 where any gradient holds an inf or a NaN, else 0; each
    gradient checked just before its step reads it, so no pass of its own), or None."""
    if nonfinite is None:
        return None
    b = _in_place(kind, nonfinite, "float32")
    if b.n != 1:
        raise ValueError("the overflow flag is one float32 element")
    return b.ptr


def _ef_inputs(g, residual, out):
    """A residual step's gradient, residual and output (new where ``out`` is None) as buffers:
    (kind, gradient, residual, output)."""
    kind = kind_of(g)
    gb = kind.flat(g)
    rb = _same_kind(kind, residual)
    if gb.dtype != "float32" or rb.dtype != "float32":
        raise NativeUnavailable("the fused error-feedback step takes float32 gradients and residuals")
    if gb.n != rb.n:
        raise ValueError(f"gradient has {gb.n} elements, residual {rb.n}")
    ob = kind.empty(gb.n, "float32") if out is None else _same_kind(kind, out)
    if ob.n != gb.n or ob.dtype != "float32":
        raise ValueError("out must be a float32 array of the gradient's size")
    return kind, gb, rb, ob


def _ef_many_inputs(gs, residuals, outs):
    """A bucket's gradients, residuals and outputs (new ones where ``outs`` is None) as the
    buffers of a bucket-at-once residual step (CPU): (kind, gradients, residuals, outputs, their
    sizes (a tuple), a C array of each list's pointers). Sizes and pointers are ``_float32_all``'s:
    made once for the kept lists (an exchange's residuals and outputs)."""
    kind = _cpu_kind(gs[0])
    what = "the fused error-feedback step"
    (gb, numels, g_ptrs), (rb, r_numels, r_ptrs) = (_float32_all(kind, xs, what) for xs in (gs, residuals))
    if outs is None:
        ob = [kind.empty(n, "float32") for n in numels]
        o_numels, o_ptrs = numels, _pointers(ob)
    else:
        ob, o_numels, o_ptrs = _float32_all(kind, outs, what, in_place=True)
    if not numels == r_numels == o_numels:  # (tuples: a bucket's compared at once)
        raise ValueError("every gradient, residual and output of a bucket must have the same size")
    return kind, gb, rb, ob, numels, (g_ptrs, r_ptrs, o_ptrs)


def _outputs(ob, outs) -> list:
    """A bucket call's outputs: ``outs`` as the caller gave them, where the call wrote into them
    (a flat view of each, made per step, would cost more than the kernel on small gradients),
    else the new ones."""
    return list(outs) if outs is not None else [o.obj for o in ob]


def _ef_flags(beta: float, gamma: float) -> int:
    return (1 if float(gamma) != 1.0 else 0) | (2 if float(beta) != 1.0 else 0)


def _finish_args(finish):
    """A decoded sum's finish, (vote, divisors) (see Compressor.finish), as the C arguments."""
    vote, divisors = finish if finish is not None else (False, ())
    if len(divisors) > 4:
        raise ValueError("at most 4 divisors")
    return int(bool(vote)), c_array(ctypes.c_float, max(1, len(divisors)))(*divisors), len(divisors)


def _rows(buf: Buf, count: int, itemsize: int, per_row: int):
    """A C array of the pointers to ``count`` rows of ``per_row`` items in a row in ``buf``."""
    return c_array(ctypes.c_void_p, count)(*[buf.ptr + j * per_row * itemsize for j in range(count)])


def _check_sums(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"the payloads are not rows of {what}")
