"""PyTorch backend: the same operations as the NumPy reference, on the tensor's own device."""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch

from grace import native as _native
from grace.backends import torch_fusion
from grace.native._arrays import torch_dtype_name
from grace.core import bits as bits_
from grace.core import draws
from grace.core.tensors import constant, get_backend

#: the elements below which ``nonfinite`` sums a tensor joined with the other small ones
SMALL_JOINED = 1 << 12


# --- draws on an accelerator: counter-based (grace.core.draws), by whole-buffer ops -----------
def _int64s(values, device):
    """Host ints as an int64 tensor on ``device``; to a GPU from pinned memory, so that the
    copy is queued on the stream without waiting for it."""
    return torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _layout(what: str, of, device, make=None):
    """Host ints of a layout (``of`` itself, or ``make()`` from it: segment sizes, starts, seeds'
    keys) as an int64 tensor on ``device``, made once (``constant``: a plain dict, whose entries
    torch.compile reads as constants of the program, not made again at every call)."""
    return constant(get_backend("torch"), ("int64 layout", what, tuple(of), device),
                    lambda: _int64s([int(v) for v in (make() if make else of)], device), None)


def _segments(counts, device):
    """For segments of ``counts`` elements in a row: (each element's segment, each segment's
    start, each element's position in its segment), as int64 tensors on ``device``."""
    total, sizes = sum(counts), _layout("sizes", counts, device)
    segment = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes, output_size=total)
    starts = _layout("starts", counts, device, lambda: [0, *itertools.accumulate(counts[:-1])])
    return segment, starts, torch.arange(total, device=device) - starts[segment]


def _seed_words(seeds, device):
    """Each (key, step) seed's two words, (seeds, 2) int64 on ``device``: from the host, or
    where the steps are tensors (a fused program's input) mixed in on the device."""
    if not torch.is_tensor(seeds[0][1]):
        return _int64s([draws.seed_words(seed) for seed in seeds], device)
    keys = _layout("seed keys", [key for key, _ in seeds], device)
    steps = torch.stack([step.reshape(()) for _, step in seeds])  # (all tensors: a fused program's)
    return torch.stack(draws.step_words(draws.key_words(keys), steps), 1)


def _counter_hashes(counts, seeds, device):
    """(32-bit hashes of draws 0 .. counts[s] - 1 of each seed, in a row (int64); each draw's
    segment; each segment's start). One set of whole-buffer ops, however many segments."""
    words = _seed_words(seeds, device)
    segment, starts, j = _segments(counts, device)  # j: each draw's number within its seed
    return draws.draw_hashes(j, (words[:, 0][segment], words[:, 1][segment])), segment, starts


def _drawn_natively(name: str, dtype, counts, seeds, device):
    """grace.native's kernel ``name`` (uniform_segments, hash_keys_segments: one launch for all
    segments) into a new tensor on ``device``, or None where it does not run there."""
    if seeds and torch.is_tensor(seeds[0][1]):  # (its words are made on the device)
        return None
    out = torch.empty(sum(counts), dtype=dtype, device=device)
    return _native.run(name, out, counts, [draws.seed_words(seed) for seed in seeds], out)


def _taken(numels: tuple, ks: tuple, device):
    """Random indices of segments of ``numels`` elements, ``ks`` of each: where each taken one
    lies in the segments' sorted elements, and its segment's start (int64 on ``device``; made
    once per layout, as a bucket's is the same every step: ``constant``)."""
    starts = _int64s([0, *np.cumsum(numels)[:-1].tolist()], device)
    taken_segment, _, rank = _segments(ks, device)  # the taken: each one's segment and rank in it
    first = starts[taken_segment]
    return first + rank, first


def _single_column(x) -> bool:
    return x.dim() == 2 and x.shape[1] == 1 and x.dtype in (torch.float32, torch.float64)


@functools.lru_cache(maxsize=64)
def _column_layout(rows: tuple, device):
    """Single columns of ``rows`` elements joined: each one's count (int64) and a float64 mask
    of their first elements, on ``device`` (made once per layout)."""
    counts = torch.tensor(rows, dtype=torch.int64)
    first = torch.zeros(sum(rows), dtype=torch.float64)
    first[torch.cumsum(counts, 0) - counts] = 1.0
    return counts.to(device), first.to(device)


