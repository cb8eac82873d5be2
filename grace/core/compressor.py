"""The Compressor role of the GRACE pipeline (Xu et al. 2021, §IV; docs/methods.md).

A compressor is a pure function pair written against a backend ``xp`` (see
``grace.backends``), so one implementation serves NumPy, PyTorch and TensorFlow:

    payload, ctx = compress(xp, x, info)     # payload: tuple of tensors that travel
    x_hat        = decompress(xp, payload, ctx)
    g_hat        = aggregate(xp, [payload_1..payload_n], ctx)   # allgather / broadcast methods

``ctx`` never travels. It may hold only what every rank knows identically (shape, dtype,
indices drawn from a shared seed), because a rank decodes its peers' payloads with its own ctx.
Everything data-dependent (values, norms, lengths) is part of the payload.

Two extensions, each used by the methods that need it:

* Per-tensor state (signum's momentum, PowerSGD's Q) is explicit, as in optax: ``step(xp, x,
  info, state) -> (payload, ctx, state)``. The caller keeps the state and checkpoints it.
* A method whose compression itself needs a collective (PowerSGD: P must be summed before Q
  is computed) sets ``multi_round`` and writes ``rounds(xp, x, info, state, out=None)``, a
  generator that yields each payload to be summed by allreduce, receives the sum, and finally
  returns ``(g_hat, p_hat, state)``: the mean over ranks, what this rank's input became (for
  the memory: e = p - p_hat), and the new state. ``out`` (a tensor like x, where the result
  will be written anyway: the gradient, for in-place adapters) may receive g_hat directly.
  A bucket's tensors go through their rounds together (``rounds_many``: one allreduce per
  round for the bucket), which a method may write for itself to batch its work.
"""
from __future__ import annotations

import enum
import itertools
import math
import numbers
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from grace.core import draws
from grace.formats import index_dtype  # noqa: F401  (re-exported: methods import it from here)
from grace.native import NativeUnavailable

Payload = Tuple[Any, ...]


class Collective(str, enum.Enum):
    """How the payloads of all ranks are combined on the wire."""

    ALLREDUCE = "allreduce"  # payloads are summed elementwise: needs a linear decompress
    ALLGATHER = "allgather"  # every rank receives every payload, then aggregates locally
    BROADCAST = "broadcast"  # each rank broadcasts its payload in turn, then aggregates locally

    @classmethod
    def parse(cls, value: "str | Collective") -> "Collective":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(c.value) for c in cls)
            raise ValueError(f"communicator must be one of {names}, got {value!r}") from None


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class TensorInfo:
    """What a compressor may know about the tensor it compresses, identical on every rank."""

    name: str
    step: Any  # int; a scalar tensor under tf.function
    world_size: int
    rank: int = 0

    def seed(self, base_seed: int = 0) -> Tuple[int, Any]:
        """A seed shared by all ranks for this (tensor, step), stable across processes:
        (key, step). The key is a Python int below 2**63; the step may be a tensor (a
        TensorFlow step counter inside tf.function), so backends take the pair as it is."""
        return zlib.crc32(self.name.encode()) | (base_seed % 2**24) << 32, self.step

    def rank_seed(self, base_seed: int = 0) -> Tuple[int, Any]:
        """A seed of this rank's own for this (tensor, step): independent draws on every rank."""
        key, step = self.seed(base_seed)
        return key | ((self.rank + 1) % 2**7) << 56, step


