"""NumPy backend: the reference every other backend must agree with."""
from __future__ import annotations

import numpy as np

from grace.core import bits as bits_
from grace.core import draws
from grace.formats import numpy_dtype



def _joined(parts, dtype):
    """1-d arrays in a row (an empty one of ``dtype`` for none)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)


class NumpyBackend:
    name = "numpy"
    #: tensors can be written in place (``concat_into``, ``assign``), so buffers can be reused
    mutable_tensors = True

    # --- introspection -------------------------------------------------------------------
    def dtype(self, x) -> str:
        return np.asarray(x).dtype.name

    def shape(self, x) -> tuple:
        return tuple(np.shape(x))

    def numel(self, x) -> int:
        return int(np.size(x))

    def nbytes(self, x) -> int:
        return int(np.asarray(x).nbytes)

    # --- conversion and shaping ----------------------------------------------------------
    def asarray(self, data, like=None):
        return np.asarray(data)

    def zeros(self, numel: int, dtype: str, like=None):
        return self.cast(np.zeros(int(numel)), dtype)

    def zeros_like(self, x):
        return np.zeros_like(x)

    def empty(self, numel: int, dtype: str, like=None):
        return self.zeros(numel, dtype, like)

    def to_numpy(self, x):
        return np.asarray(x)

    def cast(self, x, dtype: str):
        return np.asarray(x).astype(numpy_dtype(dtype), copy=False)

    def flatten(self, x):
        return np.reshape(x, -1)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def concat(self, xs):
        return np.concatenate(xs)

    def split(self, x, sizes):
        return np.split(x, np.cumsum(sizes)[:-1])

    def to_bytes(self, x):
        """A 1-d tensor's raw bytes as a uint8 tensor (a view where the toolkit allows)."""
        return np.ascontiguousarray(x).view(np.uint8)

    def flat_bytes(self, xs) -> list:
        """Each tensor of ``xs`` flattened, as its raw bytes (``to_bytes``): a frame's pieces, one
        call for them all."""
        return [np.ascontiguousarray(np.reshape(x, -1)).view(np.uint8) for x in xs]

    def from_bytes(self, b, dtype: str):
        """uint8 bytes read as a 1-d tensor of ``dtype`` (their count a multiple of its size)."""
        return np.ascontiguousarray(b).view(numpy_dtype(dtype))

    def concat_into(self, xs, out):
        """concat into the preallocated ``out`` (backends whose tensors are mutable)."""
        return np.concatenate(xs, out=out)

    def concat_flat(self, xs, out=None):
        """Every tensor of ``xs`` flattened, end to end (into ``out`` where given): a bucket's
        gradients as its flat buffer."""
        return np.concatenate([np.ravel(x) for x in xs], out=out)

    def unflatten(self, flat, numels, shapes):
        """The pieces of 1-d ``flat`` of ``numels`` elements, end to end, as views of
        ``shapes``: ``concat_flat`` undone."""
        return [t.reshape(s) for t, s in zip(np.split(flat, np.cumsum(numels)[:-1]), shapes)]

    def assign(self, dst, src) -> None:
        """Write ``src`` into the tensor (or view) ``dst``."""
        dst[...] = src

    def flat_view(self, x):
        """``x``'s elements as a 1-d view of its own memory (writes to it are writes to x), or
        None where they are not one contiguous run."""
        return x.reshape(-1) if x.flags.c_contiguous else None

    def assign_many(self, dsts, srcs) -> None:
        """``assign`` of each pair (a toolkit may do them all in one multi-tensor operation)."""
        for dst, src in zip(dsts, srcs):
            dst[...] = src

    # (0-d arithmetic gives NumPy scalars, which nothing can be written into: a new result then)
    def add_into(self, a, b, out):
        """a + b written into the preallocated ``out`` (backends whose tensors are mutable)."""
        return np.add(a, b, out=out) if isinstance(out, np.ndarray) else a + b

    def subtract_into(self, a, b, out):
        return np.subtract(a, b, out=out) if isinstance(out, np.ndarray) else a - b

    def add_many_into(self, xs, ys, outs):
        """Each x + y written into its out (a toolkit may do them all in one multi-tensor
        operation)."""
        return [self.add_into(x, y, out) for x, y, out in zip(xs, ys, outs)]

    def subtract_many_into(self, xs, ys):
        """Each x - y written over x (a toolkit may do them all in one multi-tensor operation)."""
        return [self.subtract_into(x, y, x) for x, y in zip(xs, ys)]

    def matmul_into(self, a, b, out):
        """The matrix product a @ b written over ``out`` (of any shape with as many elements)."""
        if out.flags.c_contiguous:  # (then the reshape is a view of out)
            np.matmul(a, b, out=out.reshape(a.shape[0], b.shape[1]))
        else:
            out[...] = np.matmul(a, b).reshape(out.shape)
        return out

    def divide_into(self, a, b, out):
        return np.divide(a, b, out=out) if isinstance(out, np.ndarray) else a / b

    def multiply_into(self, a, b, out):
        return np.multiply(a, b, out=out) if isinstance(out, np.ndarray) else a * b

    def sign_into(self, x, out):
        return np.sign(x, out=out) if isinstance(out, np.ndarray) else np.sign(x)

    def put(self, x, idx, values):
        """x[idx] = values, in place; returns x."""
        x[idx.astype(np.int64, copy=False)] = values
        return x

    def copy(self, x):
        return np.array(x, copy=True)

    def host_ints(self, x, count: int):
        """The ``count`` values of a 1-d integer tensor as Python ints (one read from the device)."""
        return [int(v) for v in np.asarray(x).tolist()]

    def device(self, x) -> str:
        return "cpu"

    def same_layout(self, a, b) -> bool:
        """Whether tensors ``a`` and ``b`` have one shape, dtype and device (a kept buffer checked
        every step, gradient by gradient: one call, not one per property)."""
        return self.shape(a) == self.shape(b) and self.dtype(a) == self.dtype(b)

    def on_accelerator(self, x) -> bool:
        """Whether ``x`` lives on a GPU (or another device where kernel launches are dear)."""
        return False

    # --- arithmetic and selection --------------------------------------------------------
    def abs(self, x):
        return np.abs(x)

    def sign(self, x):
        return np.sign(x)

    def floor(self, x):
        return np.floor(x)

    def ceil(self, x):
        return np.ceil(x)

    def minimum(self, a, b):
        return np.minimum(a, b)

    def round(self, x):
        """To the nearest integer, halves to even."""
        return np.round(x)

    def log2(self, x):
        return np.log2(x)

    def exp2(self, x):
        return np.exp2(x)

    def where(self, mask, a, b):
        return np.where(mask, a, b).astype(np.result_type(a, b), copy=False)

    def clip_min(self, x, low):
        return np.maximum(x, low)

    def sum(self, x, axis=None):
        floating = x.dtype.kind == "f" or x.dtype.name == "bfloat16"  # ml_dtypes' bfloat16 has kind 'V'
        return np.sum(x, axis=axis, dtype=x.dtype if floating else np.int64)

    def nonfinite(self, xs, dtype: str = "float32"):
        """A one-element flag in ``dtype``: 1 where any of the tensors ``xs`` holds an inf or a NaN.
        One summing pass each (half precision sums in float32, which cannot overflow)."""
        total = sum(float(np.sum(x, dtype=np.float64 if x.dtype == np.float64 else np.float32)) for x in xs)
        return np.asarray([0 if np.isfinite(total) else 1], dtype)

    def max(self, x, axis=None):
        """Maximum; 0 for an empty tensor, like the other backends."""
        return np.max(x, axis=axis) if np.size(x) else np.zeros((), x.dtype)

    def norm(self, x, axis=None):
        """Euclidean norm, accumulated in float32 at least."""
        return np.sqrt(np.sum(np.square(x, dtype=np.promote_types(x.dtype, np.float32)), axis=axis))

    def uniform(self, numel: int, seed, like=None):
        """float32 draws in [0, 1) from the (key, step) ``seed``: counter-based (grace.core.draws)."""
        return draws.uniform_numpy([numel], [seed])

    def random_indices(self, numel: int, k: int, seed, like=None):
        """k distinct indices below ``numel``, drawn from ``seed``, sorted (int64): counter-based
        (grace.core.draws)."""
        return draws.random_indices_numpy(numel, k, seed)

    def uniform_segments(self, counts, seeds, like=None):
        """``uniform(counts[s], seeds[s])`` for every s, in a row."""
        return draws.uniform_numpy(counts, seeds) if len(counts) else np.zeros(0, np.float32)

    def indices_by_hash(self, like) -> bool:
        """Whether random indices are the k smallest hashes of the draws: never here."""
        return False

    def random_indices_segments(self, numels, ks, seeds, like=None):
        """``random_indices(numels[s], ks[s], seeds[s])`` for every s, in a row."""
        return _joined([self.random_indices(d, k, seed) for d, k, seed in zip(numels, ks, seeds)], np.int64)

    def arange(self, n: int, like=None):
        return np.arange(int(n), dtype=np.int64)

    def sort(self, x):
        return np.sort(x)

    def argsort(self, x):
        """int64 indices that sort the 1-d ``x`` ascending; ties keep their order."""
        return np.argsort(x, kind="stable").astype(np.int64, copy=False)

    def topk_indices(self, x, k: int):
        """Indices (int64, ascending) of the k largest elements of the 1-d ``x``; of those equal
        to the k-th largest, the first ones (grace.native's rule; NaN ranks as inf)."""
        k = int(k)
        if k >= x.size:
            return np.arange(x.size, dtype=np.int64)
        if x.dtype.kind == "f" and np.isnan(x).any():
            x = np.where(np.isnan(x), np.inf, x)
        kth = np.partition(x, x.size - k)[x.size - k]
        above = np.flatnonzero(x > kth)
        ties = np.flatnonzero(x == kth)[:k - above.size]
        return np.sort(np.concatenate([above, ties])).astype(np.int64, copy=False)

    def nonzero(self, mask, size=None):
        """Indices of the true elements of a 1-d mask, ascending (``size``: how many there are,
        where the caller knows it)."""
        return np.flatnonzero(mask).astype(np.int64)

    def indices_abs_at_least(self, x, threshold):
        """Indices (int64, ascending) of the elements of the 1-d ``x`` with |x| >= threshold."""
        return self.nonzero(np.abs(x) >= threshold)

    def gather(self, x, idx, axis: int = 0):
        return np.take(x, idx.astype(np.int64, copy=False), axis=axis)

    def cumsum(self, x, axis: int = 0):
        """Running sum of ``x`` along ``axis``, in its dtype."""
        return np.cumsum(x, axis=axis, dtype=x.dtype)

    def divide_cast(self, x, divisor, dtype: str):
        """``x / divisor`` computed in x's precision and rounded once to ``dtype``, with no
        temporary in x's precision."""
        out = np.empty(x.shape, dtype=numpy_dtype(dtype))
        return np.divide(x, divisor, out=out, casting="same_kind")

    def cast_multiply(self, x, dtype: str, factor):
        """``x`` cast to ``dtype`` (a new tensor, also where the dtype is x's), then multiplied
        by ``factor`` in place of that copy."""
        out = np.asarray(x).astype(numpy_dtype(dtype), copy=True)
        out *= factor
        return out

    # --- segmented ops (grace.core.segments) ---------------------------------------------
    segmented = True  # has the ops below

    def shift_right(self, x, bits: int):
        """Integers shifted right by ``bits`` (arithmetic shift)."""
        return np.right_shift(x, bits)

    def repeat(self, x, counts, total: int, starts=None):
        """Each element of ``x`` repeated ``counts`` times (``total``: their sum; ``starts``: where
        each one's repeats start, for a backend that finds each place's element from them)."""
        return np.repeat(x, counts)

    def segment_max(self, x, counts):
        """Per segment of ``counts`` elements in a row, the largest of the non-negative ``x``
        (0 where empty, as ``max``)."""
        counts = np.asarray(counts)
        out = np.zeros(len(counts), x.dtype)
        full = counts > 0
        if full.any():
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            out[full] = np.maximum.reduceat(x, starts[full])
        return out

    def segment_sum(self, x, counts):
        """Per segment of ``counts`` elements in a row, its sum in x's dtype (0 where empty):
        each segment's own ``np.sum`` (NumPy's pairwise order, which grace.native's CPU kernels
        reproduce), a run of equal segments summed as the rows of one matrix."""
        counts = np.asarray(counts, np.int64)
        out = np.zeros(len(counts), x.dtype)
        s = start = 0
        while s < len(counts):
            e = s + 1
            while e < len(counts) and counts[e] == counts[s]:
                e += 1
            size = int(counts[s]) * (e - s)
            if size:
                out[s:e] = np.sum(x[start:start + size].reshape(e - s, -1), axis=1)
            s, start = e, start + size
        return out

    def bincount(self, idx, length: int):
        """int64 counts of each value in [0, length) among the integers ``idx``."""
        return np.bincount(idx, minlength=int(length)).astype(np.int64, copy=False)

    def scatter_add_rows(self, idx_rows, value_rows, numel: int):
        """``numel`` zeros with each row of values added at its row of indices, row after row:
        the additions of ``scatter_add`` over the rows' concatenation, in that order on every
        backend and device. No row holds an index twice (a sparsifier's payload)."""
        out = np.zeros(int(numel), dtype=value_rows[0].dtype)
        for idx, values in zip(idx_rows, value_rows):
            np.add.at(out, idx, values)
        return out

    def scatter_add(self, idx, values, numel: int):
        """A dense 1-d tensor of ``numel`` zeros with ``values`` added at ``idx``."""
        out = np.zeros(int(numel), dtype=values.dtype)
        np.add.at(out, idx.astype(np.int64, copy=False), values)
        return out

    def fused(self, fn, name: str, like, dynamic: bool = False):
        """``fn`` itself: nothing here fuses tensor ops."""
        return fn

    def native(self, name: str, like, dtype: str = "float32"):
        """No native kernels here: this backend is the oracle they are tested against."""
        return None

    def pack(self, codes, bits: int):
        return bits_.pack_codes(self, codes, bits)

    def unpack(self, packed, bits: int, numel: int):
        return bits_.unpack_codes(self, packed, bits, numel)

    # --- linear algebra (2-d) ------------------------------------------------------------
    def matmul(self, a, b):
        return np.matmul(a, b)

    def divide_many(self, xs, divisor):
        """[x / divisor for x in xs] (a toolkit may do them all in one multi-tensor operation)."""
        return [x / divisor for x in xs]

    def orthonormalize_many(self, xs):
        """[orthonormalize(x) for x in xs] (a toolkit may do single columns all at once)."""
        return [self.orthonormalize(x) for x in xs]

    def transpose(self, x):
        return np.transpose(x)

    def orthonormalize(self, x):
        """Orthonormal columns spanning those of the (rows, r) ``x``: reduced QR's Q, with the
        signs that make R's diagonal non-negative, so that every backend returns the same Q.
        One column: x / |x|, the norm summed in float64 (no underflow where x is tiny), and the
        first unit vector where x is zero: QR's Q, without the factorization (slow for a few
        columns, on a GPU above all)."""
        if x.ndim == 2 and x.shape[1] == 1 and x.dtype in (np.float32, np.float64):
            wide = x.astype(np.float64)
            norm = np.sqrt(np.sum(wide * wide))
            return (np.eye(x.shape[0], 1) if norm == 0 else wide / norm).astype(x.dtype)
        q, r = np.linalg.qr(x, mode="reduced")
        return (q * np.where(np.diagonal(r) < 0, -1, 1)).astype(x.dtype, copy=False)
