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
  is computed) declares ``traits.multi_round`` and writes ``rounds(xp, x, info, state, out=None)``, a
  generator that yields each payload to be summed by allreduce, receives the sum, and finally
  returns ``(g_hat, p_hat, state)``: the mean over ranks, what this rank's input became (for
  the memory: e = p - p_hat), and the new state. ``out`` (a tensor like x, where the result
  will be written anyway: the gradient, for in-place adapters) may receive g_hat directly.
  A bucket's tensors go through their rounds together (``MethodKernels.rounds_many``: one
  allreduce per round for the bucket), which a method may batch.

That is the whole contract: compress, decompress, aggregate (with ``finish``), step and
init_state, rounds, ideal_bits, and the declared ``collective`` and ``traits``. What makes a
method fast on a bucket (native calls for a bucket at once, passes fused with residual memory,
segment-wise forms) is registered apart, per method (``grace.core.plans.kernels``).
"""
from __future__ import annotations

import collections.abc
import enum
import functools
import math
import numbers
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Tuple

from grace.core import draws
from grace.formats import index_dtype  # noqa: F401  (re-exported: methods import it from here)
from grace.native import NativeUnavailable

Payload = Tuple[Any, ...]


class Collective(str, enum.Enum):
    """How the payloads of all ranks are combined on the wire."""

    ALLREDUCE = "allreduce"  # payloads are summed elementwise: needs a linear decompress
    ALLGATHER = "allgather"  # every rank receives every payload, then aggregates locally
    BROADCAST = "broadcast"  # each rank broadcasts its payload in turn, then aggregates locally
    ALLTOALL = "alltoall"  # each rank owns a shard: gets every rank's payload of it, sends its aggregate

    @classmethod
    def parse(cls, value: "str | Collective") -> "Collective":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join([*(repr(c.value) for c in cls), "'auto'"])
            raise ValueError(f"communicator must be one of {names}, got {value!r}") from None


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@functools.lru_cache(maxsize=1 << 16)
def name_key_of(name: str) -> int:
    """A tensor name's CRC-32, ``TensorInfo.name_key``: made once per name (an exchange makes an
    info per gradient and step)."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True)
class TensorInfo:
    """What a compressor may know about the tensor it compresses, identical on every rank."""

    name: str
    step: Any  # int; a scalar tensor under tf.function, or a fused program's input
    world_size: int
    rank: int = 0
    name_key: int = field(default=-1, repr=False, compare=False)  # the name's CRC-32 (made at once)

    def __init__(self, name: str, step, world_size: int, rank: int = 0, name_key: int = -1):
        # the fields in one update, not one frozen setattr each (half the cost: an exchange makes
        # an info per gradient and step); name_key given where known (a traced fused program's)
        self.__dict__.update(name=name, step=step, world_size=world_size, rank=rank,
                             name_key=name_key if name_key >= 0 else name_key_of(name))

    def seed(self, base_seed: int = 0) -> Tuple[int, Any]:
        """A seed shared by all ranks for this (tensor, step), stable across processes:
        (key, step). The key is a Python int below 2**63; the step may be a tensor (a
        TensorFlow step counter inside tf.function, a fused program's input), so backends
        take the pair as it is."""
        return self.name_key | (base_seed % 2**24) << 32, self.step

    def rank_seed(self, base_seed: int = 0) -> Tuple[int, Any]:
        """A seed of this rank's own for this (tensor, step): independent draws on every rank."""
        key, step = self.seed(base_seed)
        return key | ((self.rank + 1) % 2**7) << 56, step


class UnitInfos(collections.abc.Sequence):
    """The ``TensorInfo`` of each unit of a bucket at one step, each made when asked for: a bucket
    call reads the world's size and the step of the first, and the names' keys (``name_keys``),
    where an info per gradient and step costs more than a small gradient's kernel."""

    def __init__(self, names: Tuple[str, ...], name_keys: Tuple[int, ...], step, world_size: int, rank: int):
        self.names, self.name_keys, self.step, self.world_size, self.rank = names, name_keys, step, world_size, rank

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        return TensorInfo(self.names[i], self.step, self.world_size, self.rank, self.name_keys[i])


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
    #: SGD's means and QSGD's norms (1: sums of ``|x|``, x and x^2, which also flag a sum that
    #: overflows). The overflow flag is read from those few numbers instead of from a pass
    #: over the gradient. (Not TernGrad's ``max|x|``: a GPU's max may drop a NaN.)
    nonfinite_field: Optional[int] = None
    #: the per-tensor state is the same on every rank (PowerSGD's Q), not the rank's own
    shared_state: bool = False
    #: E[decompress(compress(x))] = x: its rounding or scaling is right on average
    unbiased: bool = False
    #: compress returns new tensors, never views of its input: an exchange may compensate into
    #: a buffer that the step writes again (the new memory over p) before the payload is sent
    new_payload: bool = False
    #: compress draws random numbers from a seed of (tensor, step): the same input compresses
    #: differently at every step
    seeded: bool = False
    #: compress follows a schedule over the steps, decided on the host from the step number
    #: (DGC's sparsity warm-up: its k)
    scheduled: bool = False


