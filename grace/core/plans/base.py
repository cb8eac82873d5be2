"""What every plan shares: the services it runs on, what it hands from ``start`` to ``finish``,
and how a result is delivered."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from grace.core.bucket import Bucket, Segment
from grace.core.compressor import Collective, Compressor, TensorInfo, UnitInfos, divided, name_key_of, written
from grace.core.journal import no_overflow, poisoned
from grace.core.memory import Memory


@dataclass
class Services:
    """An exchange's shared parts, as a plan sees them."""

    compression: Any  # GradientCompression
    communicator: Any
    store: Any  # StateStore
    journal: Any  # grace.core.journal.Journal
    buffers: Any  # grace.core.buffers.Buffers
    transport: Any  # grace.core.transport.Transport
    phase: Callable[[str], Any]  # phase(name): a context timing its block (grace.core.phases)
    feedback: Any  # the memory's fast paths (grace.core.plans.feedback)
    kernels: Any  # the method's fast paths (grace.core.plans.kernels)
    average: bool = True
    in_place: bool = False

    @functools.cached_property
    def flags_from_payload(self) -> bool:
        """Whether a guarded exchange reads its overflow flag from the payloads: where the method
        names a payload field that holds every inf and NaN of its input (``Traits.nonfinite_field``),
        and p = compensate(g) keeps g's (an elementwise memory). Decided once, not per bucket."""
        compression = self.compression
        return compression.flags_overflow and compression.compressor.traits.nonfinite_field is not None \
            and compression.memory.elementwise

    def writes_over(self, xp, g) -> bool:
        """Whether results are written over the input gradients (``Exchange``'s ``in_place``):
        on a CPU only, where a new result per gradient costs fresh pages."""
        return self.in_place and xp.mutable_tensors and not xp.on_accelerator(g)

    def info(self, name: str, step) -> TensorInfo:
        return TensorInfo(name, step, self.communicator.size, self.communicator.rank, name_key_of(name))

    def infos(self, names, name_keys, step) -> UnitInfos:
        """The infos of a bucket's units (``names``, their ``name_keys``) at ``step``."""
        return UnitInfos(names, name_keys, step, self.communicator.size, self.communicator.rank)

    @functools.cached_property
    def keeps_state(self) -> bool:
        """Whether the compressor has per-tensor state (its class has an ``init_state`` of its
        own): a stateless one's is None, which is never stored, so asking for it would call
        ``init_state`` again at every step."""
        return type(self.compression.compressor).init_state is not Compressor.init_state

    def compressor_state(self, xp, name: str, like):
        """``name``'s compressor state, from the compressor's ``init_state`` on first use."""
        if not self.keeps_state:
            return None
        compressor = self.compression.compressor
        return self.store.get("state", name, lambda t: compressor.init_state(xp, t, self.info(name, 0)), like)

    @functools.cached_property
    def keeps_memory(self) -> bool:
        """Whether the memory has state (its class has an ``init`` or an ``update`` of its own):
        ``keeps_state``'s reason, for the memory (NoMemory's None, made again per gradient and step)."""
        kind = type(self.compression.memory)
        return kind.init is not Memory.init or kind.update is not Memory.update

    def memory_state(self, xp, name: str, like):
        """``name``'s memory, from the memory's ``init`` on first use."""
        if not self.keeps_memory:
            return None
        return self.store.get("memory", name, lambda t: self.compression.memory.init(xp, t), like)

    def delivered(self, xp, g_hat, overflow, out):
        """A gradient's result: NaN where a rank flagged an overflow, times n for a sum, written
        over ``out`` where given."""
        g_hat = poisoned(xp, g_hat, overflow)
        if self.average:
            return written(xp, g_hat, out)
        n = self.communicator.size
        return g_hat * n if out is None else xp.multiply_into(g_hat, n, out)

    def delivered_many(self, xp, g_hats, overflow, outs):
        """``delivered`` of each result; where every one has an ``out`` and none is poisoned or
        scaled, those not written there yet copied in one operation (PowerSGD's vectors: 107
        copies a ResNet-50 step, each a dispatch)."""
        if not (self.average and no_overflow(overflow) and xp.mutable_tensors) or any(o is None for o in outs):
            return [self.delivered(xp, t, overflow, out) for t, out in zip(g_hats, outs)]
        copies = [(out, t) for t, out in zip(g_hats, outs) if t is not out]
        if copies:
            xp.assign_many(*zip(*copies))
        return list(outs)

    def averaged(self, xp, summed, fresh: bool, out):
        """A decompressed sum over n: into ``out`` where given, else in place where it is new."""
        n = self.communicator.size
        return divided(xp, summed, n, fresh) if out is None else xp.divide_into(summed, n, out)