@dataclass(frozen=True)
class Shape:
    """The part of ctx that every method needs: how to rebuild the dense tensor."""

    shape: Tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Traits:
    """What a method declares about itself: the exchange and its plans read these, never probe.
    A subclass states its own: ``traits = Traits(sparse=True)``, or
    ``dataclasses.replace(Parent.traits, ...)``."""

    #: allreduce is possible: decompress is linear and all payloads share shape and dtype
    supports_allreduce: bool = False
    #: payload lengths differ between ranks (the exchange then sends the lengths too)
    variable_length: bool = False
    #: compression needs several allreduce rounds (see ``Compressor.rounds``)
    multi_round: bool = False
    #: the payload is (values, indices) of some elements, new tensors (gathered, not views of
    #: the input), and decompress adds them into zeros (grace.compressors.sparse): a memory can
    #: apply a payload to the few elements it names
    sparse: bool = False
    #: every element is compressed on its own, with no statistic, draw or state of its tensor,
    #: so a bucket of tensors compresses as one flat tensor with the same result
    elementwise: bool = False
    #: an inf or NaN in the input reaches every rank's result by itself, and the method keeps
    #: no state: with no memory either, the exchange need not flag overflows
    passes_nonfinite: bool = False
    #: the payload tensor that holds an inf or a NaN wherever the input does, on every backend:
    #: top-k's values (0: they rank above every number, and k >= 1), EF-signSGD's and 1-bit
    #: SGD's means and QSGD's norms (1: sums of |x|, x and x^2, which also flag a sum that
    #: overflows). The overflow flag is read from those few numbers instead of from a pass
    #: over the gradient. (Not TernGrad's max|x|: a GPU's max may drop a NaN.)
    nonfinite_field: Optional[int] = None
    #: the per-tensor state is the same on every rank (PowerSGD's Q), not the rank's own
    shared_state: bool = False
    #: E[decompress(compress(x))] = x: its rounding or scaling is right on average
    unbiased: bool = False
    #: compress returns new tensors, never views of its input: an exchange may compensate into
    #: a buffer that the step writes again (the new memory over p) before the payload is sent
    new_payload: bool = False