class Compressor:
    """Base class. Subclasses set ``collective`` (and ``traits``) and implement compress/decompress."""

    collective: Collective = Collective.ALLGATHER
    traits: Traits = Traits()

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

    def rounds(self, xp, x, info: TensorInfo, state, out=None):
        """Multi-round methods only: a generator, see the module docstring."""
        raise NotImplementedError

    def decompress(self, xp, payload: Payload, ctx) -> Any:
        raise NotImplementedError

    def aggregate(self, xp, payloads: Sequence[Payload], ctx) -> Any:
        """Combine all ranks' payloads into the averaged gradient (default: mean)."""
        return finished(self, xp, decoded_sum(self, xp, payloads, ctx), len(payloads), len(payloads) > 1)

    def finish(self, n: int) -> Tuple[bool, Tuple[float, ...]]:
        """How the aggregate follows from the sum of the n ranks' decompressions, element by
        element: (take its sign, the divisors it is then divided by in turn). Default: the mean.
        ``finished`` applies it with tensor ops; the decoded-sum kernels as they store."""
        return False, (n,)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def decoded_sum(compressor, xp, payloads: Sequence[Payload], ctx) -> Any:
    """The sum of the payloads' decompressions, payload after payload (a new tensor where there
    are several)."""
    total = compressor.decompress(xp, payloads[0], ctx)
    for i, payload in enumerate(payloads[1:]):
        x = compressor.decompress(xp, payload, ctx)
        # the first sum is a new tensor: the later ones are added into it
        total = xp.add_into(total, x, total) if i and xp.mutable_tensors else total + x
    return total


def finished(compressor, xp, total, n: int, fresh: bool):
    """The aggregate from the sum of the n ranks' decompressions (``Compressor.finish``), written
    over ``total`` where it is ``fresh`` (a new tensor of the caller's)."""
    vote, divisors = compressor.finish(n)
    if vote:
        total, fresh = (xp.sign_into(total, total) if fresh else xp.sign(total)), True
    for d in divisors:
        total, fresh = divided(xp, total, d, fresh), True
    return total


def native_or_none(xp, name: str, like, *args, **kwargs):
    """grace.native's kernel ``name`` (``xp.native``: built, for like's device and dtype) called
    with ``args``: its result, or None where it is not there or cannot take these tensors
    (another dtype or device, an output it cannot write in place), for the caller's tensor-op
    path."""
    return called_or_none(xp.native(name, like, xp.dtype(like)) if name else None, *args, **kwargs)


def called_or_none(fused, *args, **kwargs):
    """``native_or_none`` of a kernel ``xp.native`` gave already (or None)."""
    if not fused:
        return None
    try:
        return fused(*args, **kwargs)
    except NativeUnavailable:
        return None


def compressed_natively(xp, name: str, x, seed, draws_count: Callable[[], int], *args):
    """``x`` compressed in one pass by grace.native's ``name`` (with ``args``): by "<name>_drawn",
    which makes the counter-based draws of ``seed`` itself (a CPU, a step known as an int: no
    tensor of draws), else on ``draws_count()`` draws made here. None where neither runs."""
    if isinstance(seed[1], numbers.Integral):
        drawn = native_or_none(xp, f"{name}_drawn", x, x, draws.seed_words(seed), *args)
        if drawn is not None:
            return drawn
    fused = xp.native(name, x, xp.dtype(x))
    return fused(x, xp.uniform(draws_count(), seed, like=x), *args) if fused else None


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
    compress draws them, in a row."""
    return xp.uniform_segments(counts, [info.rank_seed(seed) for info in infos], like=like)


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


def check_steps(steps, name: str = "warmup_steps") -> int:
    """An integer >= 0; else a ValueError naming ``name``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {steps!r}")
    return steps


def check_float_dtype(dtype: str, method: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{method} compresses floating-point gradients ({', '.join(FLOAT_DTYPES)}); "
            f"got a tensor of dtype {dtype}"
        )


def index_bits(numel: int) -> int:
    return {"uint8": 8, "int16": 16, "int32": 32, "int64": 64}[index_dtype(numel)]
