"""Native kernels (csrc/): bit packing, fused quantize+pack, selection, error feedback, scatter-add.

Every function takes NumPy arrays, torch tensors (CPU; CUDA when libgrace_cuda is built) or
TensorFlow eager tensors (CPU through NumPy, GPU through DLPack), of any shape (read flat), and
returns arrays of the same kind on the same device; CUDA tensors never leave the GPU. The
results equal the pure tensor-op code's byte for byte (tests/native): codes, packed bytes,
indices, values and, on the CPU, the float32 scalars too (NumPy's pairwise summation is
reproduced); on a GPU, sums (norms, means, L1 scale) are deterministic but in another order.

Random methods take their uniform draws ``u`` (float32, one per element, as ``xp.uniform``
gives them) as an input: generating them is not part of the kernel.

When a library is missing, or ``GRACE_NATIVE=0``, or ``with disabled():``, the functions raise
``NativeUnavailable``; ``supports(x)`` says beforehand. The ``try_*`` functions (used by
TorchBackend) return None on ``NativeUnavailable`` only, and the caller
takes its tensor-op path; any other error propagates. ``FUSED`` is the table of the one-pass
functions a compressor may ask a backend for: their C functions, output dtypes and devices.

    ops                                   fused compress / decompress (float32 flat out)
    pack(codes, bits)                     signsgd_compress(x) -> packed
    unpack(packed, bits, numel)           signsgd_decompress(packed, numel)
    topk_indices(x, k, ...)               efsignsgd_compress(x) -> (packed, scale)
    threshold_indices(x, thr, ...)        efsignsgd_decompress(packed, scale, numel)
    nonzero(mask, ...)                    onebit_compress(x) -> (packed, means)
    scatter_add(indices, values, numel)   onebit_decompress(packed, means, numel)
    scatter_add_many(payloads, numel)     terngrad_compress(x, u, scale=None) -> (packed, scale)
    topk_compress(x, k)                   terngrad_decompress(packed, scale, numel)
    threshold_compress(x, thr)            qsgd_compress(x, u, levels, bucket_size=0, norms=None)
    topk_ef_step(g, r, k, ...)              -> (packed, norms)
    threshold_ef_step(g, r, thr, ...)     qsgd_decompress(packed, norms, numel, levels, bucket_size=0)
                                          natural_compress(x, u) -> (signs, codes)
                                          natural_, terngrad_, qsgd_compress_drawn(x, words, ...): the
                                            same with the draws made inside (CPU)
                                          natural_decompress(signs, codes, numel)
    segment by segment (a bucket's flat buffer; the per-tensor kernels for each segment):
    efsignsgd_compress_segments(x, starts, numels), efsignsgd_decompress_segments(packed, scale, numels)
    onebit_compress_segments(x, starts, numels), onebit_decompress_segments(packed, means, numels)
    every rank's payload of one tensor decoded and summed (the rows concatenated):
    signsgd_decompress_sum(packed_rows, numel), efsignsgd_decompress_sum(packed_rows, scales, numel),
    onebit_decompress_sum(packed_rows, means, numel)
    terngrad_, qsgd_, natural_compress_segments(x, starts, numels, u, draw_starts, ...) and their
    _decompress_segments(..., numels, ...); topk_compress_segments(x, starts, numels, ks),
    topk_ef_step_segments(g, residual, starts, numels, ks, beta, gamma, out)
    a bucket in one call on the CPU, each gradient at its own pointers (lists in, lists out):
    topk_ef_step_many(gs, residuals, ks, beta, gamma, outs), randomk_ef_step_many(gs, residuals, indices, ...),
    threshold_ef_step_many(gs, residuals, thresholds, beta, gamma, outs),
    dgc_step_many(gs, us, vs, momentum, ratio, sample_ratio, words, u_outs, v_outs),
    compress_many(method, xs, words, levels, bucket_size): signSGD's, TernGrad's, QSGD's, natural's payloads,
    scatter_add_segments_into(payloads, outs, divisor),
    signsgd_, efsignsgd_, onebit_decompress_sum_into(payloads, outs); efsignsgd_, onebit_residual_into(p, ..., out);
    efsignsgd_, onebit_ef_step_many(gs, residuals, beta, gamma, outs);
    fp16_compress_many_into(xs, divisor, outs), fp16_decompress_many_into(halves, factor, divisor, outs),
    PowerSGD's products for a bucket's matrices: lowrank_project_many(ms, qs, shapes, residuals, m_outs),
    lowrank_back_many(ms, ps, shapes, unit), lowrank_expand_many(ps, qs, shapes, outs, divisor, ms,
    residual_outs); lowrank_project, lowrank_back, lowrank_expand: the same for one matrix
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from grace.formats import ITEMSIZE, code_width, index_dtype, packed_size, qsgd_bucket
from grace.native._arrays import (DTYPE_CODES, INDEX_CODES, Buf, NativeUnavailable, TensorBuf, call, dlpack_info,
                                  kind_of, same_device)
from grace.native import _arrays
from grace.native._loader import cpu_build, cpu_isa, disabled, enabled, library, load_error, set_enabled

__all__ = [
    "FUSED", "Kernel", "NativeUnavailable", "available", "compress_many", "cpu_build", "cpu_isa", "dgc_compensate_into",
    "dgc_step_many", "disabled", "dlpack_info", "efsignsgd_compress", "efsignsgd_compress_segments",
    "efsignsgd_decompress", "efsignsgd_decompress_segments", "efsignsgd_decompress_sum",
    "efsignsgd_decompress_sum_into", "efsignsgd_ef_step_many", "efsignsgd_residual_into", "enabled",
    "fp16_compress_many_into", "fp16_decompress_many_into", "frame_pieces", "fused", "hash_keys_segments", "load_error",
    "lowrank_back", "lowrank_back_many", "lowrank_expand", "lowrank_expand_many", "lowrank_project",
    "lowrank_project_many",
    "natural_compress", "natural_compress_drawn", "natural_compress_segments", "natural_decompress",
    "natural_decompress_segments", "natural_decompress_sum", "natural_decompress_sum_into", "nonzero", "norm",
    "onebit_compress", "onebit_compress_segments", "onebit_decompress", "onebit_decompress_segments",
    "onebit_decompress_sum", "onebit_decompress_sum_into", "onebit_ef_step_many", "onebit_residual_into", "pack",
    "qsgd_compress", "qsgd_compress_drawn", "qsgd_compress_segments", "qsgd_decompress", "qsgd_decompress_segments",
    "qsgd_decompress_sum", "qsgd_decompress_sum_into", "random_indices_segments", "randomk_ef_step_many", "scatter_add",
    "scatter_add_many", "scatter_add_segments_into", "set_enabled", "set_num_threads", "signsgd_compress",
    "signsgd_decompress", "signsgd_decompress_sum", "signsgd_decompress_sum_into", "supports", "terngrad_compress",
    "terngrad_compress_drawn", "terngrad_compress_segments", "terngrad_decompress", "terngrad_decompress_segments",
    "terngrad_decompress_sum", "terngrad_decompress_sum_into", "threshold_compress", "threshold_ef_step",
    "threshold_ef_step_many", "threshold_indices", "topk_compress", "topk_compress_segments", "topk_ef_step",
    "topk_ef_step_many", "topk_ef_step_segments", "topk_indices", "uniform_segments", "unpack",
]

_FLOATS = ("float16", "bfloat16", "float32")


# --- status -------------------------------------------------------------------------------------
def available(device: str = "cpu") -> bool:
    """Whether the 'cpu' or 'cuda' library is loaded (and native dispatch is enabled)."""
    return library(device) is not None


def supports(x) -> bool:
    """Whether the fused functions run natively on ``x`` (its kind, device and a float dtype
    they take: float16, bfloat16, float32; the quantizers other than signSGD also float64)."""
    try:
        kind = kind_of(x)
    except NativeUnavailable:
        return False
    name = kind.name
    if name == "torch":
        dtype = str(x.dtype)[6:]
    elif name == "numpy":
        dtype = x.dtype.name
    else:
        dtype = x.dtype.name
    return dtype in _FLOATS


def set_num_threads(n: int) -> None:
    """Threads of the CPU kernels (<= 0: OpenMP's default, OMP_NUM_THREADS or all cores)."""
    lib = library("cpu")
    if lib is not None:
        lib.set_num_threads(int(n))


# --- helpers ------------------------------------------------------------------------------------
def _float32(kind, x, allow=_FLOATS + ("float64",)) -> Buf:
    b = kind.flat(x)
    if b.dtype not in allow:
        raise TypeError(f"native kernels take {', '.join(allow)} tensors, got {b.dtype}")
    return b if b.dtype == "float32" else kind.flat(b.obj, "float32")


def _same_kind(kind, x, dtype=None) -> Buf:
    """``x`` as a flat buffer for ``kind`` (same toolkit and device as the first input)."""
    if type(x) is Buf:  # a frame's piece (frame_pieces): taken as it is
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
    path: the per-tensor checks cost more than the kernels on small tensors."""
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


def frame_pieces(data, starts, layouts):
    """The pieces of the frames in the contiguous uint8 tensor ``data`` (an allgather's result),
    as buffers that the bucket-at-once entry points take in place of tensors: no tensor view
    made per piece (CPU). Frame r starts at byte ``starts[r]``; ``layouts[r]`` gives each of its
    pieces' (byte offset in the frame, element count, dtype). A list of pieces per frame."""
    kind = _cpu_kind(data)
    b = kind.flat(data)
    if b.dtype != "uint8":
        raise ValueError(f"frames are uint8, got {b.dtype}")
    rows = []
    for start, layout in zip(starts, layouts):
        if any(start + offset + count * ITEMSIZE[dtype] > b.n for offset, count, dtype in layout):
            raise ValueError(f"a piece past the end of {b.n} bytes of frames")
        rows.append([Buf(None, b.ptr + start + offset, count, dtype, keep=data) for offset, count, dtype in layout])
    return rows


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


def _pointers(bufs):
    """A C array of the buffers' pointers."""
    return (ctypes.c_void_p * len(bufs))(*[b.ptr for b in bufs])


def _addresses(buf: Buf, byte_offsets):
    """A C array of the addresses at ``byte_offsets`` in ``buf``: each gradient's place in an
    output shared by a bucket."""
    return (ctypes.c_void_p * len(byte_offsets))(*[buf.ptr + o for o in byte_offsets])


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
    (that buffer, each tensor's byte offset in it), say a bucket's frame, which then needs no
    join of its pieces; in one new buffer where ``into`` is None. (each tensor's address, each
    tensor as a view of the buffer)."""
    buffer, offsets = (into or _one_buffer(kind))(dtypes, counts)
    b = _in_place(kind, buffer, "uint8")
    typed, views = {}, []
    for dtype, count, offset in zip(dtypes, counts, offsets):
        size = ITEMSIZE[dtype]
        if offset % size or offset < 0 or offset + count * size > b.n:
            raise ValueError(f"{count} {dtype} at byte {offset} do not fit a buffer of {b.n} bytes")
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = kind.typed(b.obj[:b.n - b.n % size], dtype)
        views.append(whole[offset // size:offset // size + count])
    return [b.ptr + offset for offset in offsets], views


def _every(addresses, first: int, step: int):
    """A C array of ``addresses[first::step]``: one payload tensor's place for each gradient."""
    chosen = addresses[first::step]
    return (ctypes.c_void_p * len(chosen))(*chosen)


def _int64s(values):
    """A C array of ``values``; made once per tuple (a bucket's segment sizes and starts: the
    segment wrappers are called per bucket and rank every step, and read it only)."""
    return _int64s_of(values) if type(values) is tuple else (ctypes.c_int64 * len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _int64s_of(values: tuple):
    return (ctypes.c_int64 * len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _packed_total(numels: tuple, bits: int) -> int:
    """The bytes of every segment's codes of ``bits`` bits, packed segment by segment."""
    return sum(packed_size(n, bits) for n in numels)


def _index_codes(dtypes):
    """A C array of the index types' codes (INDEX_CODES)."""
    return (ctypes.c_int * len(dtypes))(*[INDEX_CODES[d] for d in dtypes])


def _seed_word_arrays(words):
    """Seeds' two 32-bit words (grace.core.draws.seed_words) as two C arrays."""
    return ((ctypes.c_uint32 * len(words))(*[w[i] for w in words]) for i in (0, 1))


def _index_buf(kind, idx, b: Buf = None) -> Buf:
    """Indices as a buffer of an index type the kernels take (int64 otherwise); ``b``:
    ``_same_kind``'s buffer of idx, where made already."""
    b = _same_kind(kind, idx) if b is None else b
    if b.dtype not in INDEX_CODES and b.obj is None:
        raise NativeUnavailable(f"a frame's {b.dtype} indices")
    if b.dtype not in INDEX_CODES:
        b = _same_kind(kind, b.obj, "int64")
    return b


# --- bit packing --------------------------------------------------------------------------------
def pack(codes, bits: int):
    """uint8 codes (each < 2**bits; bool or other dtypes are cast to uint8) -> packed uint8,
    ceil(numel * bits / 8) bytes; grace.core.bits.pack's format."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    kind = kind_of(codes)
    c = kind.flat(codes)
    if c.dtype != "uint8" and not (c.dtype == "bool" and bits < 8):
        c = kind.flat(c.obj, "uint8")
    if bits == 8:
        return _wrap(kind, c)
    out = kind.empty(packed_size(c.n, bits), "uint8")
    call(kind, "pack", c.ptr, c.n, bits, out.ptr)
    return _wrap(kind, out)


def unpack(packed, bits: int, numel: int):
    """packed uint8 -> the first ``numel`` codes (uint8); 8 bits: ``packed`` itself, as
    grace.core.bits.unpack returns it."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits == 8:
        return packed
    kind = kind_of(packed)
    p = kind.flat(packed)
    if p.dtype != "uint8":
        raise TypeError(f"packed codes are uint8, got {p.dtype}")
    if p.n < packed_size(numel, bits):
        raise ValueError(f"{p.n} bytes hold fewer than {numel} codes of {bits} bits")
    out = kind.empty(numel, "uint8")
    call(kind, "unpack", p.ptr, numel, bits, out.ptr)
    return _wrap(kind, out)


# --- selection ----------------------------------------------------------------------------------
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


# --- scatter-add --------------------------------------------------------------------------------
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


# --- fused quantizers ---------------------------------------------------------------------------
def signsgd_compress(x):
    """signSGD's payload: bits (x >= 0) packed 8 to a byte. float16/bfloat16/float32."""
    kind = kind_of(x)
    b = _float32(kind, x, _FLOATS)
    out = kind.empty(packed_size(b.n, 1), "uint8")
    call(kind, "sign_pack", b.ptr, b.n, 0, out.ptr)
    return _wrap(kind, out)


def _decode_out(kind, numel: int) -> Buf:
    return kind.empty(int(numel), "float32")


def signsgd_decompress(packed, numel: int):
    """float32 +-1 (2 * bit - 1)."""
    kind = kind_of(packed)
    p = kind.flat(packed)
    out = _decode_out(kind, numel)
    call(kind, "sign_decode", p.ptr, out.n, None, out.ptr)
    return _wrap(kind, out)


def efsignsgd_compress(x):
    """EF-signSGD's payload: (bits (x >= 0), scale = [sum |x| / max(1, d)])."""
    kind = kind_of(x)
    b = _float32(kind, x)
    out = kind.empty(packed_size(b.n, 1), "uint8")
    scale = kind.empty(1, "float32")
    call(kind, "efsign_compress", b.ptr, b.n, out.ptr, scale.ptr)
    return _wrap(kind, out, scale)


def efsignsgd_decompress(packed, scale, numel: int):
    """float32 (2 * bit - 1) * scale[0]."""
    kind = kind_of(packed)
    p, s = kind.flat(packed), _same_kind(kind, scale, "float32")
    out = _decode_out(kind, numel)
    call(kind, "sign_decode", p.ptr, out.n, s.ptr, out.ptr)
    return _wrap(kind, out)


def onebit_compress(x):
    """1-bit SGD's payload: (bits (x >= 0), means [mu0, mu1] of the elements < 0 and >= 0)."""
    kind = kind_of(x)
    b = _float32(kind, x)
    out = kind.empty(packed_size(b.n, 1), "uint8")
    means = kind.empty(2, "float32")
    call(kind, "onebit_compress", b.ptr, b.n, out.ptr, means.ptr)
    return _wrap(kind, out, means)


def onebit_decompress(packed, means, numel: int):
    """float32 mu0 + bit * (mu1 - mu0)."""
    kind = kind_of(packed)
    p, m = kind.flat(packed), _same_kind(kind, means, "float32")
    out = _decode_out(kind, numel)
    call(kind, "onebit_decode", p.ptr, out.n, m.ptr, out.ptr)
    return _wrap(kind, out)


# --- the sign family's aggregate: every rank's bits decoded and added in one pass -------------
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


# --- the sign family, segment by segment: a bucket's gradients in one call ------------------
# Each segment goes through the very kernels of the per-tensor functions above (its bits packed
# from a byte of its own, its own scale), so the results are the per-tensor ones, with one
# Python call per bucket instead of several per gradient. On a GPU one launch per kernel serves
# all segments (grace_cuda_*_segments: the per-tensor kernels' code on each segment's blocks);
# on a CPU (where buckets go gradient by gradient) the per-tensor kernels run segment by segment.
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


def _draws(kind, u, n: int) -> Buf:
    ub = _same_kind(kind, u, "float32")
    if ub.n < n:
        raise ValueError(f"{ub.n} uniform draws for {n} elements")
    return ub


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


def terngrad_compress_drawn(x, words):
    """``terngrad_compress(x, u)`` with u the counter-based draws of the seed words ``words``
    (as ``natural_compress_drawn``), its scale found in the same call (CPU)."""
    kind = _cpu_kind(x)
    b = _float32(kind, x)
    scale = kind.empty(1, "float32")
    out = kind.empty(packed_size(b.n, 2), "uint8")
    call(kind, "terngrad_compress_drawn", b.ptr, b.n, int(words[0]), int(words[1]), scale.ptr, out.ptr)
    return _wrap(kind, out, scale)


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


_COMPRESS_MANY = {"signsgd": 0, "terngrad": 1, "qsgd": 2, "natural": 3}


def compress_many(method: str, xs, words=None, levels: int = 0, bucket_size: int = 0, nonfinite=None, into=None):
    """The payloads of every gradient of a bucket in one call (CPU): signsgd_compress, or
    terngrad_, qsgd_ or natural_compress_drawn with each gradient's seed words ``words[s]``, of
    each of the float32 ``xs``. A list of payloads, each a tuple of views of one buffer per
    payload tensor (the same tensors as the per-gradient functions return), or of the buffer
    ``into`` gives (see ``_placed``). The overflow flag into ``nonfinite`` (see ``_flag``)."""
    kind = _cpu_kind(xs[0])
    xb = _same_kind_all(kind, xs)
    if any(b.dtype != "float32" for b in xb):
        raise NativeUnavailable("compress_many takes float32 gradients")
    numels = [b.n for b in xb]
    bits = code_width(2 * (levels + 1)) if method == "qsgd" else 0
    fields = {  # each payload tensor: its dtype and size per gradient
        "signsgd": [("uint8", [packed_size(n, 1) for n in numels])],
        "terngrad": [("uint8", [packed_size(n, 2) for n in numels]), ("float32", [1] * len(numels))],
        "qsgd": [("uint8", [packed_size(n, bits) for n in numels]),
                 ("float32", [_qsgd_rows(n, bucket_size) for n in numels])],
        "natural": [("uint8", [packed_size(n, 1) for n in numels]), ("uint8", numels)],
    }[method]
    addresses, views = _placed(kind, into, [dtype for _ in numels for dtype, _ in fields],
                               [sizes[s] for s in range(len(numels)) for _, sizes in fields])
    k = len(fields)
    places = [_every(addresses, f, k) for f in range(k)]
    payloads = [tuple(views[k * s:k * s + k]) for s in range(len(numels))]
    s0, s1 = _seed_word_arrays(words if words is not None else [(0, 0)] * len(xb))
    if call(kind, "compress_many", _COMPRESS_MANY[method], len(xb), _pointers(xb), _int64s(numels), s0, s1, places[0],
            places[-1] if len(places) > 1 else None, int(levels), int(bucket_size), bits, _flag(kind, nonfinite)) != 0:
        raise ValueError(f"bad {method} parameters: levels={levels}, bits={bits}")
    return payloads


def natural_decompress(signs, codes, numel: int):
    """float32 (-1)^sign * 2^(code - 127) (0 for code 0)."""
    kind = kind_of(signs)
    s, c = kind.flat(signs), _same_kind(kind, codes)
    out = _decode_out(kind, numel)
    call(kind, "natural_decode", s.ptr, c.ptr, out.n, out.ptr)
    return _wrap(kind, out)


# --- PowerSGD ----------------------------------------------------------------------------------------
def _lowrank_buffers(kind, inputs, outputs=()):
    """PowerSGD's float32 matrices as buffers (the short path for contiguous CPU tensors: these
    calls come per gradient), then the outputs written in place."""
    ins = _same_kind_all(kind, inputs)
    if any(b.dtype != "float32" for b in ins):
        raise NativeUnavailable("PowerSGD's products take float32 matrices")
    return ins + (_in_place_all(kind, outputs, "float32") if outputs else [])


def _rank(n: int, rows: int, cols: int, factor: int, factor_rows: int) -> int:
    """r of a factor_rows x r factor beside a rows x cols matrix of n elements."""
    r = factor // factor_rows if factor_rows > 0 else 0
    if rows < 1 or cols < 1 or n != rows * cols or r < 1 or factor != factor_rows * r:
        raise ValueError(f"a {rows} x {cols} matrix and a {factor_rows} x r factor are needed, "
                         f"got {n} and {factor} elements")
    return r


def lowrank_project_many(ms, qs, shapes, residuals=None, m_outs=None, nonfinite=None):
    """PowerSGD's first product for many matrices in one call (CPU): for each s, p_s = M_s q_s,
    flat (rows x r, row-major), for M_s the rows x cols (``shapes[s]``) float32 matrix in
    ``ms[s]``, or, where ``residuals[s]`` is given (not None), M_s = ms[s] + residuals[s] written
    into ``m_outs[s]`` in the same pass. ``nonfinite`` (a one-element float32 tensor, optional)
    is set to 1 where an ms[s] holds an inf or a NaN and left as it is otherwise (a bucket's
    gradients share one). Each element is summed in one fixed order on every build and thread
    count. Returns the p_s, views of one new buffer."""
    kind = _cpu_kind(ms[0])
    mb, qb = _lowrank_buffers(kind, ms), _lowrank_buffers(kind, qs)
    ranks = [_rank(m.n, rows, cols, q.n, cols) for m, q, (rows, cols) in zip(mb, qb, shapes)]
    sums = outs = None
    if residuals is not None:
        sums, outs = _where_given(kind, residuals, m_outs)
        if any(e is not None and not e.n == o.n == m.n for e, o, m in zip(sums, outs, mb)):
            raise ValueError("each residual and m_out must have its matrix's size")
    flag = None
    if nonfinite is not None:
        (flag,) = _lowrank_buffers(kind, [], [nonfinite])
        if flag.n != 1:
            raise ValueError("the overflow flag is one float32 element")
    ps, places = _factors(kind, [rows * r for (rows, _), r in zip(shapes, ranks)])
    call(kind, "lowrank_project_many", len(mb), _pointers(mb), _maybe_pointers(sums), *_shapes(shapes), _pointers(qb),
         _int64s(ranks), _maybe_pointers(outs), places, flag and flag.ptr)
    return _wrap_list(kind, ps)


def lowrank_back_many(ms, ps, shapes, unit: bool = False):
    """PowerSGD's second product for many matrices in one call (CPU): q_s = M_s^T p_s, flat
    (cols x r, row-major), for the rows x cols float32 matrix M_s in ``ms[s]`` and p_s rows x
    r, each element summed over the rows in order. ``unit``: each p_s of one column is first
    made p / |p| in place (the squares summed in float64, in order; the first unit vector
    where p is zero), as the backends' ``orthonormalize``. Returns the q_s, views of one new buffer."""
    kind = _cpu_kind(ms[0])
    mb = _lowrank_buffers(kind, ms)
    pb = _in_place_all(kind, ps, "float32")
    ranks = [_rank(m.n, rows, cols, p.n, rows) for m, p, (rows, cols) in zip(mb, pb, shapes)]
    qs, places = _factors(kind, [cols * r for (_, cols), r in zip(shapes, ranks)])
    call(kind, "lowrank_back_many", len(mb), _pointers(mb), *_shapes(shapes), _pointers(pb), _int64s(ranks), int(unit),
         places)
    return _wrap_list(kind, qs)


def lowrank_expand_many(ps, qs, shapes, outs, divisor: float = 1.0, ms=None, residual_outs=None):
    """PowerSGD's approximation for many matrices in one call (CPU): q'_s = q_s / ``divisor``
    (flat, views of one new buffer), then p_s q'_s^T (rows x cols, flat) into ``outs[s]`` (a
    new tensor where None; not ms[s]), and where ``residual_outs[s]`` is given, ms[s] - p_s
    q'_s^T into it in the same pass (it may be ms[s]). Returns (the approximations, the q'_s)."""
    kind = _cpu_kind(ps[0])
    pb, qb = _lowrank_buffers(kind, ps), _lowrank_buffers(kind, qs)
    ranks = [_rank(rows * cols, rows, cols, p.n, rows) for p, (rows, cols) in zip(pb, shapes)]
    if any(q.n != cols * r for q, (_, cols), r in zip(qb, shapes, ranks)):
        raise ValueError("each q must be cols x r")
    made = [kind.empty(rows * cols, "float32") if o is None else None for o, (rows, cols) in zip(outs, shapes)]
    ob = [b if o is None else _lowrank_buffers(kind, [], [o])[0] for b, o in zip(made, outs)]
    mb = eb = None
    if residual_outs is not None:
        mb, eb = _where_given(kind, [None if e is None else m for m, e in zip(ms, residual_outs)], residual_outs)
    if any(o.n != rows * cols or (e is not None and not m.n == e.n == rows * cols)
           for o, m, e, (rows, cols) in zip(ob, mb or ob, eb or [None] * len(ob), shapes)):
        raise ValueError("out, m and residual_out must have rows x cols elements")
    divided, places = _factors(kind, [q.n for q in qb])
    call(kind, "lowrank_expand_many", len(pb), _pointers(pb), _pointers(qb), *_shapes(shapes), _int64s(ranks),
         float(divisor), places, _pointers(ob), _maybe_pointers(mb), _maybe_pointers(eb))
    kind.sync()
    return [o if b is None else kind.wrap(b.obj) for o, b in zip(outs, made)], [kind.wrap(q) for q in divided]


def lowrank_project(m, q, rows: int, cols: int, residual=None, m_out=None, nonfinite=None):
    """lowrank_project_many of one matrix."""
    return lowrank_project_many([m], [q], [(rows, cols)], None if residual is None else [residual],
                                None if residual is None else [m_out], nonfinite)[0]


def lowrank_back(m, p, rows: int, cols: int, unit: bool = False):
    """lowrank_back_many of one matrix (``p`` made a unit vector in place where ``unit``)."""
    return lowrank_back_many([m], [p], [(rows, cols)], unit)[0]


def lowrank_expand(p, q, rows: int, cols: int, out=None, m=None, residual_out=None, divisor: float = 1.0):
    """lowrank_expand_many of one matrix: its approximation (q divided by ``divisor`` first)."""
    return lowrank_expand_many([p], [q], [(rows, cols)], [out], divisor, None if m is None else [m],
                               None if residual_out is None else [residual_out])[0][0]


def _shapes(shapes):
    """The C arrays of a list of (rows, cols)."""
    return _int64s([rows for rows, _ in shapes]), _int64s([cols for _, cols in shapes])


def _factors(kind, sizes):
    """One new float32 buffer for factors of ``sizes`` elements: a view of it for each, and
    their addresses (a C array)."""
    buf, starts = kind.empty(sum(sizes), "float32"), [0, *itertools.accumulate(sizes[:-1])]
    return [buf.obj[o:o + n] for o, n in zip(starts, sizes)], _addresses(buf, [4 * o for o in starts])


def _wrap_list(kind, objs):
    kind.sync()
    return [kind.wrap(o) for o in objs]


def _where_given(kind, inputs, outputs):
    """Buffers of ``inputs[s]`` and ``outputs[s]`` where inputs[s] is not None, else None."""
    given = [s for s, x in enumerate(inputs) if x is not None]
    bufs = _lowrank_buffers(kind, [inputs[s] for s in given], [outputs[s] for s in given])
    ins, outs = [None] * len(inputs), [None] * len(inputs)
    for k, s in enumerate(given):
        ins[s], outs[s] = bufs[k], bufs[len(given) + k]
    return ins, outs


def _maybe_pointers(bufs):
    """A C array of the buffers' pointers (NULL for None), or NULL for no list."""
    return None if bufs is None else (ctypes.c_void_p * len(bufs))(*[b and b.ptr for b in bufs])


# --- DGC -------------------------------------------------------------------------------------------
def dgc_compensate_into(u, v, g, momentum: float, u_out, v_out):
    """DGC's momentum correction in one pass (CPU): p = v + (momentum * u + g) written into
    ``v_out`` and p - v into ``u_out`` (float32, all of one size; outputs may be inputs).
    Returns (u_out, v_out)."""
    kind = _cpu_kind(u)
    ub, vb, gb = (_same_kind(kind, t) for t in (u, v, g))
    uo, vo = _in_place(kind, u_out, "float32"), _in_place(kind, v_out, "float32")
    if any(b.dtype != "float32" for b in (ub, vb, gb)):
        raise NativeUnavailable("dgc_compensate_into takes float32 tensors")
    if not ub.n == vb.n == gb.n == uo.n == vo.n:
        raise ValueError("u, v, g and the outputs must have one size")
    call(kind, "dgc_compensate", ub.ptr, vb.ptr, gb.ptr, ub.n, float(momentum), uo.ptr, vo.ptr)
    return u_out, v_out


def dgc_step_many(gs, us, vs, momentum: float, ratio: float, sample_ratio: float, words, u_outs, v_outs,
                  nonfinite=None, scales=None):
    """DGC's step for every gradient of a bucket in one call (CPU), as DGCMemory.fused_step with
    DGC's selection makes it gradient by gradient: the momentum correction (p = v + (momentum * u
    + g) into ``v_outs``, p - v into ``u_outs``; outputs may be inputs), the threshold from a
    sample of |p| drawn from the gradient's seed words ``words[s]`` (grace.core.draws), the
    elements at or above it (the k = max(1, ceil(ratio d)) largest where more) and momentum factor
    masking. Lists of values and indices (in index_dtype(d)), per gradient; the overflow flag
    into ``nonfinite`` (see ``_flag``). ``scales`` (floats, optional): each g taken as g * scales[s]
    where it is read (DGC's clipping: one float32 product, as the tensor op makes it)."""
    kind = _cpu_kind(gs[0])
    gb, ub, vb = (_same_kind_all(kind, ts) for ts in (gs, us, vs))
    uo, vo = _in_place_all(kind, u_outs, "float32"), _in_place_all(kind, v_outs, "float32")
    if any(b.dtype != "float32" for b in gb + ub + vb):
        raise NativeUnavailable("dgc_step_many takes float32 tensors")
    if any(not (b[0].n == b[1].n == b[2].n == b[3].n == b[4].n) for b in zip(gb, ub, vb, uo, vo)):
        raise ValueError("every gradient, state and output of a bucket must have one size")
    if not (0 < ratio <= 1 and 0 < sample_ratio <= 1):
        raise ValueError(f"ratio and sample_ratio must be in (0, 1], got {ratio!r}, {sample_ratio!r}")
    numels = [b.n for b in gb]
    rooms = _Rooms(kind, [min(d, max(1, math.ceil(ratio * d))) for d in numels], [index_dtype(d) for d in numels])
    s0, s1 = _seed_word_arrays(words)
    if call(kind, "dgc_step_many", len(gb), _pointers(gb), _pointers(ub), _pointers(vb), _pointers(uo), _pointers(vo),
            _int64s(numels), float(momentum), float(ratio), float(sample_ratio), s0, s1, *rooms.arguments(),
            None if scales is None else (ctypes.c_float * len(gb))(*scales), _flag(kind, nonfinite)) != 0:
        raise RuntimeError("native DGC steps failed")
    return rooms.payloads()


# --- decoded sums: every rank's payload of a gradient decoded and added in one pass (CPU) ---------
def _rows(buf: Buf, count: int, itemsize: int, per_row: int):
    """A C array of the pointers to ``count`` rows of ``per_row`` items in a row in ``buf``."""
    return (ctypes.c_void_p * count)(*[buf.ptr + j * per_row * itemsize for j in range(count)])


def _check_sums(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"the payloads are not rows of {what}")


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
    ranks, bits = len(payloads[0]), code_width(2 * (levels + 1))
    ob = _in_place_all(kind, outs, "float32")
    packed = _same_kind_all(kind, [p[0] for rows in payloads for p in rows])
    norms = _same_kind_all(kind, [p[1] for rows in payloads for p in rows], "float32")
    sizes = [(packed_size(o.n, bits), _qsgd_rows(o.n, bucket_size)) for o in ob for _ in range(ranks)]
    _check_sums(all(len(rows) == ranks for rows in payloads)
                and all(p.dtype == "uint8" and p.n == size and q.n == rows
                        for p, q, (size, rows) in zip(packed, norms, sizes)), f"{bits}-bit codes with their norms")
    rc = call(kind, "qsgd_sum_segments", len(ob), ranks, _pointers(packed), _pointers(norms),
              _int64s([o.n for o in ob]), int(levels), int(bucket_size), bits, *_finish_args(finish), _pointers(ob))
    if rc != 0:
        raise ValueError(f"bad QSGD parameters: levels={levels}")
    return outs


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
    ranks = len(payloads[0])
    ob = _in_place_all(kind, outs, "float32")
    signs = _same_kind_all(kind, [p[0] for rows in payloads for p in rows])
    codes = _same_kind_all(kind, [p[1] for rows in payloads for p in rows])
    numels = [o.n for o in ob for _ in range(ranks)]
    _check_sums(all(len(rows) == ranks for rows in payloads)
                and all(a.dtype == b.dtype == "uint8" and a.n == packed_size(n, 1) and b.n == n
                        for a, b, n in zip(signs, codes, numels)), "sign bits and exponent codes")
    call(kind, "natural_sum_segments", len(ob), ranks, _pointers(signs), _pointers(codes), _int64s([o.n for o in ob]),
         *_finish_args(finish), _pointers(ob))
    return outs


# --- top-k, segment by segment ----------------------------------------------------------------
def topk_compress_segments(x, starts, numels, ks):
    """topk_compress of each segment (k = ks[s]) of the flat float32 ``x``: (every segment's
    values in a row, its indices in the segment (int64) in a row)."""
    kind = kind_of(x)
    b = _float32(kind, x, ("float32",))
    _check_segments(b.n, starts, numels)
    values, idx = kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64")
    at = 0
    for start, n, k in zip(starts, numels, ks):
        got = call(kind, "topk", b.ptr + 4 * start, 0, n, k, 1, idx.ptr + 8 * at, INDEX_CODES["int64"],
                   values.ptr + 4 * at)
        if got != k:
            raise RuntimeError(f"native top-k returned {got} of {k}")
        at += k
    return _wrap(kind, values, idx)


def topk_ef_step_segments(g, residual, starts, numels, ks, beta: float = 1.0, gamma: float = 1.0, out=None):
    """topk_ef_step of each segment: (values in a row, indices in the segment (int64) in a row,
    the new residual of the whole buffer)."""
    kind, gb, rb, ob = _ef_inputs(g, residual, out)
    _check_segments(gb.n, starts, numels)
    values, idx = kind.empty(sum(ks), "float32"), kind.empty(sum(ks), "int64")
    at, flags = 0, _ef_flags(beta, gamma)
    if _on_gpu(kind):
        if any(not 0 <= k <= n for k, n in zip(ks, numels)):
            raise ValueError("each segment's k must lie in [0, its size]")
        call(kind, "topk_ef_segments", gb.ptr, rb.ptr, len(numels), _int64s(starts), _int64s(numels), _int64s(ks),
             float(beta), float(gamma), flags, values.ptr, idx.ptr, ob.ptr)
        return _wrap(kind, values, idx, ob)
    for start, n, k in zip(starts, numels, ks):
        got = call(kind, "topk_ef", gb.ptr + 4 * start, rb.ptr + 4 * start, n, k, float(beta), float(gamma), flags,
                   values.ptr + 4 * at, idx.ptr + 8 * at, INDEX_CODES["int64"], ob.ptr + 4 * start)
        if got != k:
            raise RuntimeError(f"native top-k step returned {got} of {k}")
        at += k
    return _wrap(kind, values, idx, ob)


# --- the random quantizers, segment by segment (draws: each segment's own, in a row) -------------
def _segment_inputs(x, u, starts, numels, draw_starts, draws):
    """The flat float32 ``x`` and draws ``u``, checked: every segment in x, and its ``draws``
    (per segment) in u from its draw start."""
    kind = kind_of(x)
    b, ub = _float32(kind, x, ("float32",)), _same_kind(kind, u, "float32")
    _check_segments(b.n, starts, numels)
    _check_segments(ub.n, draw_starts, draws, "draws")
    return kind, b, ub


def terngrad_compress_segments(x, starts, numels, u, draw_starts):
    """terngrad_compress of each segment of the flat float32 ``x``, with the draws of segment s
    at ``u[draw_starts[s]:]``: (every segment's codes in a row, one scale per segment)."""
    kind, b, ub = _segment_inputs(x, u, starts, numels, draw_starts, numels)
    out = kind.empty(_packed_total(tuple(numels), 2), "uint8")
    scale = kind.empty(len(numels), "float32")
    if _on_gpu(kind):
        call(kind, "terngrad_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), ub.ptr,
             _int64s(draw_starts), out.ptr, scale.ptr)
        return _wrap(kind, out, scale)
    at = 0
    for s, (start, n, drawn) in enumerate(zip(starts, numels, draw_starts)):
        call(kind, "maxabs", b.ptr + 4 * start, n, scale.ptr + 4 * s)
        call(kind, "terngrad_compress", b.ptr + 4 * start, ub.ptr + 4 * drawn, n, scale.ptr + 4 * s, out.ptr + at)
        at += packed_size(n, 2)
    return _wrap(kind, out, scale)


def _check_payload(buf, want: int, what: str) -> None:
    if buf.n != want:
        raise ValueError(f"{buf.n} {what} where the segments need {want}")


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


def _qsgd_rows(n: int, bucket_size: int) -> int:
    return -(-n // qsgd_bucket(n, bucket_size))


@functools.lru_cache(maxsize=1024)
def _qsgd_rows_total(numels: tuple, bucket_size: int) -> int:
    return sum(_qsgd_rows(n, bucket_size) for n in numels)


def qsgd_compress_segments(x, starts, numels, u, draw_starts, levels: int, bucket_size: int = 0):
    """qsgd_compress of each segment: (every segment's codes in a row, its norms in a row);
    segment s draws one per element of its whole buckets of ``bucket_size``."""
    padded = [_qsgd_rows(n, bucket_size) * qsgd_bucket(n, bucket_size) for n in numels]
    kind, b, ub = _segment_inputs(x, u, starts, numels, draw_starts, padded)
    bits = code_width(2 * (levels + 1))
    out = kind.empty(_packed_total(tuple(numels), bits), "uint8")
    norms = kind.empty(_qsgd_rows_total(tuple(numels), int(bucket_size)), "float32")
    if _on_gpu(kind):
        call(kind, "qsgd_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), ub.ptr,
             _int64s(draw_starts), int(levels), int(bucket_size), bits, out.ptr, norms.ptr)
        return _wrap(kind, out, norms)
    at, row = 0, 0
    for start, n, drawn in zip(starts, numels, draw_starts):
        rc = call(kind, "qsgd_compress", b.ptr + 4 * start, ub.ptr + 4 * drawn, n, int(levels),
                  qsgd_bucket(n, bucket_size), bits, norms.ptr + 4 * row, 0, out.ptr + at)
        if rc != 0:
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


def natural_compress_segments(x, starts, numels, u, draw_starts):
    """natural_compress of each segment: (every segment's sign bits in a row, its codes in a row)."""
    kind, b, ub = _segment_inputs(x, u, starts, numels, draw_starts, numels)
    signs = kind.empty(_packed_total(tuple(numels), 1), "uint8")
    codes = kind.empty(sum(numels), "uint8")
    if _on_gpu(kind):
        call(kind, "natural_compress_segments", b.ptr, len(numels), _int64s(starts), _int64s(numels), ub.ptr,
             _int64s(draw_starts), signs.ptr, codes.ptr)
        return _wrap(kind, signs, codes)
    at, code = 0, 0  # (the codes in a row: a segment's start in x may lie past its first code)
    for start, n, drawn in zip(starts, numels, draw_starts):
        call(kind, "natural_compress", b.ptr + 4 * start, ub.ptr + 4 * drawn, n, signs.ptr + at, codes.ptr + code)
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


# --- fused error feedback -----------------------------------------------------------------------
def _ef_inputs(g, residual, out):
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


def _ef_flags(beta: float, gamma: float) -> int:
    return (1 if float(gamma) != 1.0 else 0) | (2 if float(beta) != 1.0 else 0)


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


# --- a bucket in one call on the CPU: each gradient at its own pointers -------------------------
def _in_place(kind, x, dtype: str, b: Buf = None) -> Buf:
    """``x`` as a buffer the kernel writes into: x's own memory, contiguous, of ``dtype``
    (``b``: ``_same_kind``'s buffer of x, where made already)."""
    b = _same_kind(kind, x) if b is None else b
    own = x.data_ptr() if kind.name == "torch" else getattr(getattr(x, "ctypes", None), "data", None)
    if b.dtype != dtype or b.ptr != own and b.obj is not x:
        raise NativeUnavailable(f"cannot write into a {b.dtype} or non-contiguous tensor in place")
    return b


def _in_place_all(kind, xs, dtype: str) -> list:
    # a TensorBuf is a contiguous tensor's own memory: in place as it is, where of ``dtype``
    return [b if type(b) is TensorBuf and b.dtype == dtype else _in_place(kind, x, dtype, b)
            for x, b in zip(xs, _same_kind_all(kind, xs))]


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


def _cpu_kind(x):
    kind = kind_of(x)
    if kind.lib.kind != "cpu":
        raise NativeUnavailable("a CPU-only entry point (bucket at once, or draws made inside)")
    return kind


def _ef_many_inputs(gs, residuals, outs):
    """A bucket's gradients, residuals and outputs (new ones where ``outs`` is None) as the
    buffers of a bucket-at-once residual step (CPU): (kind, gradients, residuals, outputs)."""
    kind = _cpu_kind(gs[0])
    gb, rb = _same_kind_all(kind, gs), _same_kind_all(kind, residuals)
    ob = [kind.empty(b.n, "float32") for b in gb] if outs is None else _in_place_all(kind, outs, "float32")
    if any(b.dtype != "float32" for b in gb + rb):
        raise NativeUnavailable("the fused error-feedback step takes float32 gradients and residuals")
    if any(not (g.n == r.n == o.n) for g, r, o in zip(gb, rb, ob)):
        raise ValueError("every gradient, residual and output of a bucket must have the same size")
    return kind, gb, rb, ob


def topk_ef_step_many(gs, residuals, ks, beta: float = 1.0, gamma: float = 1.0, outs=None, nonfinite=None,
                      into=None):
    """topk_ef_step of every gradient of a bucket, in one call (CPU): lists of values, indices
    and new residuals, per gradient (the new residuals written into ``outs`` where given; the
    overflow flag into ``nonfinite``, see ``_flag``; the values and indices where ``into``
    places them, see ``_placed``)."""
    kind, gb, rb, ob = _ef_many_inputs(gs, residuals, outs)
    ks = [max(0, min(int(k), b.n)) for k, b in zip(ks, gb)]
    dtypes = [index_dtype(b.n) for b in gb]
    addresses, views = _placed(kind, into, [t for d in dtypes for t in ("float32", d)], [k for k in ks for _ in "vi"])
    value_ptrs, idx_ptrs = _every(addresses, 0, 2), _every(addresses, 1, 2)
    value_views, idx_views = views[::2], views[1::2]
    rc = call(kind, "topk_ef_many", len(gb), _pointers(gb), _pointers(rb), _pointers(ob), _int64s([b.n for b in gb]),
              _int64s(ks), float(beta), float(gamma), _ef_flags(beta, gamma), value_ptrs, idx_ptrs,
              _index_codes(dtypes), _flag(kind, nonfinite))
    if rc != 0:
        raise RuntimeError("native top-k steps failed")
    return value_views, idx_views, [o.obj for o in ob]


class _Rooms:
    """Room for up to ``sizes[s]`` values (float32) and indices (``dtypes[s]``) of each gradient
    of a bucket, whose counts the kernel tells: one buffer for the values, one per index dtype."""

    def __init__(self, kind, sizes, dtypes):
        self.dtypes, self.starts = dtypes, [0, *itertools.accumulate(sizes[:-1])]
        self.values = kind.empty(sum(sizes), "float32")
        self.indices = {d: kind.empty(sum(n for n, e in zip(sizes, dtypes) if e == d), d) for d in set(dtypes)}
        taken = dict.fromkeys(self.indices, 0)  # each gradient's room in the buffer of its index dtype
        self.index_starts = []
        for n, d in zip(sizes, dtypes):
            self.index_starts.append(taken[d])
            taken[d] += n
        self.counts = (ctypes.c_int64 * len(sizes))()

    def arguments(self):
        """The C arguments: value and index addresses, index type codes, counts."""
        return (_addresses(self.values, [4 * s for s in self.starts]),
                (ctypes.c_void_p * len(self.dtypes))(*[self.indices[d].ptr + ITEMSIZE[d] * s
                                                       for d, s in zip(self.dtypes, self.index_starts)]),
                _index_codes(self.dtypes), self.counts)

    def payloads(self):
        """Each gradient's values and indices, as many as the kernel counted (views)."""
        return ([self.values.obj[s:s + c] for s, c in zip(self.starts, self.counts)],
                [self.indices[d].obj[s:s + c] for d, s, c in zip(self.dtypes, self.index_starts, self.counts)])


def threshold_ef_step_many(gs, residuals, thresholds, beta: float = 1.0, gamma: float = 1.0, outs=None,
                           nonfinite=None):
    """threshold_ef_step of every gradient of a bucket, in one call (CPU; one threshold for
    all): lists of values, indices and new residuals, per gradient (the new residuals written
    into ``outs`` where given; the overflow flag into ``nonfinite``, see ``_flag``). The values
    and indices are views of buffers with room for every element, of which only the pages
    written are touched (the frame copies them at once)."""
    if len(set(map(float, thresholds))) > 1:
        raise ValueError("one threshold for every gradient of a bucket")
    kind, gb, rb, ob = _ef_many_inputs(gs, residuals, outs)
    numels = [b.n for b in gb]
    rooms = _Rooms(kind, numels, [index_dtype(n) for n in numels])
    rc = call(kind, "threshold_ef_many", len(gb), _pointers(gb), _pointers(rb), _pointers(ob), _int64s(numels),
              float(thresholds[0]), float(beta), float(gamma), _ef_flags(beta, gamma), *rooms.arguments(),
              _flag(kind, nonfinite))
    if rc != 0:
        raise RuntimeError("native threshold steps failed")
    return (*rooms.payloads(), [o.obj for o in ob])


def randomk_ef_step_many(gs, residuals, indices, beta: float = 1.0, gamma: float = 1.0, scales=None, outs=None,
                         nonfinite=None):
    """Random-k's residual step for every gradient of a bucket in one call (CPU): p = g*gamma +
    residual*beta (each factor applied only when != 1) written into ``outs`` where given, the
    values of p at each gradient's distinct ``indices`` (int64, drawn by the caller; times
    ``scales[s]``, where given), and the new residual, p with p - (0 + value) there: lists of
    values and new residuals (the overflow flag into ``nonfinite``, see ``_flag``)."""
    kind, gb, rb, ob = _ef_many_inputs(gs, residuals, outs)
    ib = _same_kind_all(kind, indices, "int64")
    ks = [b.n for b in ib]
    starts = [0, *itertools.accumulate(ks[:-1])]
    values = kind.empty(sum(ks), "float32")
    scale = None if scales is None else (ctypes.c_float * len(ks))(*scales)
    rc = call(kind, "randomk_ef_many", len(gb), _pointers(gb), _pointers(rb), _pointers(ob),
              _int64s([b.n for b in gb]), _int64s(ks), _pointers(ib), float(beta), float(gamma),
              _ef_flags(beta, gamma), scale, _addresses(values, [4 * s for s in starts]), _flag(kind, nonfinite))
    if rc != 0:
        raise IndexError("an index is out of range for its gradient")
    return [values.obj[s:s + k] for s, k in zip(starts, ks)], [o.obj for o in ob]


def _finish_args(finish):
    """A decoded sum's finish, (vote, divisors) (see Compressor.finish), as the C arguments."""
    vote, divisors = finish if finish is not None else (False, ())
    if len(divisors) > 4:
        raise ValueError("at most 4 divisors")
    return int(bool(vote)), (ctypes.c_float * max(1, len(divisors)))(*divisors), len(divisors)


def _bits_sum_into(mode: int, payloads, outs, finish=None):
    per_row = _SCALARS[mode]
    kind = _cpu_kind(outs[0])
    ranks = len(payloads[0])
    ob = _in_place_all(kind, outs, "float32")
    packed = _same_kind_all(kind, [p[0] for rows in payloads for p in rows])
    scalars = _same_kind_all(kind, [p[1] for rows in payloads for p in rows], "float32") if per_row else None
    sizes = [packed_size(o.n, _CODE_BITS[mode]) for o in ob for _ in range(ranks)]
    if any(len(rows) != ranks for rows in payloads) \
            or any(p.dtype != "uint8" or p.n != n for p, n in zip(packed, sizes)) \
            or (scalars is not None and any(s.n != per_row for s in scalars)):
        raise ValueError(f"each gradient needs {ranks} rows of its bits, with {per_row} scalars each")
    call(kind, "bits_sum_segments", len(ob), ranks, _pointers(packed), _pointers(scalars) if scalars else None, mode,
         _int64s([o.n for o in ob]), *_finish_args(finish), _pointers(ob))
    return outs


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


def _bits_ef_many(mode: int, gs, residuals, beta: float, gamma: float, outs, nonfinite, into):
    kind, gb, rb, ob = _ef_many_inputs(gs, residuals, outs)
    sizes, per_row = [packed_size(b.n, 1) for b in gb], _SCALARS[mode]
    addresses, views = _placed(kind, into, ["uint8", "float32"] * len(gb), [c for n in sizes for c in (n, per_row)])
    bit_ptrs, scalar_ptrs = _every(addresses, 0, 2), _every(addresses, 1, 2)
    payloads = list(zip(views[::2], views[1::2]))
    call(kind, "bits_ef_many", len(gb), _pointers(gb), _pointers(rb), _pointers(ob), _int64s([b.n for b in gb]),
         float(beta), float(gamma), _ef_flags(beta, gamma), mode, bit_ptrs, scalar_ptrs, _flag(kind, nonfinite))
    return payloads, [o.obj for o in ob]


def efsignsgd_ef_step_many(gs, residuals, beta: float, gamma: float, outs, nonfinite=None, into=None):
    """EF-signSGD's residual step for every gradient of a bucket in one call (CPU): p = g*gamma
    + residual*beta written into ``outs`` (where given), its payload (sign bits, scale), then
    p - decode over it: (the payloads, the new residuals); the overflow flag into ``nonfinite``
    (see ``_flag``); the payloads where ``into`` places them (see ``_placed``)."""
    return _bits_ef_many(_EFSIGNSGD, gs, residuals, beta, gamma, outs, nonfinite, into)


def onebit_ef_step_many(gs, residuals, beta: float, gamma: float, outs, nonfinite=None, into=None):
    """1-bit SGD's residual step for every gradient of a bucket in one call (CPU), as
    ``efsignsgd_ef_step_many`` with its payload (bits, the two means)."""
    return _bits_ef_many(_ONEBIT, gs, residuals, beta, gamma, outs, nonfinite, into)


def efsignsgd_residual_into(p, packed, scale, out):
    """p - efsignsgd_decompress(packed, scale), written into ``out`` (CPU; may be ``p``)."""
    return _bits_residual(_EFSIGNSGD, p, packed, scale, out)


def onebit_residual_into(p, packed, means, out):
    """p - onebit_decompress(packed, means), written into ``out`` (CPU; may be ``p``)."""
    return _bits_residual(_ONEBIT, p, packed, means, out)


def terngrad_decompress_sum(packed_rows, scales, numel: int):
    """The sum, row after row, of terngrad_decompress of each row (2-bit codes) with its scale."""
    return _bits_sum(_TERNGRAD, packed_rows, scales, numel)


def terngrad_decompress_sum_into(payloads, outs, finish=None):
    """terngrad_decompress_sum of every gradient of a bucket in one call: payloads (codes, scale)."""
    return _bits_sum_into(_TERNGRAD, payloads, outs, finish)


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


def _check_draw_counts(counts) -> None:
    if any(not 0 <= c <= 2**32 for c in counts):
        raise ValueError("draw numbers are 32-bit: at most 2**32 draws per seed")


def _draws_into(symbol: str, kind, counts, words, out, dtype: str):
    """``symbol`` (uniform_segments, hash_keys_segments) of each segment's draws, into ``out``."""
    _check_draw_counts(counts)
    ob = _in_place(kind, out, dtype)
    if ob.n != sum(counts):
        raise ValueError(f"out has {ob.n} elements for {sum(counts)} draws")
    s0, s1 = _seed_word_arrays(words)
    call(kind, symbol, len(counts), _int64s(counts), s0, s1, ob.ptr)
    return out


def uniform_segments(counts, words, out):
    """Counter-based uniform draws (grace.core.draws): ``counts[s]`` draws of the seed words
    ``words[s]`` (two 32-bit ints), in a row, written into the float32 ``out``."""
    return _draws_into("uniform_segments", kind_of(out), counts, words, out, "float32")


def hash_keys_segments(counts, words, out):
    """The sort keys of counter-based random indices on a GPU: for the draws of each segment s
    in a row, s << 32 | the 32-bit hash of the draw (grace.core.draws.draw_hashes), written
    into the int64 ``out``."""
    kind = kind_of(out)
    if not _on_gpu(kind):
        raise NativeUnavailable("hash keys are made on a GPU")
    return _draws_into("hash_keys_segments", kind, counts, words, out, "int64")


def random_indices_segments(numels, ks, words, out):
    """Counter-based random indices (grace.core.draws) on the CPU: for each segment, the first
    ``ks[s]`` distinct index draws below ``numels[s]`` from the seed words ``words[s]``,
    ascending, in a row, written into the int64 ``out``."""
    kind = _cpu_kind(out)
    ob = _in_place(kind, out, "int64")
    if ob.n != sum(ks):
        raise ValueError(f"out has {ob.n} elements for {sum(ks)} indices")
    s0, s1 = _seed_word_arrays(words)
    if call(kind, "random_indices_segments", len(ks), _int64s(numels), _int64s(ks), s0, s1, ob.ptr) != 0:
        raise ValueError("every k must be at most its segment's size (and the size at most 2**32)")
    return out


def scatter_add_segments_into(payloads, outs, divisor: float = 1.0):
    """Every gradient's sparse aggregate in one call (CPU): ``outs[s]`` = zeros, then each
    rank's (values, indices) in ``payloads[s]`` divided by ``divisor`` and added, rank after
    rank (as scatter_add_many of the divided values). Returns ``outs``."""
    kind = _cpu_kind(outs[0])
    ranks = len(payloads[0])
    ob = _in_place_all(kind, outs, "float32")
    vals = _same_kind_all(kind, [v for rows in payloads for v, _ in rows])
    indices = [i for rows in payloads for _, i in rows]
    idxs = [_index_buf(kind, i, b) for i, b in zip(indices, _same_kind_all(kind, indices))]
    if any(len(rows) != ranks for rows in payloads) or any(v.dtype != "float32" for v in vals):
        raise NativeUnavailable("scatter_add_segments_into takes float32 values, as many per gradient")
    if any(v.n != i.n for v, i in zip(vals, idxs)):
        raise ValueError("as many values as indices, per payload")
    rc = call(kind, "scatter_add_segments", len(ob), ranks, _pointers(idxs), _index_codes([i.dtype for i in idxs]),
              _pointers(vals),
              _int64s([v.n for v in vals]), float(divisor), _int64s([o.n for o in ob]), _pointers(ob))
    if rc != 0:
        raise IndexError("an index is out of range for its gradient")
    return outs


def _elementwise_many(symbol: str, ins, in_dtype: str, outs, out_dtype: str, *scalars):
    """``grace_cpu_<symbol>`` over a bucket: each of ``ins`` (of ``in_dtype``) into the output
    of the same size in ``outs`` (written in place, ``out_dtype``), then ``scalars``."""
    kind = _cpu_kind(outs[0])
    ib, ob = _same_kind_all(kind, ins), _in_place_all(kind, outs, out_dtype)
    if any(b.dtype != in_dtype for b in ib):
        raise NativeUnavailable(f"{symbol} takes {in_dtype} inputs")
    if len(ib) != len(ob) or any(i.n != o.n for i, o in zip(ib, ob)):
        raise ValueError("one output of the same size per input")
    call(kind, symbol, len(ib), _pointers(ib), _int64s([b.n for b in ib]), *map(float, scalars), _pointers(ob))
    return outs


def fp16_compress_many_into(xs, divisor: float, outs):
    """fp16's payload of every gradient of a bucket in one call (CPU): ``outs[s]`` (float16, as
    many elements as ``xs[s]``) = ``xs[s] / divisor`` rounded to half precision, nearest even, as
    torch's and NumPy's casts round (a NaN's payload bits aside). Returns ``outs``."""
    return _elementwise_many("half_encode_many", xs, "float32", outs, "float16", divisor)


def fp16_decompress_many_into(halves, factor: float, divisor: float, outs):
    """``outs[s]`` (float32) = ``(float(halves[s]) * factor) / divisor`` for every gradient of a
    bucket in one call (CPU): fp16's decompressed sums, averaged. Returns ``outs``."""
    return _elementwise_many("half_decode_many", halves, "float16", outs, "float32", factor, divisor)


# --- the kernel table: what a backend may ask for, and what each function returns ----------------
@dataclass(frozen=True)
class Kernel:
    """A native function a backend dispatches to: the C functions it calls (grace_cpu_<symbol>,
    grace_cuda_<symbol>; their argument types: ``_loader.SYMBOLS``), its outputs' dtypes
    ("index": ``index_dtype`` of the input's length; a graph needs them before it runs), the
    outputs whose length depends on the values, and the devices that have it."""

    function: Callable
    symbols: Tuple[str, ...]
    outputs: Tuple[str, ...]
    variable: Tuple[int, ...] = ()
    devices: Tuple[str, ...] = ("cpu", "cuda")


# The one-pass functions a compressor asks for by name (``xp.fused(name, like)``).
FUSED: Dict[str, Kernel] = {
    "signsgd_compress": Kernel(signsgd_compress, ("sign_pack",), ("uint8",)),
    "signsgd_decompress": Kernel(signsgd_decompress, ("sign_decode",), ("float32",)),
    "efsignsgd_compress": Kernel(efsignsgd_compress, ("efsign_compress",), ("uint8", "float32")),
    "efsignsgd_decompress": Kernel(efsignsgd_decompress, ("sign_decode",), ("float32",)),
    "onebit_compress": Kernel(onebit_compress, ("onebit_compress",), ("uint8", "float32")),
    "onebit_decompress": Kernel(onebit_decompress, ("onebit_decode",), ("float32",)),
    "signsgd_decompress_sum": Kernel(signsgd_decompress_sum, ("bits_sum",), ("float32",)),
    "efsignsgd_decompress_sum": Kernel(efsignsgd_decompress_sum, ("bits_sum",), ("float32",)),
    "onebit_decompress_sum": Kernel(onebit_decompress_sum, ("bits_sum",), ("float32",)),
    "terngrad_decompress_sum": Kernel(terngrad_decompress_sum, ("bits_sum",), ("float32",)),
    "qsgd_decompress_sum": Kernel(qsgd_decompress_sum, ("qsgd_sum_segments",), ("float32",), devices=("cpu",)),
    "natural_decompress_sum": Kernel(natural_decompress_sum, ("natural_sum_segments",), ("float32",),
                                     devices=("cpu",)),
    "qsgd_decompress_sum_into": Kernel(qsgd_decompress_sum_into, ("qsgd_sum_segments",), ("float32",),
                                       devices=("cpu",)),
    "natural_decompress_sum_into": Kernel(natural_decompress_sum_into, ("natural_sum_segments",), ("float32",),
                                          devices=("cpu",)),
    # (on a GPU one launch per kernel for all segments: the *_segments and decode_segments symbols)
    "efsignsgd_compress_segments": Kernel(efsignsgd_compress_segments, ("efsign_compress", "efsign_compress_segments"),
                                          ("uint8", "float32")),
    "efsignsgd_decompress_segments": Kernel(efsignsgd_decompress_segments, ("sign_decode", "decode_segments"),
                                            ("float32",)),
    "onebit_compress_segments": Kernel(onebit_compress_segments, ("onebit_compress", "onebit_compress_segments"),
                                       ("uint8", "float32")),
    "onebit_decompress_segments": Kernel(onebit_decompress_segments, ("onebit_decode", "decode_segments"),
                                         ("float32",)),
    "topk_compress_segments": Kernel(topk_compress_segments, ("topk",), ("float32", "int64")),
    "topk_ef_step_segments": Kernel(topk_ef_step_segments, ("topk_ef", "topk_ef_segments"),
                                    ("float32", "int64", "float32")),
    "terngrad_compress_segments": Kernel(terngrad_compress_segments,
                                         ("maxabs", "terngrad_compress", "terngrad_compress_segments"),
                                         ("uint8", "float32")),
    "terngrad_decompress_segments": Kernel(terngrad_decompress_segments, ("terngrad_decode", "decode_segments"),
                                           ("float32",)),
    "qsgd_compress_segments": Kernel(qsgd_compress_segments, ("qsgd_compress", "qsgd_compress_segments"),
                                     ("uint8", "float32")),
    "qsgd_decompress_segments": Kernel(qsgd_decompress_segments, ("qsgd_decode", "decode_segments"), ("float32",)),
    "natural_compress_segments": Kernel(natural_compress_segments, ("natural_compress", "natural_compress_segments"),
                                        ("uint8", "uint8")),
    "natural_decompress_segments": Kernel(natural_decompress_segments, ("natural_decode", "decode_segments"),
                                          ("float32",)),
    "terngrad_compress": Kernel(terngrad_compress, ("maxabs", "terngrad_compress"), ("uint8", "float32")),
    "terngrad_decompress": Kernel(terngrad_decompress, ("terngrad_decode",), ("float32",)),
    "qsgd_compress": Kernel(qsgd_compress, ("qsgd_norms", "qsgd_compress"), ("uint8", "float32")),
    "qsgd_decompress": Kernel(qsgd_decompress, ("qsgd_decode",), ("float32",)),
    "natural_compress": Kernel(natural_compress, ("natural_compress",), ("uint8", "uint8")),
    "natural_compress_drawn": Kernel(natural_compress_drawn, ("natural_compress_drawn",), ("uint8", "uint8"),
                                     devices=("cpu",)),
    "terngrad_compress_drawn": Kernel(terngrad_compress_drawn, ("terngrad_compress_drawn",), ("uint8", "float32"),
                                      devices=("cpu",)),
    "qsgd_compress_drawn": Kernel(qsgd_compress_drawn, ("qsgd_compress_drawn",), ("uint8", "float32"),
                                  devices=("cpu",)),
    "natural_decompress": Kernel(natural_decompress, ("natural_decode",), ("float32",)),
    "topk_ef_step": Kernel(topk_ef_step, ("topk_ef",), ("float32", "index", "float32")),
    "threshold_ef_step": Kernel(threshold_ef_step, ("threshold_ef",), ("float32", "index", "float32"),
                                variable=(0, 1)),
    # a bucket in one call (lists in, lists out; eager CPU tensors only)
    "topk_ef_step_many": Kernel(topk_ef_step_many, ("topk_ef_many",), ("float32", "index", "float32"),
                                devices=("cpu",)),
    "threshold_ef_step_many": Kernel(threshold_ef_step_many, ("threshold_ef_many",), ("float32", "index", "float32"),
                                     devices=("cpu",), variable=(0, 1)),
    "randomk_ef_step_many": Kernel(randomk_ef_step_many, ("randomk_ef_many",), ("float32", "float32"),
                                   devices=("cpu",)),
    "scatter_add_segments_into": Kernel(scatter_add_segments_into, ("scatter_add_segments",), ("float32",),
                                        devices=("cpu",)),
    "dgc_compensate_into": Kernel(dgc_compensate_into, ("dgc_compensate",), ("float32", "float32"),
                                  devices=("cpu",)),
    "lowrank_project_many": Kernel(lowrank_project_many, ("lowrank_project_many",), ("float32",), devices=("cpu",)),
    "lowrank_back_many": Kernel(lowrank_back_many, ("lowrank_back_many",), ("float32",), devices=("cpu",)),
    "lowrank_expand_many": Kernel(lowrank_expand_many, ("lowrank_expand_many",), ("float32",), devices=("cpu",)),
    "compress_many": Kernel(compress_many, ("compress_many",), ("uint8", "float32"), devices=("cpu",)),
    "dgc_step_many": Kernel(dgc_step_many, ("dgc_step_many",), ("float32", "index"), devices=("cpu",), variable=(0, 1)),
    "fp16_compress_many_into": Kernel(fp16_compress_many_into, ("half_encode_many",), ("float16",), devices=("cpu",)),
    "fp16_decompress_many_into": Kernel(fp16_decompress_many_into, ("half_decode_many",), ("float32",),
                                        devices=("cpu",)),
    "efsignsgd_ef_step_many": Kernel(efsignsgd_ef_step_many, ("bits_ef_many",), ("uint8", "float32", "float32"),
                                     devices=("cpu",)),
    "onebit_ef_step_many": Kernel(onebit_ef_step_many, ("bits_ef_many",), ("uint8", "float32", "float32"),
                                  devices=("cpu",)),
    "efsignsgd_residual_into": Kernel(efsignsgd_residual_into, ("bits_residual",), ("float32",), devices=("cpu",)),
    "onebit_residual_into": Kernel(onebit_residual_into, ("bits_residual",), ("float32",), devices=("cpu",)),
    **{f"{method}_decompress_sum_into": Kernel(function, ("bits_sum_segments",), ("float32",), devices=("cpu",))
       for method, function in (("signsgd", signsgd_decompress_sum_into), ("efsignsgd", efsignsgd_decompress_sum_into),
                                ("onebit", onebit_decompress_sum_into), ("terngrad", terngrad_decompress_sum_into))},
}


def fused(name: str, like):
    """The fused function ``name`` (e.g. 'qsgd_compress') when it runs natively on the device
    of ``like``, else None: the compressor then runs its tensor-op formula."""
    kernel = FUSED[name]  # (an unknown name is a bug, not a reason to fall back)
    try:
        kind = kind_of(like)
    except NativeUnavailable:
        return None
    return kernel.function if kind.lib.kind in kernel.devices else None


# --- the building blocks TorchBackend uses where they apply (top-k, nonzero, scatter-add, packing) ---
def _unless_unavailable(fn, *args, **kwargs):
    """fn(...), or None where no native kernel serves these inputs (no library, another device,
    a dtype it does not take: NativeUnavailable); the caller then runs its tensor-op code.
    Any other error is a real one and propagates."""
    try:
        return fn(*args, **kwargs)
    except NativeUnavailable:
        return None


def try_pack(codes, bits: int):
    return _unless_unavailable(pack, codes, bits)


def try_unpack(packed, bits: int, numel: int):
    return _unless_unavailable(unpack, packed, bits, numel)


def try_topk_indices(x, k: int):
    return _unless_unavailable(topk_indices, x, k)


def try_nonzero(mask):
    return _unless_unavailable(nonzero, mask)


def try_threshold_indices(x, threshold: float):
    return _unless_unavailable(threshold_indices, x, threshold)


def try_norm(x):
    return _unless_unavailable(norm, x)


def try_scatter_add(indices, values, numel: int):
    return _unless_unavailable(scatter_add, indices, values, numel)


def try_scatter_add_many(payloads, numel: int):
    return _unless_unavailable(scatter_add_many, payloads, numel)