def _like(host, like):
    """A tensor made on the host, on like's device."""
    return host if like is None else host.to(like.device)


def _counter_indices(backend, like) -> bool:
    """Whether random indices are those of the k smallest hashes (an accelerator: one sort over a
    bucket); elsewhere they are the first k distinct index draws, the NumPy backend's
    (grace.core.draws)."""
    return like is not None and backend.on_accelerator(like)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"no torch dtype named {name!r}")
    return dtype


class TorchBackend:
    name = "torch"
    mutable_tensors = True

    # --- introspection -------------------------------------------------------------------
    def dtype(self, x) -> str:
        return torch_dtype_name(x.dtype)

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def numel(self, x) -> int:
        return x.numel()

    def nbytes(self, x) -> int:
        return x.numel() * x.element_size()

    # --- conversion and shaping ----------------------------------------------------------
    def asarray(self, data, like=None):
        device = like.device if like is not None else None
        if device is not None and device.type == "cuda":  # from pinned memory: queued, the host does not wait
            return torch.as_tensor(np.asarray(data)).pin_memory().to(device, non_blocking=True)
        return torch.as_tensor(np.asarray(data), device=device)

    def zeros(self, numel: int, dtype: str, like=None):
        return torch.zeros(int(numel), dtype=_dtype(dtype), device=like.device if like is not None else None)

    def zeros_like(self, x):
        return torch.zeros_like(x)

    def empty(self, numel: int, dtype: str, like=None):
        """Uninitialised: for a kernel that writes every element (no fill launched)."""
        return torch.empty(int(numel), dtype=_dtype(dtype), device=like.device if like is not None else None)

    def to_numpy(self, x):
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.detach().cpu().numpy()

    def cast(self, x, dtype: str):
        if not torch.is_tensor(x):  # a Python number, e.g. a count
            return torch.as_tensor(x, dtype=_dtype(dtype))
        wanted = _dtype(dtype)
        return x if x.dtype == wanted else x.to(wanted)  # (x.to of its own dtype is x, after a dispatch)

    # x itself where it has the shape already: a view costs about 1.5 us, and a bucket asks for
    # one per gradient and step (not inside a compiled program: a comparison of symbolic sizes
    # would guard on them)
    def flatten(self, x):
        return x if not torch.compiler.is_compiling() and x.dim() == 1 else x.reshape(-1)

    def reshape(self, x, shape):
        if torch.compiler.is_compiling():
            return x.reshape(shape)
        # (a -1 where x has the other sizes: x, as PowerSGD's (rows, -1) of a matrix)
        same = x.shape == shape or len(x.shape) == len(shape) and all(a == b or b == -1 for a, b in zip(x.shape, shape))
        return x if same else x.reshape(shape)

    def concat(self, xs):
        return torch.cat(list(xs))

    def split(self, x, sizes):
        return list(torch.split(x, [int(s) for s in sizes]))

    def to_bytes(self, x):
        x = x.contiguous()  # (an empty tensor's stride may be 0, which view refuses)
        return x.view(torch.uint8) if x.numel() else x.new_empty(0, dtype=torch.uint8)

    def flat_bytes(self, xs) -> list:
        return [x.reshape(-1).contiguous().view(torch.uint8) if x.numel() else x.new_empty(0, dtype=torch.uint8)
                for x in xs]

    def from_bytes(self, b, dtype: str):
        return b.view(_dtype(dtype))  # a view: bucket frames keep every piece aligned

    def concat_into(self, xs, out):
        return torch.cat(list(xs), out=out)

    def concat_flat(self, xs, out=None):
        return torch.cat([x.reshape(-1) for x in xs], out=out)

    def unflatten(self, flat, numels, shapes):
        return [t.view(s) for t, s in zip(torch.split(flat, list(numels)), shapes)]

    def assign(self, dst, src) -> None:
        dst.copy_(src)

    def flat_view(self, x):
        return x.view(-1) if x.is_contiguous() else None

    def assign_many(self, dsts, srcs) -> None:
        if len(dsts) > 1:  # one dispatch (one multi-tensor kernel on a GPU), not one per tensor
            torch._foreach_copy_(list(dsts), list(srcs))
        else:
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)

    def add_into(self, a, b, out):
        return torch.add(a, b, out=out)

    def subtract_into(self, a, b, out):
        return torch.sub(a, b, out=out)

    def add_many_into(self, xs, ys, outs):
        if len(xs) > 1 and self.on_accelerator(xs[0]):  # out = x, then out += y: the same sums
            torch._foreach_copy_(outs, xs)
            torch._foreach_add_(outs, ys)
            return list(outs)
        return [torch.add(x, y, out=out) for x, y, out in zip(xs, ys, outs)]

    def subtract_many_into(self, xs, ys):
        if len(xs) > 1 and self.on_accelerator(xs[0]):  # one multi-tensor kernel, not a launch each
            torch._foreach_sub_(xs, ys)
            return list(xs)
        return [torch.sub(x, y, out=x) for x, y in zip(xs, ys)]

    def matmul_into(self, a, b, out):
        """The matrix product a @ b written over ``out`` (of any shape with as many elements)."""
        if out.is_contiguous():  # (then the view is out's memory)
            torch.matmul(a, b, out=out.view(a.shape[0], b.shape[1]))
        else:
            out.copy_((a @ b).reshape(out.shape))
        return out

    def divide_into(self, a, b, out):
        return torch.div(a, b, out=out)

    def multiply_into(self, a, b, out):
        return torch.mul(a, b, out=out)

    def sign_into(self, x, out):
        return torch.sign(x, out=out)

    def put(self, x, idx, values):
        return x.index_put_((idx.long(),), values)

    def copy(self, x):
        return x.clone()

    def host_ints(self, x, count: int):
        return x.tolist()

    def device(self, x) -> str:
        return "cpu" if x.is_cpu else str(x.device)  # (asked per gradient and step: str(device) costs 0.3 us)

    def same_layout(self, a, b) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device

    def on_accelerator(self, x) -> bool:
        return x.device.type != "cpu"

    # --- arithmetic and selection --------------------------------------------------------
    def abs(self, x):
        return x.abs()

    def sign(self, x):
        return torch.sign(x)

    def floor(self, x):
        return torch.floor(x)

    def ceil(self, x):
        return torch.ceil(x) if torch.is_tensor(x) else float(math.ceil(x))

    def minimum(self, a, b):
        if torch.is_tensor(a) or torch.is_tensor(b):
            return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
        return min(a, b)

    def round(self, x):
        return torch.round(x)

    def log2(self, x):
        return torch.log2(x)

    def exp2(self, x):
        return torch.exp2(x)

    def where(self, mask, a, b):
        return torch.where(mask, a, b)

    def clip_min(self, x, low):
        return x.clamp(min=low) if torch.is_tensor(x) else max(x, low)

    def sum(self, x, axis=None):
        if x.dtype.is_floating_point:
            return x.sum() if axis is None else x.sum(dim=axis)
        return x.sum(dtype=torch.int64) if axis is None else x.sum(dim=axis, dtype=torch.int64)

    def nonfinite(self, xs, dtype: str = "float32"):
        """A one-element flag: 1 where any of the tensors ``xs`` holds an inf or a NaN, in ``dtype``
        (float32: an allreduce's extra element; uint8: a frame's byte). One pass over them on the
        device, with no read back to the host (half precision summed in float32, which cannot
        overflow)."""
        xs = list(xs)
        if len(xs) > 1 and self.on_accelerator(xs[0]) \
                and all(x.dtype in (torch.float16, torch.bfloat16, torch.float32) for x in xs):
            # every tensor's L1 norm by one multi-tensor kernel (a few launches, not one per
            # tensor): an inf or a NaN anywhere makes it non-finite, as it does the sum. (On a
            # CPU the plain sums are faster: about 3x on 96 gradients of 1 MB.)
            total = torch.stack(torch._foreach_norm(xs, 1, dtype=torch.float32)).sum()
        else:
            # small tensors (a model's biases and norms) joined and summed by one op, in float64: a
            # sum per tensor costs more than its elements (ResNet-50's 107: 0.28 -> 0.10 ms alone)
            small = [x if x.dim() == 1 else x.reshape(-1) for x in xs if x.numel() <= SMALL_JOINED]
            small = small if len(small) > 1 else []
            sums = [x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
                    for x in xs if not small or x.numel() > SMALL_JOINED]
            sums += [torch.cat(small).sum(dtype=torch.float64)] if small else []
            total = sums[0] if len(sums) == 1 else torch.stack([s.double() for s in sums]).sum()
        # total - total: +0 where finite, NaN where not (inf - inf): made the flag by one more op
        if dtype == "uint8":
            return (total - total).ne(0).view(torch.uint8).reshape(1)
        return torch.nan_to_num((total - total).to(_dtype(dtype)), nan=1.0).reshape(1)

    def max(self, x, axis=None):
        if x.numel() == 0:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        return x.max() if axis is None else x.max(dim=axis).values

    def norm(self, x, axis=None):
        if axis is None and x.dtype == torch.float32 and not self.on_accelerator(x) and not x.requires_grad:
            out = _native.run("norm", x, x)  # NumPy's sum, bit for bit (one pass in csrc/) when built
            if out is not None:
                return out.reshape(())
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        return torch.linalg.vector_norm(x) if axis is None else torch.linalg.vector_norm(x, dim=axis)

    def uniform(self, numel: int, seed, like=None):
        """float32 draws in [0, 1), counter-based (grace.core.draws): every backend's."""
        return self.uniform_segments([int(numel)], [seed], like)

    def uniform_segments(self, counts, seeds, like=None):
        """``uniform(counts[s], seeds[s])`` for every s, in a row: by one native call where
        built, elsewhere by whole-buffer ops for all segments at once."""
        if like is None or not self.on_accelerator(like):
            return _like(torch.from_numpy(draws.uniform_host(counts, seeds)), like)
        device = like.device
        drawn = _drawn_natively("uniform_segments", torch.float32, counts, seeds, device)
        if drawn is not None:
            return drawn
        hashes, _, _ = _counter_hashes(counts, seeds, device)
        return (hashes >> 8).to(torch.float32) * draws.UNIT

    def random_indices(self, numel: int, k: int, seed, like=None):
        return self.random_indices_segments([int(numel)], [int(k)], [seed], like)

    def indices_by_hash(self, like) -> bool:
        """Whether random indices for tensors ``like`` are the k smallest hashes of the draws (a
        kernel that ranks the draws may make them instead)."""
        return _counter_indices(self, like)

    def random_indices_segments(self, numels, ks, seeds, like=None):
        """``random_indices(numels[s], ks[s], seeds[s])`` for every s, in a row. On a GPU a
        segment's indices are those of its ks[s] smallest hashes (ties: the lowest index),
        from one stable sort of (segment, hash) over all segments."""
        if not _counter_indices(self, like):
            return _like(torch.from_numpy(draws.random_indices_host(numels, ks, seeds)), like)
        device = like.device if like is not None else torch.device("cpu")
        keys = _drawn_natively("hash_keys_segments", torch.int64, numels, seeds, device)
        if keys is None:
            hashes, segment, _ = _counter_hashes(numels, seeds, device)
            keys = (segment << 32) | hashes
        order = torch.sort(keys, stable=True).indices  # each segment's elements, in a row
        numels, ks = tuple(numels), tuple(ks)  # (a plain dict's constant: torch.compile reads it as one)
        places, first = constant(self, ("taken", numels, ks), lambda: _taken(numels, ks, device), like)
        return torch.sort(order[places]).values - first  # ascending within each segment

    def arange(self, n: int, like=None):
        return torch.arange(int(n), device=like.device if like is not None else None)

    def sort(self, x):
        return torch.sort(x).values

    def argsort(self, x):
        return torch.sort(x, stable=True).indices

    def topk_indices(self, x, k: int):
        k = int(k)
        if k >= x.numel():
            return torch.arange(x.numel(), device=x.device)
        if x.dim() == 1:  # native radix select (csrc/) when built: linear time, indices ascending
            idx = _native.run("topk_indices", x, x, k)
            if idx is not None:
                return idx
            # grace.native's rule, as NumPy's backend keeps it: of the elements equal to the k-th
            # largest, the first ones (a stable sort; torch.topk takes ties in any order), NaN as inf
            inf = float("inf")
            keys = torch.nan_to_num(x, nan=inf, posinf=inf, neginf=-inf) if x.is_floating_point() else x
            return torch.sort(torch.sort(keys, descending=True, stable=True).indices[:k]).values
        return torch.topk(x, k, sorted=False).indices

    def nonzero(self, mask, size=None):
        if size is not None and self.on_accelerator(mask):  # a known count: no wait for the GPU to tell it
            try:
                return torch.nonzero_static(mask, size=int(size)).reshape(-1)
            except NotImplementedError:  # a torch without the CUDA kernel
                pass
        if mask.dim() == 1 and not self.on_accelerator(mask):  # on a GPU torch's compaction is faster (H200)
            idx = _native.run("nonzero", mask, mask)
            if idx is not None:
                return idx
        return torch.nonzero(mask, as_tuple=True)[0]

    def indices_abs_at_least(self, x, threshold):
        """Indices (int64, ascending) of the elements of the 1-d ``x`` with |x| >= threshold:
        on a CPU one native pass, with no |x| or mask tensor."""
        if not self.on_accelerator(x):
            idx = _native.run("threshold_indices", x, x, float(threshold))
            if idx is not None:
                return idx
        return self.nonzero(x.abs() >= threshold)

    def gather(self, x, idx, axis: int = 0):
        return x.index_select(axis, idx.long()) if axis else x[idx.long()]

    def cumsum(self, x, axis: int = 0):
        return torch.cumsum(x, axis, dtype=x.dtype)

    def scatter_add(self, idx, values, numel: int):
        if idx.dim() == 1 and values.dim() == 1:
            out = _native.run("scatter_add", values, idx, values, numel)
            if out is not None:
                return out
        out = torch.zeros(int(numel), dtype=values.dtype, device=values.device)
        return out.index_add_(0, idx.long(), values)

    def divide_cast(self, x, divisor, dtype: str):
        # one kernel, computed in x's precision and stored in dtype: no full-size temporary
        return torch.div(x, divisor, out=torch.empty(x.shape, dtype=_dtype(dtype), device=x.device))

    def cast_multiply(self, x, dtype: str, factor):
        return x.to(_dtype(dtype), copy=True).mul_(factor)  # (a copy even in x's dtype: x is not ours)

    # --- segmented ops (grace.core.segments) ---------------------------------------------
    segmented = True

    def shift_right(self, x, bits: int):
        return torch.bitwise_right_shift(x, bits)

    def repeat(self, x, counts, total: int, starts=None):
        if starts is not None and torch.compiler.is_compiling():  # (inductor would scan and search:
            # a search of the known starts alone, the gather fused into its users)
            return x[torch.searchsorted(starts, torch.arange(int(total), device=x.device), right=True) - 1]
        return torch.repeat_interleave(x, counts, output_size=int(total))  # (the size given: no sync)

    def segment_max(self, x, counts):
        return torch.segment_reduce(x, "max", lengths=counts, unsafe=True, initial=0)  # (x >= 0)

    def segment_sum(self, x, counts):
        if not counts.numel():
            return torch.zeros(0, dtype=x.dtype, device=x.device)
        # in float64, each segment by its own block on a GPU (CUB), in turn on a CPU: alone, the
        # same bits
        return torch.segment_reduce(x.double(), "sum", lengths=counts, unsafe=True).to(x.dtype)

    def bincount(self, idx, length: int):
        # integer additions: the same counts in any order (torch.bincount reads its length
        # back from the GPU)
        ones = torch.ones(1, dtype=torch.int64, device=idx.device).expand(idx.numel())
        return torch.zeros(int(length), dtype=torch.int64, device=idx.device).index_add_(0, idx, ones)

    def scatter_add_rows(self, idx_rows, value_rows, numel: int):
        out = _native.run("scatter_add_many", value_rows[0], list(zip(value_rows, idx_rows)), numel)  # row after row
        if out is not None:
            return out
        out = torch.zeros(int(numel), dtype=value_rows[0].dtype, device=value_rows[0].device)
        for idx, values in zip(idx_rows, value_rows):  # a sparsifier's row: no index twice, so a
            out.index_add_(0, idx.long(), values)  # GPU's atomics add one value per element per row
        return out

    # --- native kernels ------------------------------------------------------------------
    def pack(self, codes, bits: int):
        packed = _native.run("pack", codes, codes, bits)  # one pass (csrc/) when built
        return bits_.pack_codes(self, codes, bits) if packed is None else packed

    def unpack(self, packed, bits: int, numel: int):
        codes = _native.run("unpack", packed, packed, bits, numel) if bits != 8 else None
        return bits_.unpack_codes(self, packed, bits, numel) if codes is None else codes

    def fused(self, fn, name: str, like, dynamic: bool = False):
        """``fn``, a function of tensors without side effects, as a few fused kernels where its
        ops would each launch one (an accelerator: ``torch_fusion``); else ``fn`` itself.
        ``dynamic``: its sizes vary by call."""
        return torch_fusion.fused(fn, name, like, dynamic)

    def native(self, name: str, like, dtype: str = "float32"):
        """grace.native's kernel ``name`` for a float32 gradient on the device of ``like``, when it
        is built (None otherwise: the method's tensor-op formula runs)."""
        return _native.kernel(name, like) if dtype == "float32" and not like.requires_grad else None

    # --- linear algebra (2-d) ------------------------------------------------------------
    def matmul(self, a, b):
        return a @ b

    def transpose(self, x):
        return x.T

    def orthonormalize(self, x):
        if _single_column(x):
            if self.on_accelerator(x):
                return self.orthonormalize_many([x])[0]  # (so that one alone gets what it gets among others)
            # x / |x| (numpy_backend's formula): QR is slow for a few columns
            wide = x.double()
            norm = torch.linalg.vector_norm(wide)
            return (torch.eye(x.shape[0], 1, dtype=torch.float64) if norm == 0 else wide / norm).to(x.dtype)
        q, r = torch.linalg.qr(x, mode="reduced")
        return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)

    def orthonormalize_many(self, xs):
        """Each x orthonormalised; on an accelerator the single columns all at once (the NumPy
        backend's formula: x / |x| in float64, the first unit vector where x is zero): joined in
        one float64 buffer, their norms by one multi-tensor kernel (each tensor's alone, so one
        gets what it gets among others), divided by a few whole-buffer operations, not ~8
        launches a column."""
        out = list(xs)
        columns = [i for i, x in enumerate(xs) if _single_column(x) and self.on_accelerator(x)]
        for i, x in enumerate(xs):
            if i not in columns:
                out[i] = self.orthonormalize(x)
        for dtype in {xs[i].dtype for i in columns}:
            chosen = [i for i in columns if xs[i].dtype == dtype]
            rows = tuple(xs[i].shape[0] for i in chosen)
            wide = torch.cat([xs[i].reshape(-1) for i in chosen]).double()
            norms = torch.stack(torch._foreach_norm(list(wide.split(rows)), 2))
            counts, first = _column_layout(rows, wide.device)
            norm = torch.repeat_interleave(norms, counts, output_size=wide.numel())  # (the size given: no wait)
            units = torch.where(norm == 0, first, wide / norm).to(dtype).split(rows)
            for i, unit in zip(chosen, units):
                out[i] = unit.reshape(-1, 1)
        return out

    def divide_many(self, xs, divisor):
        if len(xs) > 1:  # one multi-tensor kernel on a GPU, not a launch each; one dispatch on a CPU
            return list(torch._foreach_div(xs, divisor))
        return [x / divisor for x in xs]