@dataclass
class BucketPending:
    """A bucket between ``start`` and ``finish``."""

    bucket: Bucket
    xp: Any
    units: List[Segment]  # what the compressor sees as one tensor: each gradient, or the whole bucket
    g: Any  # the flat gradient of a whole bucket; else its first gradient
    old: List[Any]  # each unit's memory before this step
    states: List[Any] = field(default_factory=list)  # ... and its compressor state (the plans over units)
    ctxs: List[Any] = field(default_factory=list)
    wait: Any = None
    header_wait: Any = None  # variable-length frames sent with a header apart: the ranks' headers
    headers: Any = None  # ... once received (on the device)
    header_counts: Any = None  # ... read back with other buckets' (``Exchange.read_counts``), or None
    selection: Any = None  # a variable-length segment-wise bucket's (p, mask, counts) until its frame goes
    sent_dense: bool = False
    flag: Any = None  # this rank's overflow flag (guarded methods): 1 if its gradients hold an inf or NaN
    structure: List[int] = field(default_factory=list)  # tensors per unit's payload
    dtypes: List[str] = field(default_factory=list)  # of the frame's pieces
    counts: List[int] = field(default_factory=list)
    p: Any = None  # multi-round methods: the compensated units
    rounds: Any = None  # multi-round methods: the bucket's rounds, suspended (MethodKernels.rounds_many)
    updates: List[bool] = field(default_factory=list)  # multi-round: whose rounds write the new memory over p
    segment_ctx: Any = None  # segment-wise buckets: the compressor's ctx
    layout: Any = None  # ... and this step's frame layout
    info: Any = None  # the two-phase plan: the bucket's TensorInfo (its step seeds the owner's draws)
    outs: Optional[List[Any]] = None  # where the results are written (the input gradients), or None
    framed: Any = None  # (frame buffer, flag's byte or None, pieces' end, their dtypes and counts): a kernel's
    defer: bool = False  # the overflow count stays on the device until end_step (a flat result on an accelerator)
    plan: Any = None  # the plan that started it: the bucket's own, or the warm-up