class Compressor:
    """Base class. Subclasses set ``collective`` (and ``traits``) and implement compress/decompress."""

    collective: Collective = Collective.ALLGATHER
    traits: Traits = Traits()
    #: segment_fields, compress_segments and aggregate_segments exist: on an accelerator a
    #: bucket's gradients are compressed in one pass over its flat buffer, each with the
    #: per-tensor result (grace.core.segments)
    segmented: bool = False
    #: segmented methods with kernels in grace.native: "<name>_compress_segments" and
    #: "<name>_decompress_segments" run the per-tensor kernels on every segment in one call
    segment_kernel: str = ""
    #: grace.native's kernel that decodes every rank's payload of a tensor and adds them in one
    #: pass (each payload tensor of all ranks concatenated; then ``segment_arguments``), where
    #: it has one
    sum_kernel: str = ""
    #: grace.native.compress_many's name for this method, where it compresses a bucket's
    #: gradients in one call (CPU; its arguments after the draws: ``segment_arguments``)
    many_kernel: str = ""

    def compress(self, xp, x, info: TensorInfo) -> Tuple[Payload, Any]:
        raise NotImplementedError

    def ideal_bits(self, xp, payload: Payload, ctx) -> float:
        """The ideal wire cost of ``payload`` in bits: the 'bits (ideal)' column of docs/methods.md,
        with indices at the width of ``index_dtype``. Multi-round methods: all rounds' payloads."""
        raise NotImplementedError

    def init_state(self, xp, x, info: TensorInfo):
        """Per-tensor state before the first step (None: the method keeps none)."""
        return None

    def step(self, xp, x, info: TensorInfo, state) -> Tuple[Payload, Any, Any]:
        """compress with per-tensor state (from ``init_state`` at the first step); stateless
        methods need not override it."""
        payload, ctx = self.compress(xp, x, info)
        return payload, ctx, state

    def compress_with_residual(self, xp, g, residual, beta: float, gamma: float, info: TensorInfo, out=None):
        """Optional fast path for residual memory: p = gamma * g + beta * residual, compress(p)
        and the new residual p - decompress(compress(p)) in one pass over memory (a native
        kernel, writing the residual into ``out`` when given). (payload, ctx, new residual), or
        None: the pipeline runs the steps apart."""
        return None

    def segment_fields(self, numels: Sequence[int], dtype: str):
        """Segmented methods: per payload position, (element count per segment, wire dtype per
        segment) of what each segment of ``numels`` elements would send alone."""
        raise NotImplementedError

    def segment_arguments(self) -> tuple:
        """What the segment kernels take after the segments (and the draws): the method's
        parameters (QSGD: levels, bucket size)."""
        return ()

    def segment_draws(self, numels: Sequence[int]):
        """Random methods: how many uniform draws ``compress`` makes for tensors of ``numels``
        elements, from ``info.rank_seed(self.seed)``; None: it draws none."""
        return None

    def compress_segments(self, xp, p, table, infos: Sequence[TensorInfo]):
        """Segmented methods: every segment of the flat ``p`` compressed, as (fields, ctx,
        p_hat): field j holds all segments' j-th payload tensors in a row; p_hat is what ``p``
        becomes (each segment's own payload decompressed; None: the caller asks
        ``decompress_segments``). ``infos``: each segment's TensorInfo. By default the segment
        kernels where built, else each segment's own ``compress`` in turn."""
        fused = xp.fused(f"{self.segment_kernel}_compress_segments", p, xp.dtype(p)) if self.segment_kernel else None
        if fused:
            counts = table.cached("draws", lambda: self.segment_draws(table.numels))
            draws = () if counts is None else uniform_draws(xp, counts, infos, self.seed, p)
            return fused(p, table.starts, table.numels, *draws, *self.segment_arguments()), None, None
        payloads = [self.compress(xp, p[start:start + n], info)[0]
                    for start, n, info in zip(table.starts, table.numels, infos)]
        return [xp.concat(list(field)) for field in zip(*payloads)], None, None

    def compress_many(self, xp, gs, infos: Sequence[TensorInfo], flag=None, into=None):
        """``compress`` of every gradient of a bucket (stateless methods) in one native call,
        where the method has one (``many_kernel``) and the step is a known int: a list of
        (payload, ctx), or None. Random methods draw from each gradient's rank seed, as
        ``compress`` does. ``flag``, ``into``: as ``Feedback.fused_steps``'."""
        if not self.many_kernel or type(self).step is not Compressor.step:  # (a step with state: Signum's)
            return None
        if not isinstance(infos[0].step, numbers.Integral):
            return None
        drawn = self.segment_draws([1]) is not None  # (a random method: it draws)
        words = [draws.seed_words(info.rank_seed(self.seed)) for info in infos] if drawn else None
        done = native_or_none(xp, "compress_many", gs[0], self.many_kernel, gs, words, *self.segment_arguments(),
                              nonfinite=flag, into=into)
        return None if done is None else [(payload, Shape(xp.shape(g), xp.dtype(g))) for payload, g in zip(done, gs)]

    def compress_many_with_residual(self, xp, gs, residuals, beta: float, gamma: float, infos, outs, flag=None,
                                    into=None):
        """``compress_with_residual`` of every gradient of a bucket in one native call, the new
        residuals written into ``outs``: a list of (payload, ctx, new residual), or None.
        ``flag``, ``into``: as ``Feedback.fused_steps``'."""
        return None

    def compress_segments_with_residual(self, xp, g, residual, beta: float, gamma: float, table, infos):
        """Segmented methods: residual memory's step for every segment in one go (the segmented
        ``compress_with_residual``): (fields, ctx, new residual), or None."""
        return None

    def decompress_segments(self, xp, fields, ctx, table):
        """Segmented methods: every segment's decompress, flat (allreduce methods: of the
        summed fields). By default the segment kernel where built, else each segment's own
        ``decompress`` in turn."""
        fused = xp.fused(f"{self.segment_kernel}_decompress_segments", fields[0], "float32") \
            if self.segment_kernel else None
        if fused:
            return fused(*fields, table.numels, *self.segment_arguments())
        offsets = table.cached("field offsets", lambda: [
            [0, *itertools.accumulate(counts)] for counts, _ in self.segment_fields(table.numels, "float32")])
        return xp.concat([
            xp.flatten(self.decompress(xp, tuple(f[o[s]:o[s + 1]] for f, o in zip(fields, offsets)),
                                       Shape((n,), "float32")))
            for s, n in enumerate(table.numels)])

    def aggregate_segments(self, xp, fields, ctx, table, ranks: int):
        """Segmented allgather methods: the flat mean over ``ranks`` of the received fields
        (each a (ranks, field size) tensor). By default ``aggregate``'s: decode each rank's
        payloads and add them, rank after rank."""
        total = self.decompress_segments(xp, [f[0] for f in fields], ctx, table)
        for r in range(1, ranks):
            total = total + self.decompress_segments(xp, [f[r] for f in fields], ctx, table)
        return total / ranks

    def rounds(self, xp, x, info: TensorInfo, state, out=None):
        """Multi-round methods only: a generator, see the module docstring."""
        raise NotImplementedError

    def rounds_many(self, xp, xs, infos: Sequence[TensorInfo], states, outs=None, firsts=None, residual_over=None):
        """Multi-round methods: all of a bucket's rounds in one generator. Each round yields the
        list of every tensor's payload (an empty tuple once a tensor's rounds are done), all
        summed by one allreduce, and receives their sums; it returns every tensor's (g_hat,
        p_hat, state), as ``rounds`` does for one. ``firsts[i]`` (optional): tensor i's first
        payload where ``firsts_with_residual`` made it; ``residual_over[i]``: the rounds then
        write x_i - p_hat over x_i in their last pass. By default each tensor's ``rounds``
        side by side."""
        assert not any(firsts or []), "firsts come from a method's own firsts_with_residual"
        count = len(xs)
        running = [self.rounds(xp, x, info, state, out)
                   for x, info, state, out in zip(xs, infos, states, outs or [None] * count)]
        payloads, results = [next(r) for r in running], [None] * count
        while any(result is None for result in results):
            summed = yield payloads
            payloads = [()] * count
            for i, total in enumerate(summed):
                if results[i] is None:
                    try:
                        payloads[i] = running[i].send(total)
                    except StopIteration as done:
                        results[i] = done.value
        return results

    def firsts_with_residual(self, xp, gs, residuals, beta: float, gamma: float, infos: Sequence[TensorInfo], states,
                             p_outs, nonfinite=None):
        """Optional fast path for residual memory and a multi-round method: for each gradient of a
        bucket, p = gamma * g + beta * residual written into ``p_outs[i]`` in the pass that makes
        its first payload (a native kernel; ``nonfinite``, a one-element float32 tensor, set to
        1 where a g holds an inf or a NaN). The first payloads (None for the gradients it does
        not take: the caller compensates those), for ``rounds_many``, whose last pass then
        writes the new residual p - p_hat over p; or None."""
        return None

    def decompress(self, xp, payload: Payload, ctx) -> Any:
        raise NotImplementedError

    def aggregate(self, xp, payloads: Sequence[Payload], ctx) -> Any:
        """Combine all ranks' payloads into the averaged gradient (default: mean)."""
        return self.from_sum(xp, self.decompressed_sum(xp, payloads, ctx), len(payloads), len(payloads) > 1)

    def finish(self, n: int) -> Tuple[bool, Tuple[float, ...]]:
        """How the aggregate follows from the sum of the n ranks' decompressions, element by
        element: (take its sign, the divisors it is then divided by in turn). Default: the mean.
        ``from_sum`` applies it with tensor ops; the decoded-sum kernels as they store."""
        return False, (n,)

    def from_sum(self, xp, total, n: int, fresh: bool):
        """The aggregate from the sum of the n ranks' decompressions (``finish``), written over
        ``total`` where it is ``fresh`` (a new tensor of the caller's)."""
        vote, divisors = self.finish(n)
        if vote:
            total, fresh = (xp.sign_into(total, total) if fresh else xp.sign(total)), True
        for d in divisors:
            total, fresh = divided(xp, total, d, fresh), True
        return total

    def residual_into(self, xp, p, payload: Payload, ctx, out):
        """p - decompress(payload) written into ``out`` (which may be ``p``) without a dense
        decompression (one native pass, or a write at the sent elements), where the method
        has a way; None otherwise."""
        return None

    def aggregate_many(self, xp, payloads: Sequence[Sequence[Payload]], ctxs, outs) -> Any:
        """``aggregate`` of every gradient of a bucket (``payloads[i]``: the ranks' payloads of
        gradient i), written into ``outs`` in one native call where the method has one: the
        list of ``outs``, else None (the exchange then aggregates gradient by gradient)."""
        # each sum finished (the mean, ...) as the kernel stores it
        return native_or_none(xp, self.sum_kernel and f"{self.sum_kernel}_into", outs[0], payloads, outs,
                              *self.segment_arguments(), finish=self.finish(len(payloads[0])))

    def compress_many_into(self, xp, gs, infos: Sequence[TensorInfo], buffer) -> Any:
        """Allreduce methods with no memory: every gradient of a bucket compressed in one native
        call into one flat buffer that the exchange keeps from step to step (``buffer(dtype,
        numel)``), which then travels as it is: the list of (payload, ctx), each payload a view
        of the buffer, or None (the exchange then compresses gradient by gradient)."""
        return None

    def averaged_many(self, xp, summed: Sequence[Payload], ctxs, n: int, outs) -> Any:
        """Allreduce methods: ``decompress`` of every gradient's summed payload divided by n, to
        the bit, written into ``outs`` in one native call where the method has one: the list
        of ``outs``, else None (the exchange then decompresses gradient by gradient)."""
        return None

    def decompressed_sum(self, xp, payloads: Sequence[Payload], ctx) -> Any:
        """The sum of the payloads' decompressions, payload after payload (a new tensor where
        there are several)."""
        fused = xp.fused(self.sum_kernel, payloads[0][0], ctx.dtype) if self.sum_kernel else None
        if fused:
            rows = [xp.concat([xp.flatten(p[i]) for p in payloads]) for i in range(len(payloads[0]))]
            return xp.reshape(fused(*rows, ctx.numel, *self.segment_arguments()), ctx.shape)
        total = self.decompress(xp, payloads[0], ctx)
        for i, payload in enumerate(payloads[1:]):
            x = self.decompress(xp, payload, ctx)
            # the first sum is a new tensor: the later ones are added into it
            total = xp.add_into(total, x, total) if i and xp.mutable_tensors else total + x
        return total

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def native_or_none(xp, name: str, like, *args, **kwargs):
    """grace.native's function ``name`` (``xp.fused``: built, for like's device and dtype) called
    with ``args``: its result, or None where it is not there or cannot take these tensors
    (another dtype or device, an output it cannot write in place), for the caller's tensor-op
    path."""
    fused = xp.fused(name, like, xp.dtype(like)) if name else None
    if not fused:
        return None
    try:
        return fused(*args, **kwargs)
    except NativeUnavailable:
        return None


