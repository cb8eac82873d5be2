"""TensorFlow backend: the same operations as the NumPy reference, on the tensor's own device.

Every operation is a TensorFlow op (no ``.numpy()``), so that the methods also run inside
``tf.function``; the exceptions are the random draws off the GPU (``uniform``, ``random_indices``),
made on the host so that they equal the NumPy backend's (grace.core.draws): a constant of the
graph, or a ``tf.numpy_function`` host call when the step is a tensor. On a GPU they come from TensorFlow's
stateless generators, keyed by the same (key, step) seed, and stay on the device. Shapes are static ones: ``shape`` and ``numel`` are
Python ints whenever TensorFlow knows them (``numel`` falls back to a scalar int64 tensor).

Result dtypes follow NumPy's for each operation (``floor`` of an int16 tensor is float32, the
sum of integers is int64, ...): they are worked out by NumPy itself on empty arrays, so this
backend cannot drift from the reference. Where TensorFlow has no kernel for a dtype (e.g. abs
and sign of unsigned integers, sums of booleans) the op goes through a wider type inside.

Known differences from NumPy: TensorFlow's CPU kernels flush subnormal floats (below 2**-126 in
float32) to zero, and log2/exp2 are correctly rounded where NumPy's float32 SIMD versions may be
one ulp off (both are exact at powers of two and integers).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

from grace import native as _native
from grace.core import bits as bits_
from grace.core import draws
from grace.backends.tensorflow_graph import device_of as _device, graph_kernel, on_gpu as _on_gpu
from grace.formats import numpy_dtype



# --- dtypes: names <-> TensorFlow <-> NumPy ------------------------------------------------
def _tf_dtype(name) -> tf.DType:
    if isinstance(name, tf.DType):
        return name
    return tf.as_dtype(_np_dtype(name))


def _np_dtype(name) -> np.dtype:
    return numpy_dtype(name.name if isinstance(name, tf.DType) else str(name))


def _is_tensor(x) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable)) or tf.is_tensor(x)


@functools.lru_cache(maxsize=None)
def _unary_result(ufunc_name: str, name: str) -> str:
    """The dtype name NumPy gives ``ufunc`` of a ``name`` array (float16 for floor(uint8), ...)."""
    return getattr(np, ufunc_name)(np.zeros(0, _np_dtype(name))).dtype.name


def _dummy(x):
    """What NumPy's promotion sees of ``x``: an empty array of its dtype, or the Python scalar."""
    if _is_tensor(x):
        return np.zeros(0, _np_dtype(x.dtype.name))
    if isinstance(x, (bool, int, float, complex)):
        return x  # weak Python scalar (NEP 50): takes the tensor's dtype
    return np.zeros(0, np.asarray(x).dtype)


def _result_dtype(*xs) -> str:
    return np.result_type(*(_dummy(x) for x in xs)).name


def _to_tensor(x, dtype: str | None = None):
    """``x`` as a tensor (of ``dtype``, NumPy-style conversion for non-tensors)."""
    if not _is_tensor(x):
        x = tf.constant(np.asarray(x) if dtype is None else np.asarray(x, dtype=_np_dtype(dtype)))
    elif isinstance(x, tf.Variable):
        x = tf.convert_to_tensor(x)
    if dtype is not None and x.dtype != _tf_dtype(dtype):
        x = tf.cast(x, _tf_dtype(dtype))
    return x


def _stateless_seed(seed):
    """A (key, step) seed as the shape-(2,) int64 seed of TensorFlow's stateless generators."""
    key, step = seed
    return tf.stack([tf.constant(int(key) % 2**63, tf.int64), tf.cast(step, tf.int64)])


def _host_draw(draw, seed, shape, dtype, like):
    """``draw((key, step))``, made on the host, as a tensor: a constant when the step is a Python int;
    a host call (tf.numpy_function) when it is a tensor, as under tf.function."""
    key, step = seed
    with tf.device(_device(like)):
        if not _is_tensor(step):
            return tf.constant(draw((key, int(step))), dtype=dtype)
        out = tf.numpy_function(lambda s: draw((key, int(s))), [step], dtype, stateful=False)
        return tf.ensure_shape(out, shape)