class BucketPlan:
    """One way of exchanging a bucket, chosen once for its layout (``grace.core.plans.choose``)."""

    name = ""
    #: the bucket keeps one flat memory and step counter under its key (else one per gradient)
    flat_memory = False

    def __init__(self, services: Services, bucket: Bucket, why: str):
        self.services = services
        self.bucket = bucket
        self.why = why
        self._keys = None  # (the units' names, their name keys)
        self._without_init = {}  # per table: the units whose init made no value (``_looked_up``)

    def leave(self) -> None:
        """Before the bucket is planned another way (the world changed size): hand back what
        only this plan would read. Its gradients' state goes back per name afterwards."""

    def _units(self, xp, grads, flat):
        """(units, their gradients, what new tensors are made like): each gradient as it is."""
        return list(self.bucket.segments), grads, grads[0]

    def _defers(self, xp, g) -> bool:
        """Whether the overflow count is left on the device until the step ends."""
        return False

    def flag_dtype(self) -> str:
        """The overflow flag's dtype, as its collective carries it (made so: no cast launched):
        an allreduce's extra element, else a frame's byte."""
        return "float32" if self.services.compression.collective is Collective.ALLREDUCE else "uint8"

    def begin(self, xp, grads, flat):
        """A step's start, common to the plans over units: the step counted, and each unit's
        info, compressor state and memory. (pending, the units' gradients, infos, states)."""
        s = self.services
        units, g_units, g = self._units(xp, grads, flat)
        step = s.journal.next_step(self.bucket.key, g)
        s.transport.stats.add(0, 4 * self.bucket.numel)
        names, keys = self._unit_keys(units)
        infos = s.infos(names, keys, step)
        # (a method with no state or no memory: no lookup per unit and step)
        states = self._looked_up("state", s.compressor_state, xp, names, g_units) if s.keeps_state \
            else [None] * len(units)
        old = self._looked_up("memory", s.memory_state, xp, names, g_units) if s.keeps_memory \
            else [None] * len(units)
        pending = BucketPending(self.bucket, xp, units, g, old, states, defer=self._defers(xp, g))
        return pending, g_units, infos, states

    def _looked_up(self, table: str, get, xp, names, likes) -> list:
        """``get(xp, name, like)``: each unit's value in ``table``, made by its init on first use
        (after the first step, the store's values read at once, ``get`` only where one has none);
        of a unit whose init made none at the first step (PowerSGD's vectors), the store's value
        alone after (None unless a value was stored since): the plan's layout makes none again,
        and an init per unit and step costs more than a small gradient's kernel."""
        without = self._without_init.get(table)
        if without is None:
            values = [get(xp, n, like) for n, like in zip(names, likes)]
            self._without_init[table] = frozenset(i for i, value in enumerate(values) if value is None)
            return values
        values = self.services.store.values(table, names)
        for i in [i for i, value in enumerate(values) if value is None and i not in without]:
            values[i] = get(xp, names[i], likes[i])
        return values

    def _unit_keys(self, units):
        """The units' names and their keys (``TensorInfo.name_key``), made once per plan."""
        if self._keys is None:  # (a plan's units are its bucket's, every step)
            names = tuple(u.name for u in units)
            self._keys = names, tuple(map(name_key_of, names))
        return self._keys

    def start(self, xp, grads, flat) -> BucketPending:
        """Compensate, compress and launch the bucket's collective. ``grads``: its gradients in
        segment order; ``flat``: all of them in one flat tensor (then ``grads`` are its views),
        or None."""
        raise NotImplementedError

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        """Wait for the collective; the averaged (or summed) gradients, in segment order.
        ``into``: a flat tensor of the bucket's size (DDP's bucket buffer) where a flat result is
        written in one copy; the results are then views of it."""
        raise NotImplementedError

    def deliver(self, pending: BucketPending, g_hat, overflow, outs, into=None) -> List[Any]:
        """The results, each unit's ``g_hat`` poisoned where a rank flagged an overflow, times n
        for a sum, written over ``outs`` (or ``into``) where given."""
        s, xp, bucket = self.services, pending.xp, self.bucket
        if self.flat_memory:  # (poisoned at once: one operation, no read back of a count on the device)
            flat, overflow = poisoned(xp, xp.flatten(g_hat[0]), overflow), None
            if into is not None:
                return xp.unflatten(s.delivered(xp, flat, overflow, into), bucket.numels, bucket.shapes)
            g_hat = xp.unflatten(flat, bucket.numels, bucket.shapes)
        if pending.outs is None and s.average and no_overflow(overflow):
            return g_hat  # delivered as they are (an accelerator's new results)
        return s.delivered_many(xp, g_hat, overflow, outs)


class WholeBucket(BucketPlan):
    """A plan that takes the bucket as one flat tensor, with one flat memory under its key."""

    flat_memory = True

    def _units(self, xp, grads, flat):
        bucket = self.bucket
        g = flat if flat is not None else self.services.buffers.concat_gradients(bucket, xp, grads)
        return [Segment(bucket.key, (bucket.numel,), 0, bucket.numel)], [g], g


def with_dense(g_hat, encoded: int, dense, n: int):
    """The mean over ``n`` ranks, from the mean ``g_hat`` of ``encoded`` ranks' payloads (None:
    no rank's) and the other ranks' dense values (``dense``), added rank after rank."""
    total = dense[0]
    for values in dense[1:]:
        total = total + values
    return total / n if g_hat is None else (g_hat * encoded + total) / n


def defers_on_device(xp, g) -> bool:
    """Whether a flat result's overflow count stays on the device until the step ends: eager
    tensors on an accelerator, where a read back per bucket would stall the host (one read a
    step instead)."""
    return xp.mutable_tensors and xp.on_accelerator(g)