def drawn_natively(xp, name: str, x, seed, *args):
    """grace.native's kernel ``name`` that makes the counter-based draws of ``seed`` itself,
    called on ``x`` (and ``args``): no tensor of draws written and read back (CPU). None where
    it does not run here, or where the step is not a known int (a traced TensorFlow step)."""
    if not isinstance(seed[1], numbers.Integral):
        return None
    return native_or_none(xp, name, x, x, draws.seed_words(seed), *args)


def written(xp, x, out):
    """``x``, written over ``out`` where given (a tensor of a mutable backend)."""
    if out is None or x is out:
        return x
    xp.assign(out, x)
    return out


def divided(xp, x, d, in_place: bool):
    """x / d, written over ``x`` where ``in_place`` (x is a new tensor of the caller's) and the
    backend's tensors are mutable."""
    return xp.divide_into(x, d, x) if in_place and xp.mutable_tensors else x / d


def uniform_draws(xp, counts: Sequence[int], infos: Sequence[TensorInfo], seed: int, like):
    """Each segment's uniform draws, ``counts[s]`` from its own rank seed, as its per-tensor
    compress draws them, in a row; and where each segment's draws start."""
    drawn = xp.uniform_segments(counts, [info.rank_seed(seed) for info in infos], like=like)
    return drawn, tuple(itertools.accumulate(counts, initial=0))[:-1]


def sent_count(ratio: float, d: int) -> int:
    """k = max(1, ceil(ratio * d)), at most d: how many of a tensor's d elements a ratio keeps."""
    return min(d, max(1, math.ceil(ratio * d)))


def check_ratio(ratio: float, name: str = "ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def check_number(value, name: str, minimum: float = 0.0, strict: bool = False, note: str = "") -> float:
    """A finite real number >= ``minimum`` (> where ``strict``); else a ValueError naming ``name``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}{note}, got {value!r}")
    return float(value)


#: a method's seed keeps 24 bits (``TensorInfo.seed``): larger seeds would repeat smaller ones' draws
SEED_LIMIT = 2**24


def check_seed(seed) -> int:
    """An integer in [0, 2**24); else a ValueError naming ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be a non-negative integer below 2**24, got {seed!r}")
    return seed


def check_float_dtype(dtype: str, method: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{method} compresses floating-point gradients ({', '.join(FLOAT_DTYPES)}); "
            f"got a tensor of dtype {dtype}"
        )


def index_bits(numel: int) -> int:
    return {"uint8": 8, "int16": 16, "int32": 32, "int64": 64}[index_dtype(numel)]