class TensorflowBackend:
    name = "tensorflow"
    segmented = False  # no segmented ops (grace.core.segments): buckets go gradient by gradient
    mutable_tensors = False  # concat_into returns a new tensor; assign refuses

    # --- introspection -------------------------------------------------------------------
    def dtype(self, x) -> str:
        if _is_tensor(x):
            return x.dtype.name
        return np.asarray(x).dtype.name

    def shape(self, x) -> tuple:
        if not _is_tensor(x):
            return tuple(np.shape(x))
        return tuple(x.shape.as_list())

    def numel(self, x):
        """Python int from the static shape; a scalar int64 tensor where the shape is unknown."""
        if not _is_tensor(x):
            return int(np.size(x))
        n = x.shape.num_elements()
        return int(n) if n is not None else tf.size(x, out_type=tf.int64)

    def nbytes(self, x):
        if not _is_tensor(x):
            return int(np.asarray(x).nbytes)
        return self.numel(x) * x.dtype.size

    # --- conversion and shaping ----------------------------------------------------------
    def asarray(self, data, like=None):
        if _is_tensor(data):
            return _to_tensor(data)
        with tf.device(_device(like)):
            return tf.constant(np.asarray(data))

    def zeros(self, numel: int, dtype: str, like=None):
        with tf.device(_device(like)):
            if _is_tensor(numel):
                return tf.zeros(tf.reshape(tf.cast(numel, tf.int64), (1,)), dtype=_tf_dtype(dtype))
            return tf.zeros((int(numel),), dtype=_tf_dtype(dtype))

    def zeros_like(self, x):
        return tf.zeros_like(_to_tensor(x))

    def empty(self, numel: int, dtype: str, like=None):
        return self.zeros(numel, dtype, like)

    def to_numpy(self, x):
        if not _is_tensor(x):
            return np.asarray(x)
        return np.asarray(x.numpy())  # bfloat16 comes back as ml_dtypes.bfloat16, like NumPy's

    def cast(self, x, dtype: str):
        return _to_tensor(x, dtype)

    def flatten(self, x):
        return tf.reshape(x, (-1,))

    def reshape(self, x, shape):
        return tf.reshape(x, tuple(shape) if not _is_tensor(shape) else shape)

    def concat(self, xs):
        xs = list(xs)
        dtype = _result_dtype(*xs)
        return tf.concat([_to_tensor(x, dtype) for x in xs], axis=0)

    def split(self, x, sizes):
        """Like np.split at the cumulative sizes: the last piece takes whatever is left."""
        if _is_tensor(sizes):  # lengths received from other ranks, inside a traced step
            n = sizes.shape.num_elements()
            return tf.split(x, tf.cast(sizes, tf.int64), num=n) if n > 1 else [x]
        sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
        cuts = np.cumsum(sizes)[:-1].tolist()
        starts, ends = [0] + cuts, cuts + [None]
        return [x[start:end] for start, end in zip(starts, ends)]

    def to_bytes(self, x):
        x = _to_tensor(x)
        return x if x.dtype == tf.uint8 else tf.reshape(tf.bitcast(x, tf.uint8), (-1,))

    def flat_bytes(self, xs) -> list:
        return [self.to_bytes(self.flatten(x)) for x in xs]

    def from_bytes(self, b, dtype: str):
        dtype = _tf_dtype(dtype)
        if dtype == tf.uint8:
            return b
        return tf.bitcast(tf.reshape(b, (-1, dtype.size)), dtype) if dtype.size > 1 else tf.bitcast(b, dtype)

    def copy(self, x):
        return tf.identity(x) if _is_tensor(x) else np.array(x, copy=True)

    def concat_into(self, xs, out):
        return self.concat(xs)

    def concat_flat(self, xs, out=None):
        return self.concat([tf.reshape(x, [-1]) for x in xs])

    def unflatten(self, flat, numels, shapes):
        return [tf.reshape(t, s) for t, s in zip(self.split(flat, numels), shapes)]

    def assign(self, dst, src) -> None:
        raise TypeError("TensorFlow tensors cannot be written in place (mutable_tensors is False)")

    assign_many = assign

    def flat_view(self, x):  # (no tensor is written in place)
        return None

    def add_into(self, a, b, out):  # (like concat_into: a new tensor; ``out`` cannot be written)
        return a + b

    def subtract_into(self, a, b, out):
        return a - b

    def add_many_into(self, xs, ys, outs):
        return [x + y for x, y in zip(xs, ys)]

    def subtract_many_into(self, xs, ys):
        return [x - y for x, y in zip(xs, ys)]

    def matmul_into(self, a, b, out):
        return tf.reshape(self.matmul(a, b), tf.shape(out))

    def divide_into(self, a, b, out):
        return a / b

    def multiply_into(self, a, b, out):
        return a * b

    def sign_into(self, x, out):
        return tf.sign(_to_tensor(x))

    def put(self, x, idx, values):  # a new tensor: TensorFlow's cannot be written in place
        idx = tf.reshape(_to_tensor(idx, "int64"), (-1, 1))
        return tf.tensor_scatter_nd_update(_to_tensor(x), idx, tf.broadcast_to(values, tf.shape(idx)[:1]))

    def host_ints(self, x, count: int):
        """The ``count`` values of a 1-d integer tensor as Python ints; inside a trace, as
        scalar tensors."""
        if tf.executing_eagerly():
            return [int(v) for v in x.numpy()]
        return [x[i] for i in range(count)]

    def device(self, x) -> str:
        return _device(x)

    def same_layout(self, a, b) -> bool:
        return self.shape(a) == self.shape(b) and self.dtype(a) == self.dtype(b) and self.device(a) == self.device(b)

    def on_accelerator(self, x) -> bool:
        return _on_gpu(x)

    # --- arithmetic and selection --------------------------------------------------------
    def abs(self, x):
        x = _to_tensor(x)
        if x.dtype.is_unsigned or x.dtype == tf.bool:
            return x
        return tf.abs(x)

    def sign(self, x):
        x = _to_tensor(x)
        if x.dtype.is_unsigned:  # TensorFlow has no unsigned Sign kernel
            return tf.cast(x > 0, x.dtype)
        return tf.sign(x)

    def _float_op(self, op, ufunc_name, x):
        """``op`` in the float dtype NumPy's ``ufunc_name`` returns for x's dtype."""
        x = _to_tensor(x)
        out = _tf_dtype(_unary_result(ufunc_name, x.dtype.name))
        if not out.is_floating:  # NumPy 2.3+: floor of integers is themselves, same dtype
            return tf.cast(x, out)
        return op(tf.cast(x, out))

    def floor(self, x):
        return self._float_op(tf.floor, "floor", x)

    def ceil(self, x):
        return tf.math.ceil(_to_tensor(x, "float64" if not _is_tensor(x) else None))

    def minimum(self, a, b):
        dtype = _result_dtype(a, b)
        return tf.minimum(_to_tensor(a, dtype), _to_tensor(b, dtype))

    def round(self, x):
        """To the nearest integer, halves to even (tf.round is banker's rounding)."""
        return self._float_op(tf.round, "round", x)  # integers: the same integers, same dtype

    def log2(self, x):
        """log2 computed in float64 (exact at powers of two), rounded to NumPy's result dtype."""
        x = _to_tensor(x)
        out = _tf_dtype(_unary_result("log2", x.dtype.name))
        wide = tf.cast(x, tf.float64)
        y = tf.math.log(wide) / tf.constant(math.log(2.0), tf.float64)
        # log(x) / log(2) can miss an exact power of two by one ulp (log(2**29) / log(2) does)
        r = tf.round(y)
        y = tf.where(tf.pow(tf.constant(2.0, tf.float64), r) == wide, r, y)
        return tf.cast(y, out)

    def exp2(self, x):
        x = _to_tensor(x)
        out = _tf_dtype(_unary_result("exp2", x.dtype.name))
        return tf.cast(tf.pow(tf.constant(2.0, tf.float64), tf.cast(x, tf.float64)), out)

    def where(self, mask, a, b):
        dtype = _result_dtype(a, b)
        mask = _to_tensor(mask)
        if mask.dtype != tf.bool:
            mask = tf.not_equal(mask, tf.zeros((), mask.dtype))
        return tf.where(mask, _to_tensor(a, dtype), _to_tensor(b, dtype))

    def clip_min(self, x, low):
        dtype = _result_dtype(x, low)
        return tf.maximum(_to_tensor(x, dtype), _to_tensor(low, dtype))

    def sum(self, x, axis=None):
        """Floats keep their dtype (float16 and bfloat16 accumulate in float32, as NumPy's
        float16 sum does); integers and booleans sum in int64."""
        x = _to_tensor(x)
        if x.dtype.is_floating:
            if x.dtype in (tf.float16, tf.bfloat16):
                return tf.cast(tf.reduce_sum(tf.cast(x, tf.float32), axis=axis), x.dtype)
            return tf.reduce_sum(x, axis=axis)
        return tf.reduce_sum(tf.cast(x, tf.int64), axis=axis)

    def nonfinite(self, xs, dtype: str = "float32"):
        """A one-element flag in ``dtype``: 1 where any of the tensors ``xs`` holds an inf or a NaN
        (a summing pass each; half precision sums in float32, which cannot overflow)."""
        sums = [tf.reduce_sum(tf.cast(x, tf.float64 if x.dtype == tf.float64 else tf.float32)) for x in xs]
        total = tf.add_n([tf.cast(s, tf.float64) for s in sums]) if len(sums) > 1 else sums[0]
        return tf.reshape(tf.cast(tf.logical_not(tf.math.is_finite(total)), dtype), [1])

    def max(self, x, axis=None):
        """Maximum; 0 for an empty tensor, like the other backends."""
        x = _to_tensor(x)
        dtype = x.dtype
        if dtype == tf.bool:
            reduce = lambda t: tf.reduce_any(t, axis=axis)  # noqa: E731
        else:
            reduce = lambda t: tf.reduce_max(t, axis=axis)  # noqa: E731
        n = x.shape.num_elements()
        if n is not None:
            return reduce(x) if n else tf.zeros((), dtype)
        if axis is not None:
            return reduce(x)
        return tf.cond(tf.size(x) > 0, lambda: reduce(x), lambda: tf.zeros((), dtype))

    def norm(self, x, axis=None):
        """Euclidean norm, accumulated in float32 at least."""
        x = _to_tensor(x)
        acc = _tf_dtype(np.promote_types(_np_dtype(x.dtype.name), np.float32).name)
        return tf.sqrt(tf.reduce_sum(tf.square(tf.cast(x, acc)), axis=axis))

    def uniform(self, numel: int, seed, like=None):
        """float32 draws in [0, 1) from the (key, step) ``seed``. Off the GPU they are the
        counter-based draws of every backend (grace.core.draws; a graph constant inside
        tf.function, or a host call when the step is a tensor there); on a GPU a stateless
        TensorFlow generator's."""
        if _on_gpu(like):
            with tf.device(_device(like)):
                return tf.random.stateless_uniform((numel,), seed=_stateless_seed(seed), dtype=tf.float32)
        return _host_draw(lambda s: draws.uniform_host([numel], [s]), seed, (numel,), tf.float32, like)

    def random_indices(self, numel: int, k: int, seed, like=None):
        """k distinct indices below ``numel``, drawn from ``seed``, sorted (int64): off the GPU
        the NumPy backend's (grace.core.draws), like ``uniform``; on a GPU the k largest of
        stateless uniform draws."""
        if _on_gpu(like):
            with tf.device(_device(like)):
                u = tf.random.stateless_uniform((numel,), seed=_stateless_seed(seed), dtype=tf.float32)
                return tf.sort(tf.cast(tf.math.top_k(u, k, sorted=False).indices, tf.int64))
        return _host_draw(lambda s: draws.random_indices_host([numel], [k], [s]), seed, (k,), tf.int64, like)

    def uniform_segments(self, counts, seeds, like=None):
        """``uniform(counts[s], seeds[s])`` for every s, in a row."""
        return self.concat([self.uniform(c, seed, like) for c, seed in zip(counts, seeds)])

    def indices_by_hash(self, like) -> bool:
        """Whether random indices are the k smallest hashes of the draws: never here."""
        return False

    def random_indices_segments(self, numels, ks, seeds, like=None):
        """``random_indices(numels[s], ks[s], seeds[s])`` for every s, in a row."""
        return self.concat([self.random_indices(d, k, seed, like) for d, k, seed in zip(numels, ks, seeds)])

    def arange(self, n: int, like=None):
        with tf.device(_device(like)):
            return tf.range(tf.cast(n, tf.int64) if _is_tensor(n) else int(n), dtype=tf.int64)

    def sort(self, x):
        x = _to_tensor(x)
        if x.dtype == tf.bool:
            return tf.cast(tf.sort(tf.cast(x, tf.uint8)), tf.bool)
        return tf.sort(x)

    def argsort(self, x):
        """int64 indices that sort the 1-d ``x`` ascending; ties keep their order."""
        x = _to_tensor(x)
        if x.dtype == tf.bool:
            x = tf.cast(x, tf.uint8)
        return tf.cast(tf.argsort(x, stable=True), tf.int64)

    def topk_indices(self, x, k: int):
        """Indices (int64, any order) of the k largest elements of the 1-d ``x``."""
        x = _to_tensor(x)
        n = self.numel(x)
        if not _is_tensor(n) and not _is_tensor(k):
            k = int(k)
            if k >= n:
                return self.arange(n, like=x)
        else:  # sizes known only when the step runs
            k = tf.minimum(tf.cast(k, tf.int32), tf.cast(n, tf.int32))
        if x.dtype == tf.bool:
            x = tf.cast(x, tf.uint8)
        return tf.cast(tf.math.top_k(x, k, sorted=False).indices, tf.int64)

    def nonzero(self, mask, size=None):
        mask = tf.reshape(_to_tensor(mask), (-1,))
        if mask.dtype != tf.bool:
            mask = tf.not_equal(mask, tf.zeros((), mask.dtype))
        return tf.reshape(tf.where(mask), (-1,))  # tf.where(mask) is (n, 1) int64

    def indices_abs_at_least(self, x, threshold):
        """Indices (int64, ascending) of the elements of the 1-d ``x`` with |x| >= threshold."""
        x = _to_tensor(x)
        return self.nonzero(tf.abs(x) >= tf.cast(threshold, x.dtype))

    def gather(self, x, idx, axis: int = 0):
        return tf.gather(_to_tensor(x), _to_tensor(idx, "int64"), axis=axis)

    def cumsum(self, x, axis: int = 0):
        """Running sum of ``x`` along ``axis``, in its dtype."""
        return tf.math.cumsum(_to_tensor(x), axis=axis)

    def divide_cast(self, x, divisor, dtype: str):
        return tf.cast(_to_tensor(x) / divisor, _tf_dtype(dtype))

    def cast_multiply(self, x, dtype: str, factor):
        return tf.cast(_to_tensor(x), _tf_dtype(dtype)) * factor

    # --- segmented ops (grace.core.segments; Exchange does not segment TensorFlow buckets) --
    def shift_right(self, x, bits: int):
        x = _to_tensor(x)
        return tf.bitwise.right_shift(x, tf.cast(bits, x.dtype))

    def bincount(self, idx, length: int):
        return tf.math.bincount(tf.cast(_to_tensor(idx), tf.int32), minlength=int(length), maxlength=int(length),
                                dtype=tf.int64)

    def repeat(self, x, counts, total: int, starts=None):
        return tf.repeat(_to_tensor(x), _to_tensor(counts, "int64"))

    def segment_max(self, x, counts):
        counts = _to_tensor(counts, "int64")
        ids = tf.repeat(tf.range(tf.size(counts, out_type=tf.int64)), counts)
        return tf.maximum(tf.math.unsorted_segment_max(_to_tensor(x), ids, tf.size(counts)), 0)  # (x >= 0)

    def segment_sum(self, x, counts):
        counts = _to_tensor(counts, "int64")
        ids = tf.repeat(tf.range(tf.size(counts, out_type=tf.int64)), counts)
        x = _to_tensor(x)
        return tf.cast(tf.math.unsorted_segment_sum(tf.cast(x, tf.float64), ids, tf.size(counts)), x.dtype)

    def scatter_add_rows(self, idx_rows, value_rows, numel: int):
        out = tf.zeros((int(numel),), _to_tensor(value_rows[0]).dtype)
        for idx, values in zip(idx_rows, value_rows):
            out = tf.tensor_scatter_nd_add(out, tf.reshape(_to_tensor(idx, "int64"), (-1, 1)), _to_tensor(values))
        return out

    def scatter_add(self, idx, values, numel: int):
        """A dense 1-d tensor of ``numel`` zeros with ``values`` added at ``idx``."""
        values = _to_tensor(values)
        idx = tf.reshape(_to_tensor(idx, "int64"), (-1, 1))
        numel = tf.cast(numel, tf.int64) if _is_tensor(numel) else int(numel)
        if values.dtype == tf.bool:  # np.add.at on booleans is a logical or
            counts = tf.tensor_scatter_nd_add(tf.zeros((numel,), tf.int32), idx, tf.cast(values, tf.int32))
            return counts > 0
        return tf.tensor_scatter_nd_add(tf.zeros((numel,), values.dtype), idx, values)

    def fused(self, fn, name: str, like, dynamic: bool = False):
        """``fn`` itself: nothing here fuses tensor ops."""
        return fn

    def native(self, name: str, like, dtype: str = "float32"):
        """grace.native's kernel ``name`` for a float32 tensor, when built: the
        kernels read its memory in place (CPU, or GPU through DLPack) and return TensorFlow
        tensors. Inside tf.function the call becomes a tf.py_function node, which runs the
        kernel on the step's eager tensors (when the tensor's length and the kernel's device
        are known while tracing; else None, and the method's tensor-op formula is traced)."""
        if dtype != "float32":
            return None
        if tf.executing_eagerly():
            return _native.kernel(name, like) if hasattr(like, "numpy") else None
        return graph_kernel(name, like)

    def pack(self, codes, bits: int):
        return bits_.pack_codes(self, codes, bits)

    def unpack(self, packed, bits: int, numel: int):
        return bits_.unpack_codes(self, packed, bits, numel)

    # --- linear algebra (2-d) ------------------------------------------------------------
    def matmul(self, a, b):
        dtype = _result_dtype(a, b)
        a, b = _to_tensor(a, dtype), _to_tensor(b, dtype)
        work = a.dtype
        if not (work.is_floating or work in (tf.int32, tf.int64)):  # no MatMul kernel
            work = tf.int64
            a, b = tf.cast(a, work), tf.cast(b, work)
        squeeze = []
        if a.shape.rank == 1:
            a, squeeze = a[None, :], squeeze + [-2]
        if b.shape.rank == 1:
            b, squeeze = b[:, None], squeeze + [-1]
        out = tf.linalg.matmul(a, b)
        if squeeze:
            out = tf.squeeze(out, axis=squeeze)
        if out.dtype != _tf_dtype(dtype):
            out = tf.cast(out != 0, tf.bool) if dtype == "bool" else tf.cast(out, _tf_dtype(dtype))
        return out

    def transpose(self, x):
        return tf.transpose(x)

    def divide_many(self, xs, divisor):
        return [x / divisor for x in xs]

    def orthonormalize_many(self, xs):
        return [self.orthonormalize(x) for x in xs]

    def orthonormalize(self, x):
        """Orthonormal columns spanning those of the (rows, r) ``x``: reduced QR's Q, with the
        signs that make R's diagonal non-negative, so that every backend returns the same Q.
        Half precision is factored in float32, integers in float64 (as NumPy does)."""
        x = _to_tensor(x)
        if x.shape.rank == 2 and x.shape[1] == 1 and x.dtype in (tf.float32, tf.float64):
            # x / |x| (numpy_backend's formula): QR is slow for a few columns
            wide = tf.cast(x, tf.float64)
            norm = tf.sqrt(tf.reduce_sum(wide * wide))
            first = tf.eye(tf.shape(x)[0], 1, dtype=tf.float64)
            return tf.cast(tf.where(norm == 0, first, wide / norm), x.dtype)
        work = x.dtype
        if work in (tf.float16, tf.bfloat16):
            work = tf.float32
        elif not work.is_floating:
            work = tf.float64
        q, r = tf.linalg.qr(tf.cast(x, work), full_matrices=False)
        signs = tf.where(tf.linalg.diag_part(r) < 0, tf.constant(-1, work), tf.constant(1, work))
        return tf.cast(q * signs, x.dtype)
