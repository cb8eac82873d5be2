"""One rank's side of the GRACE pipeline, for any backend and any communicator.

    p            = memory.compensate(g, e)
    payload, ctx = compressor.compress(p)               (with its state: compressor.step)
    e            = memory.update(p, compressor.decompress(payload, ctx))
    allreduce:           g_hat = decompress(sum of payloads) / n
    allgather/broadcast: g_hat = aggregate([payload_1..payload_n])

Multi-round methods (PowerSGD) decompress only after their last round; their memory is then
updated with what the method says this rank's p became (PowerSGD: the approximation all
ranks share).

``start`` runs up to launching the collective and ``finish`` waits for it, so a toolkit can
overlap the exchange of one gradient with the backward pass of the next.

With ``bucket_mb > 0`` (the default) gradients travel in buckets (``grace.core.bucket``):
``start_bucket`` compresses each gradient of the bucket as its own tensor, with its own
memory (the same k, scales and draws as alone), and sends every payload in one frame with
one collective; ``finish_bucket`` decodes each rank's frame and aggregates per gradient.
With ``scope='bucket'``, and for methods that treat elements independently
(``Compressor.elementwise``) on an accelerator, the bucket is copied into one flat tensor
with one flat memory and compressed at once. Methods that can (``Compressor.segmented``)
compress an accelerator's bucket segment-wise: one flat buffer and memory, each gradient with
its per-tensor result (``grace.core.segments``). A bucket whose encoding would be larger than
the dense gradient is sent dense, and its memory records all of it as sent. Step counters
(and flat memories) are kept per bucket and saved per gradient name, so a checkpoint loads
under any bucket size.

An overflow (an inf or a NaN in a rank's gradient, as mixed precision produces) costs one
step and leaves no trace: each rank flags its own in what it sends anyway (an extra element
of the allreduce, a byte of the frame), every rank hands back non-finite gradients for the
flagged exchange (so a loss scaler skips the step), and ``end_step`` puts back every memory,
compressor state and step counter the step changed. Methods that keep nothing and pass an inf
through by themselves (``none``, ``fp16`` without memory) send no flag.
"""
from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from grace import native
from grace.backends import backend_for
from grace.core import bucket as frames
from grace.core import checkpoint, portable
from grace.core import segments
from grace.core.bucket import Bucket, Dense, Segment
from grace.core.communicator import Communicator, Handle, _lengths
from grace.core.compression import GradientCompression
from grace.core.compressor import FLOAT_DTYPES, Collective, TensorInfo, divided, written
from grace.core.phases import NO_CLOCK, PhaseClock
from grace.core.state import TABLES, StateStore


@dataclass
class WireStats:
    """Bytes this rank handed to the collectives, and what dense float32 would have been."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    last_step_bytes: int = 0
    last_step_dense_bytes: int = 0
    _step_bytes: int = field(default=0, repr=False)
    _step_dense_bytes: int = field(default=0, repr=False)

    def add(self, nbytes: int, dense_bytes: int) -> None:
        self._step_bytes += nbytes
        self._step_dense_bytes += dense_bytes

    def end_step(self) -> None:
        self.steps += 1
        self.last_step_bytes, self.last_step_dense_bytes = self._step_bytes, self._step_dense_bytes
        self.bytes_sent += self._step_bytes
        self.dense_bytes += self._step_dense_bytes
        self._step_bytes = self._step_dense_bytes = 0

    @property
    def compression_ratio(self) -> float:
        """Dense float32 bytes over bytes sent, over all steps so far."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


_EMPTY = object()  # ctx of an empty tensor, which is not exchanged
_PROCESS = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this process, in saved states


@dataclass
class Pending:
    name: str
    xp: Any
    ctx: Any
    handle: Handle
    flagged: bool = False  # the first round's payload ends with the overflow flag
    p: Any = None  # multi-round methods: the compensated gradient, for the memory update
    rounds: Any = None  # multi-round methods: the protocol, suspended between rounds
    memory_state: Any = None  # multi-round methods: the memory before this step
    out: Any = None  # where the result is written (the input gradient), or None: a new tensor


@dataclass
class BucketPending:
    bucket: Bucket
    xp: Any
    units: List[Segment]  # what the compressor sees as one tensor: each gradient, or the whole bucket
    g: Any  # the flat gradient of a whole bucket; else its first gradient
    old: List[Any]  # each unit's memory before this step
    ctxs: List[Any] = field(default_factory=list)
    wait: Any = None
    sent_dense: bool = False
    flag: Any = None  # this rank's overflow flag (guarded methods): 1 if its gradients hold an inf or NaN
    structure: List[int] = field(default_factory=list)  # tensors per unit's payload
    dtypes: List[str] = field(default_factory=list)  # of the frame's pieces
    counts: List[int] = field(default_factory=list)
    p: Any = None  # multi-round methods: the compensated units
    rounds: Any = None  # multi-round methods: the bucket's rounds, suspended (Compressor.rounds_many)
    updates: List[bool] = field(default_factory=list)  # multi-round: whose rounds write the new memory over p
    segmented: Any = None  # segment-wise buckets: (SegmentTable, SegmentedFrame)
    segment_ctx: Any = None  # segment-wise buckets: the compressor's ctx
    outs: Optional[List[Any]] = None  # where the results are written (the input gradients), or None
    framed: Any = None  # (frame buffer, flag's byte or None, pieces' end) where a bucket call wrote them there
    defer: bool = False  # the overflow count stays on the device until end_step (a flat result on an accelerator)


def _check_float(xp, name: str, g) -> None:
    if xp.dtype(g) not in FLOAT_DTYPES:
        raise TypeError(f"grace compresses floating-point gradients; {name!r} has dtype {xp.dtype(g)}")


def _view(xp, flat, unit):
    """The unit's part of a flat tensor (or of each tensor of a state tuple), in its shape."""
    if flat is None:
        return None
    if isinstance(flat, tuple):
        return tuple(_view(xp, t, unit) for t in flat)
    return xp.reshape(flat[unit.offset:unit.offset + unit.numel], unit.shape)


def _state_view(value, segment):
    return _view(backend_for(value[0] if isinstance(value, tuple) else value), value, segment)


def _copied(value):
    """A copy of a state (a tensor, a tuple of them, or None)."""
    if value is None:
        return None
    xp = backend_for(value[0] if isinstance(value, tuple) else value)
    return tuple(xp.copy(t) for t in value) if isinstance(value, tuple) else xp.copy(value)


def _state_copy(value, segment):
    return _copied(_state_view(value, segment))


def _assign(xp, dst, src) -> None:
    if isinstance(dst, tuple):
        for d, s in zip(dst, src):
            xp.assign(d, s)
    else:
        xp.assign(dst, src)


def _same_layout(xp, a, b) -> bool:
    """Whether state values ``a`` and ``b`` (tensors, or tuples of them) have the same shapes,
    dtypes and devices (asked per gradient and step: no lists built)."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) \
            and all(_same_layout(xp, x, y) for x, y in zip(a, b))
    return xp.shape(a) == xp.shape(b) and xp.dtype(a) == xp.dtype(b) and xp.device(a) == xp.device(b)


def _with_dense(g_hat, encoded: int, dense, n: int):
    """The mean over ``n`` ranks, from the mean ``g_hat`` of ``encoded`` ranks' payloads (None:
    no rank's) and the other ranks' dense values (``dense``), added rank after rank."""
    total = dense[0]
    for values in dense[1:]:
        total = total + values
    return total / n if g_hat is None else (g_hat * encoded + total) / n


def _no_overflow(overflow) -> bool:
    """Whether no rank flagged an overflow (None: not guarded; a traced count: not known yet)."""
    return overflow is None or (isinstance(overflow, int) and not overflow)


def _poisoned(xp, t, overflow):
    """NaN everywhere when any rank flagged an overflow (``overflow``: how many did, an int or
    a traced tensor; None: not guarded), so that a loss scaler sees it and skips the step."""
    if _no_overflow(overflow):
        return t
    if isinstance(overflow, int):
        return t * float("nan")
    return xp.where(overflow > 0, float("nan"), t)


#: seconds a rank waits for the others' first-step agreement before it says why it may never come
STALL_SECONDS = float(os.environ.get("GRACE_STALL_SECONDS", "20"))


@contextlib.contextmanager
def _told_if_stalled(rank: int):
    """While the block runs (a wait for every rank), a line on stderr every ``STALL_SECONDS``:
    a rank that never joins the agreement leaves the others waiting in the toolkit's collective,
    which cannot be cancelled, so the least grace can do is say what the likely causes are."""
    started = time.monotonic()
    done = threading.Event()

    def tell():
        while not done.wait(STALL_SECONDS):
            print(f"grace: rank {rank} has waited {time.monotonic() - started:.0f} s for the other ranks' first "
                  "grace exchange. A rank that never makes one leaves the others waiting here for ever: one that "
                  "runs Horovod's own optimizer or DDP's own allreduce (compression not a grace method on every "
                  "rank), one with fewer grace optimizers, one that is stuck or died. (Set GRACE_STALL_SECONDS to "
                  "change this interval.)", file=sys.stderr, flush=True)

    watcher = threading.Thread(target=tell, name="grace-stall-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _any_flag(xp, flags):
    """One overflow flag (1 where any is) from several."""
    return flags[0] if len(flags) == 1 else xp.reshape(xp.max(xp.concat(flags)), (1,))


def _concat(xp, tensors):
    flat = [xp.flatten(t) for t in tensors]
    return flat[0] if len(flat) == 1 else xp.concat(flat)


class Exchange:
    def __init__(self, compression: GradientCompression, communicator: Communicator,
                 average: bool = True, store: Optional[StateStore] = None, stats=None,
                 shared_state_from_rank_0: bool = False, in_place: bool = False):
        """``in_place``: the caller no longer needs the gradients it hands over, and the exchange
        writes each result over its input gradient where that saves work: on a CPU, where every
        new gradient-sized result held until the step ends costs fresh pages, mapped and zeroed
        by the kernel (Horovod's optimizer allreduces in place too). On an accelerator (the
        caching allocator reuses memory; a copy per gradient would be a launch) results are new.

        ``shared_state_from_rank_0``: where only the ranks' step counters differ at the
        first step (a checkpoint loaded on rank 0 alone), every rank takes rank 0's shared state
        then, instead of raising: the rule for toolkits whose resume recipe broadcasts after
        the first step (TensorFlow's ``hvd.broadcast_variables`` at the first batch)."""
        if not isinstance(compression, GradientCompression):
            raise TypeError(f"expected a grace compression such as grace.topk(0.01), got {compression!r}")
        self.compression = compression
        self.communicator = communicator
        self.average = average
        self.store = store if store is not None else StateStore()
        self.stats = stats if stats is not None else WireStats()
        self._plans: Dict[tuple, List[Bucket]] = {}
        self._buckets: Dict[str, Bucket] = {}
        self._adopted: set = set()
        self._whole_of: Dict[str, bool] = {}  # per bucket in use: one flat memory (whole or segmented)
        self._segmented: Dict[str, Any] = {}  # per bucket compressed segment-wise: (table, frame layout)
        self._buffers: Dict[str, Any] = {}  # reused per name: flat gradients, joined payloads
        self._spares: Dict[str, Any] = {}  # per unit (bucket or gradient): where its next memory is written
        self._guarded = compression.flags_overflow
        # the flag read from the payload where p = compensate(g) keeps g's infs and NaNs (an
        # elementwise memory: sums and products of each element)
        self._flag_from_payload = self._guarded and compression.compressor.nonfinite_field is not None \
            and compression.memory.elementwise
        self._journal: Dict[tuple, Any] = {}  # (table, key): its value before this step
        self._overflows: List[Any] = []  # per exchange of this step: how many ranks flagged one
        self._deferred: List[Any] = []  # ... those left on the device (``_overflow``), read by end_step
        self._tensors: set = set()  # (name, shape, dtype) of every gradient expected or planned
        self._agreed_in = None  # (rank, size) of the world the ranks last compared configurations in
        self._unchecked = None  # a state loaded before the gradients were known, checked when they are
        self.shared_state_from_rank_0 = shared_state_from_rank_0
        self.in_place = in_place
        self.phases: Optional[PhaseClock] = None  # a benchmark's clock (grace.core.phases)

    def _phase(self, name: str):
        return NO_CLOCK if self.phases is None else self.phases.phase(name)

    def _wait(self, wait):
        """``wait()``, timed as the collective."""
        with self._phase("collective"):
            return wait()

    def start(self, name: str, g) -> Pending:
        xp = backend_for(g)
        _check_float(xp, name, g)
        if self._unchecked is not None:  # (per gradient: a toolkit that plans no buckets says no names before)
            mine = {table: {name: values.pop(name)} for table, values in self._unchecked.items() if name in values}
            if not any(self._unchecked.values()):
                self._unchecked = None
            self._check_loaded(mine, {(name, xp.shape(g), xp.dtype(g))})
        if self._agreed_in != self._world():
            self._agree(xp, g)
        if xp.numel(g) == 0:  # nothing to send, nothing to remember
            return Pending(name, xp, _EMPTY, Handle(lambda: g, 0))
        with self._phase("compress"):
            pending = self._compress(name, xp, g)
        pending.out = g if self._writes_over(xp, g) else None
        return pending

    def _writes_over(self, xp, g) -> bool:
        """Whether results are written over the input gradients (see ``in_place``)."""
        return self.in_place and xp.mutable_tensors and not xp.on_accelerator(g)

    def _delivered(self, xp, g_hat, overflow, out):
        """A gradient's result: NaN where a rank flagged an overflow, times n for a sum, written
        over ``out`` where given."""
        g_hat = _poisoned(xp, g_hat, overflow)
        if self.average:
            return written(xp, g_hat, out)
        n = self.communicator.size
        return g_hat * n if out is None else xp.multiply_into(g_hat, n, out)

    def _averaged(self, xp, summed, fresh: bool, out):
        """A decompressed sum over n: into ``out`` where given, else in place where it is new."""
        n = self.communicator.size
        return divided(xp, summed, n, fresh) if out is None else xp.divide_into(summed, n, out)

    def _compress(self, name: str, xp, g) -> Pending:
        compressor, memory, store = self.compression.compressor, self.compression.memory, self.store
        step = self._next_step(name, g)
        info = TensorInfo(name=name, step=step, world_size=self.communicator.size,
                          rank=self.communicator.rank)
        flag = xp.nonfinite([g]) if self._guarded and not self._flag_from_payload else None
        self.stats.add(0, 4 * xp.numel(g))

        memory_state = store.get("memory", name, lambda t: memory.init(xp, t), g)
        first = TensorInfo(name=name, step=0, world_size=info.world_size, rank=info.rank)  # init needs no tensor
        state = store.get("state", name, lambda t: compressor.init_state(xp, t, first), g)
        if not compressor.multi_round:  # one pass over memory where a kernel fuses the three steps
            fused = memory.fused_step(xp, compressor, g, memory_state, info)
            if fused is not None:
                payload, ctx, memory_state = fused
                self._set("memory", name, memory_state)
                flag = self._payload_flag(xp, [payload]) if self._flag_from_payload else flag
                return Pending(name, xp, ctx, self._send(name, xp, payload, 0, flag), flag is not None)
        p = memory.compensate(xp, g, memory_state)
        if compressor.multi_round:
            rounds = compressor.rounds(xp, p, info, state)
            return Pending(name, xp, None, self._send(name, xp, next(rounds), 0, flag), flag is not None,
                           p, rounds, memory_state)

        payload, ctx, state = compressor.step(xp, p, info, state)
        self._set("state", name, state)
        flag = self._payload_flag(xp, [payload]) if self._flag_from_payload else flag
        if memory.needs_feedback:
            with self._phase("feedback"):
                p_hat = compressor.decompress(xp, payload, ctx)
                self._set("memory", name, memory.update(xp, p, p_hat, memory_state))
        return Pending(name, xp, ctx, self._send(name, xp, payload, 0, flag), flag is not None)

    def finish(self, pending: Pending):
        xp, compressor = pending.xp, self.compression.compressor
        if pending.ctx is _EMPTY:
            return pending.handle.wait()
        with self._phase("decompress"):
            if pending.rounds is not None:
                g_hat, overflow = self._finish_rounds(pending)
            elif self.compression.collective is Collective.ALLREDUCE:
                summed, overflow = self._unflagged(pending, self._wait(pending.handle.wait))
                g_hat = self._averaged(xp, compressor.decompress(xp, summed, pending.ctx), False, pending.out)
            else:
                gathered, overflow = self._unflagged(pending, self._wait(pending.handle.wait))
                g_hat = compressor.aggregate(xp, gathered, pending.ctx)
            return self._delivered(xp, g_hat, overflow, pending.out)

    def _unflagged(self, pending: Pending, received):
        """The received payloads without their overflow flags; how many ranks flagged one."""
        if not pending.flagged:
            return received, None
        if isinstance(received, tuple):  # allreduce: one summed payload
            return received[:-1], self._overflow(pending.xp, [received[-1]])
        return [r[:-1] for r in received], self._overflow(pending.xp, [r[-1] for r in received])

    def _finish_rounds(self, pending: Pending):
        name, xp, memory = pending.name, pending.xp, self.compression.memory
        summed, overflow = self._unflagged(pending, self._wait(pending.handle.wait))
        g_hat, p_hat, state = self._later_rounds(
            pending.rounds, summed, lambda payload, r: self._wait(self._send(name, xp, payload, r).wait))
        self._set("state", name, state)
        if memory.needs_feedback:
            with self._phase("feedback"):
                self._set("memory", name, memory.update(xp, pending.p, p_hat, pending.memory_state))
        return g_hat, overflow

    def _send(self, name: str, xp, payload, round_: int, flag=None) -> Handle:
        """Launch ``payload``'s collective, with this rank's overflow ``flag`` as one more
        tensor where given (in the payload's dtype where it is summed)."""
        if flag is not None:
            summed = self.compression.collective is Collective.ALLREDUCE
            payload = (*payload, xp.cast(flag, xp.dtype(payload[0]) if summed else "uint8"))
        suffix = f".round{round_}" if round_ else ""
        with self._phase("collective"):
            handle = self.communicator.exchange(self.compression.collective, xp, payload, f"grace.{name}{suffix}",
                                                equal_lengths=not self.compression.compressor.variable_length)
        self.stats.add(handle.nbytes, 0)
        return handle

    def exchange(self, grads: Dict[str, Any]) -> Dict[str, Any]:
        """Exchange a whole step's gradients, in buckets planned in the dict's order unless
        ``bucket_mb`` is 0 (all launched before any is awaited)."""
        if not self.compression.bucket_mb:
            pending = {name: self.start(name, g) for name, g in grads.items()}
            out = {name: self.finish(p) for name, p in pending.items()}
        else:
            out = {}
            specs = []
            for name, g in grads.items():
                xp = backend_for(g)
                shape = xp.shape(g)
                specs.append((name, shape, xp.dtype(g), xp.device(g)))
                if 0 in shape:
                    out[name] = g
            started = [self.start_bucket(b, [grads[s] for s in b.names]) for b in self.plan(specs)]
            for pending in started:
                out.update(zip(pending.bucket.names, self.finish_bucket(pending)))
            out = {name: out[name] for name in grads}
        self.end_step()
        return out

    def end_step(self) -> None:
        """Close a step (every exchange of it finished). Where any rank flagged an overflow,
        put back every memory, compressor state and step counter as they were before it."""
        if self._deferred:  # one read back for the step's buckets left on the device
            deferred, self._deferred = self._deferred, []
            self._overflow(backend_for(deferred[0]), deferred)
        overflow = sum(self._overflows)  # an int; a tensor inside a trace
        if self._journal and not (isinstance(overflow, int) and not overflow):
            for (table, key), old in self._journal.items():
                if isinstance(overflow, int):
                    if self._spares.get(key) is old:  # the old memory is no longer free to write over
                        self._spares[key] = self.store.value(table, key)
                    self.store.set(table, key, old)
                elif old is not None:  # traced: chosen when the step runs
                    current = self.store.value(table, key)
                    choose = lambda o, c: backend_for(c).where(overflow > 0, o, c)  # noqa: E731
                    self.store.set(table, key, tuple(map(choose, old, current)) if isinstance(old, tuple)
                                   else choose(old, current))
        self._journal.clear()
        self._overflows.clear()
        self.stats.end_step()

    def _next_step(self, key: str, like):
        """This exchange's step for ``key`` (it seeds random draws), counted on. Methods that keep
        no state and read no step (``none``, ``fp16`` without memory) count nothing, so that an
        overflow leaves nothing of theirs changed either."""
        if not self._guarded:
            return 0
        step = self.store.get("steps", key, lambda _: 0, like)
        self._set("steps", key, step + 1)
        return step

    def _set(self, table: str, key: str, value) -> None:
        """Store a value this step changes, keeping its old value until the step ends."""
        if self._guarded and (table, key) not in self._journal:
            self._journal[table, key] = self.store.value(table, key)
        self.store.set(table, key, value)

    def _payload_flag(self, xp, payloads):
        """This rank's overflow flag read from its payloads (``Compressor.nonfinite_field``)."""
        field = self.compression.compressor.nonfinite_field
        return xp.nonfinite([payload[field] for payload in payloads])

    def _overflow(self, xp, flags, defer: bool = False) -> Any:
        """How many ranks flagged an overflow (summed flags, or each rank's), noted for
        ``end_step``: read back here, or where ``defer`` (a bucket's flat result on an
        accelerator, poisoned on the device) left there, a tensor, until ``end_step`` reads the
        whole step's at once."""
        flags = [xp.cast(xp.flatten(f), "int64") for f in flags]
        total = xp.sum(flags[0] if len(flags) == 1 else xp.concat(flags))
        if defer:
            self._deferred.append(total)
            return total
        count = xp.host_ints(xp.reshape(total, (1,)), 1)[0]
        self._overflows.append(count)
        return count

    # --- buckets -------------------------------------------------------------------------
    def plan(self, tensors: Sequence[tuple]) -> List[Bucket]:
        """The buckets for ``(name, shape, dtype, group)`` tuples in backward order (see
        ``grace.core.bucket.plan``), remembered so that their state is saved per name."""
        key = tuple(tensors)
        if key not in self._plans:
            self.expect(tensors)
            self._plans[key] = frames.plan(tensors, self.compression.bucket_mb * 2**20)
        self._buckets.update((b.key, b) for b in self._plans[key])  # (again, where another plan released them)
        return self._plans[key]

    def expect(self, tensors: Sequence[tuple]) -> None:
        """The ``(name, shape, dtype, group)`` tuples of the gradients this exchange will see,
        for the ranks' first-step agreement (``plan`` records its own)."""
        self._tensors.update((name, tuple(shape), str(dtype)) for name, shape, dtype, *_ in tensors)
        if self._unchecked is not None:
            state, self._unchecked = self._unchecked, None
            self._check_loaded(state, self._tensors)

    def _check_loaded(self, state, tensors) -> None:
        """A ValueError naming the parameter where a loaded ``state`` cannot be this exchange's."""
        checkpoint.check_state(state, self.compression, tensors, per_name_state=self.compression.scope == "tensor")

    def _world(self):
        return self.communicator.rank, self.communicator.size

    def _agree(self, xp, like, adopt: bool = True) -> None:
        """Before the first exchange, and again after the world changed (Horovod's elastic
        training) or after ``hvd.join()``, the ranks compare fingerprints of their configuration,
        gradients and step counters, and every rank raises the same clear error where they
        differ, instead of hanging or drifting apart. It is one small allreduce of a table with a
        row per rank, under a name every rank shares (a bucket's name depends on the tensor
        set, so it cannot carry this): an allreduce, so that a rank in ``hvd.join()`` takes part
        (its row stays zeros, and it is left out of the comparison). With
        ``shared_state_from_rank_0``, differing step counters are rank 0's for every rank
        instead, and compared once more (``adopt``: whether they may still be taken)."""
        self._agreed_in = self._world()
        comm = self.communicator
        with self.store.eager():
            steps = sorted((name, int(v)) for name, v in self.steps.items())  # (no memory copied)
            parts = {
                "configuration": f"{self.compression!r}, average={self.average}",
                "gradients": repr(sorted(self._tensors)),
                "step counters": repr(steps),
            }
            width = 1 + len(parts)
            mine = np.zeros((comm.size, width), np.int64)
            mine[comm.rank] = [1, *(zlib.crc32(text.encode()) for text in parts.values())]
            with _told_if_stalled(comm.rank):
                wait = comm.allreduce_async(xp.asarray(mine.reshape(-1), like=like), "grace.agreement")
                table = np.asarray(xp.host_ints(wait(), comm.size * width)).reshape(comm.size, width)
        present = [r for r in range(comm.size) if table[r, 0]]  # (this rank among them)
        first = present[0]
        for i, (what, text) in enumerate(parts.items(), start=1):
            differ = [r for r in present if table[r, i] != table[first, i]]
            if differ and what == "step counters" and self.shared_state_from_rank_0 and adopt and first == 0:
                with self.store.eager():
                    self.adopt_shared_state(0, like)
                self._agree(xp, like, adopt=False)  # (a rank with counters rank 0 lacks still differs)
            elif differ:
                hint = {"configuration": "build the same compression (method, parameters, seed, bucket_mb, "
                                         "scope, op) on every rank",
                        "gradients": "every rank must exchange the same named gradients, of the same shapes",
                        "step counters": "after loading a checkpoint on some ranks only, load each rank's own "
                                         "checkpoint on every rank, or (PyTorch) call "
                                         "hvd.broadcast_optimizer_state(opt, root_rank=0): it carries grace's "
                                         "step counters"}[what]
                raise RuntimeError(f"grace: ranks {differ} differ from rank {first} in their {what}; {hint}. "
                                   f"Rank {comm.rank} has: {text[:500]}")

    def adopt_shared_state(self, root: int, like, name: str = "grace.shared_state") -> None:
        """Every rank takes rank ``root``'s ``shared_state()`` (step counters, PowerSGD's Q),
        keeping its own memory, sent as data only (``grace.core.portable``). Every rank of the
        communicator calls it; ``like``: a tensor of the toolkit; ``name`` names the collectives."""
        comm = self.communicator
        shared = portable.broadcast(comm, self.shared_state() if comm.rank == root else None, root, like, name)
        if comm.rank != root:
            self.load_shared_state(shared)

    def after_join(self, last: int, like, name: str = "grace.join") -> None:
        """After ``hvd.join()`` (``last``: the rank that joined last, which took every step):
        the ranks that joined early skipped steps, so every rank takes ``last``'s step counters
        (they seed the draws) and shared state, and the ranks agree again at their next step
        (a rank that joined before its first step has not agreed yet)."""
        self.adopt_shared_state(last, like, name)
        self._agreed_in = None

    def start_bucket(self, bucket: Bucket, grads: Sequence, flat=None) -> "BucketPending":
        """Compensate, compress and launch the one collective of ``bucket``; ``grads`` are its
        gradients in segment order, ``flat`` (optional) all of them in one flat tensor, in
        which case ``grads`` are views of it (DDP's bucket buffer)."""
        xp = backend_for(grads[0])
        _check_float(xp, bucket.names[0], grads[0])
        if self._agreed_in != self._world():
            self._agree(xp, grads[0])
        with self._phase("compress"):
            pending = self._compress_bucket(bucket, xp, grads, flat)
        pending.outs = list(grads) if self._writes_over(xp, grads[0]) else None
        return pending

    def _compress_bucket(self, bucket: Bucket, xp, grads: Sequence, flat) -> "BucketPending":
        compressor, memory, store = self.compression.compressor, self.compression.memory, self.store
        rank, n = self.communicator.rank, self.communicator.size
        if bucket.key not in self._whole_of:
            segmented = self._compresses_segmented(bucket, xp, grads[0])
            self._whole_of[bucket.key] = segmented or self._compresses_whole(xp, grads[0])
            if segmented:
                table = segments.SegmentTable.build(xp, bucket.numels, grads[0])
                layout = segments.SparseFrames(xp, table, bucket.dtype, self._guarded, grads[0]) \
                    if compressor.variable_length else \
                    segments.SegmentedFrame(xp, compressor.segment_fields(table.numels, bucket.dtype), self._guarded,
                                            grads[0])
                self._segmented[bucket.key] = table, layout
        whole = self._whole_of[bucket.key]
        if bucket.key in self._segmented:
            return self._compress_segments(bucket, xp, grads, flat)
        if whole:  # one flat tensor, with one flat memory
            g = flat if flat is not None else self._flat_gradient(bucket, xp, grads)
            units, g_units = [Segment(bucket.key, (bucket.numel,), 0, bucket.numel)], [g]
        else:  # each gradient as it is, with its own memory: nothing is copied
            g = grads[0]  # what new tensors are made like
            units, g_units = list(bucket.segments), list(grads)
        self._adopt(bucket, xp, g)
        step = self._next_step(bucket.key, g)
        self.stats.add(0, 4 * bucket.numel)

        infos, states, old = [], [], []
        for u, g_u in zip(units, g_units):
            infos.append(TensorInfo(name=u.name, step=step, world_size=n, rank=rank))
            states.append(store.get("state", u.name, lambda t, name=u.name: compressor.init_state(
                xp, t, TensorInfo(name=name, step=0, world_size=n, rank=rank)), g_u))
            old.append(store.get("memory", u.name, lambda t: memory.init(xp, t), g_u))
        pending = BucketPending(bucket, xp, units, g, old, defer=whole and self._defers(xp, g))
        # The overflow flag from a pass over the gradients, at once (one kernel on an accelerator,
        # one sum per gradient on a CPU), or from the payloads where they carry it; a multi-round
        # method's on a CPU in the pass that makes each first payload where one kernel does that
        # (Memory.fused_firsts), the other gradients' by one check of them; on a CPU by the
        # bucket call, where one runs, which checks each gradient as it reads it (no pass of its
        # own), or the payload field as it writes it
        flagged = self._guarded and not self._flag_from_payload
        per_gradient = flagged and compressor.multi_round and not xp.on_accelerator(g)
        in_call = self._guarded and not compressor.multi_round and len(units) > 1 and xp.mutable_tensors \
            and not xp.on_accelerator(g)
        if flagged and not per_gradient and not in_call:
            pending.flag = xp.nonfinite(g_units)

        if compressor.multi_round:
            # each result may go straight over its gradient, where it is written in the end anyway
            outs = list(g_units) if not whole and self._writes_over(xp, g) else None
            shared = xp.zeros(1, "float32", like=g) if per_gradient else None  # the fused first rounds set it
            firsts = self._fused_firsts(xp, units, g_units, old, infos, states, shared)
            pending.updates = [first is not None for first in firsts]  # their rounds write the new memory over p
            rest = [i for i, first in enumerate(firsts) if first is None]
            if per_gradient:  # (0 where no fused round ran)
                pending.flag = _any_flag(xp, [shared] + ([xp.nonfinite([g_units[i] for i in rest])] if rest else []))
            pending.p = [self._spares[u.name] if first is not None else None for u, first in zip(units, firsts)]
            for i, p in zip(rest, self._compensated(xp, [units[i].name for i in rest], [g_units[i] for i in rest],
                                                    [old[i] for i in rest])):
                pending.p[i] = p
            pending.rounds = compressor.rounds_many(xp, pending.p, infos, states, outs, firsts, pending.updates)
            pending.wait, nbytes = self._allreduce_units(xp, bucket.key, next(pending.rounds), pending.flag)
            self.stats.add(nbytes, 0)
            return pending

        if self.compression.collective is Collective.ALLREDUCE and memory.passes_gradient and not self._guarded \
                and len(units) > 1 and xp.mutable_tensors:
            # one native call into a buffer kept per bucket, sent as it is (fp16 on a CPU)
            made = []

            def buffer(dtype, numel):
                made.append(self._reused(xp, f"{bucket.key}.payload", dtype, numel, g))
                return made[-1]

            many = compressor.compress_many_into(xp, g_units, infos, buffer)
            if many is not None:
                pending.ctxs = [ctx for _, ctx in many]
                pending.wait, nbytes = self._allreduce_units(xp, bucket.key, [payload for payload, _ in many],
                                                             joined=made[0])
                self.stats.add(nbytes, 0)
                return pending

        # New memories go into spare buffers where the backend's tensors are mutable (a whole
        # bucket's always, a gradient's where its step writes there: a fused kernel or
        # update_into): no step allocates (and page-faults) gradient-sized buffers.
        spares = [self._spare_memory(u.name, xp, e) if memory.needs_feedback else None for u, e in zip(units, old)]
        # one native call for all the bucket's gradients where there is one (a CPU's top-k, DGC)
        flag = xp.zeros(1, "float32", like=g) if in_call else None
        into = self._frame_into(pending)
        steps = memory.fused_steps(xp, compressor, g_units, old, infos, spares, flag, into) \
            if len(units) > 1 and all(s is not None for s in spares) else None
        if steps is None and memory.passes_gradient and len(units) > 1:  # no memory: the payloads alone
            many = compressor.compress_many(xp, g_units, infos, flag, into)
            steps = None if many is None else [(payload, ctx, None) for payload, ctx in many]
        if steps is None:
            pending.framed = None
        if in_call and steps is not None:
            pending.flag = flag
        elif in_call and flagged:
            pending.flag = xp.nonfinite(g_units)
        payloads, new_memory = [], []
        for i, (u, g_u, info, state, e) in enumerate(zip(units, g_units, infos, states, old)):
            spare = spares[i]
            fused = steps[i] if steps is not None else memory.fused_step(xp, compressor, g_u, e, info, out=spare)
            if fused is not None:
                payload, ctx, e_new = fused
                e_new = spare if spare is not None else e_new  # the kernel wrote it there
            else:
                # p goes into the spare buffer (the new memory is then written over it) where the
                # payload cannot be a view of p; else a new tensor
                p_u = memory.compensate_into(xp, g_u, e, spare) \
                    if compressor.new_payload and spare is not None and not isinstance(spare, tuple) else None
                p_u = memory.compensate(xp, g_u, e) if p_u is None else p_u
                payload, ctx, state = compressor.step(xp, p_u, info, state)
                self._set("state", u.name, state)
                e_new = None
                if memory.needs_feedback:
                    with self._phase("feedback"):
                        if spare is not None and not isinstance(spare, tuple):
                            e_new = memory.feedback_into(xp, compressor, p_u, payload, ctx, e, spare)
                        else:
                            e_new = memory.update(xp, p_u, compressor.decompress(xp, payload, ctx), e)
            if spare is not None and e_new is not spare and not whole:  # a copy would cost a pass
                self._spares[u.name], spares[i] = spare, None
            payloads.append(payload)
            pending.ctxs.append(ctx)
            new_memory.append(e_new)
        if self._flag_from_payload and pending.flag is None:
            pending.flag = self._payload_flag(xp, payloads)

        if self.compression.collective is Collective.ALLREDUCE:
            # payloads free to be summed in place: nothing reads them (or the gradients, which
            # they may be views of) once sent, and the results are written over the gradients
            owned = memory.passes_gradient and self._writes_over(xp, g)
            pending.wait, nbytes = self._allreduce_units(xp, bucket.key, payloads, pending.flag, owned=owned,
                                                         defer=pending.defer)
        else:
            compensated = []

            def dense():  # the compensated units, computed again (the fused kernels keep no p)
                compensated.extend(memory.compensate(xp, g_u, e) for g_u, e in zip(g_units, old))
                return compensated

            nbytes = self._launch_frame(pending, payloads, dense)
            if pending.sent_dense and memory.needs_feedback:  # the memory records the whole bucket as sent
                with self._phase("feedback"):
                    new_memory = [memory.update(xp, p_u, p_u, e) for p_u, e in zip(compensated, old)]
            elif pending.sent_dense:
                new_memory = [None] * len(old)
        for i, (u, spare) in enumerate(zip(units, spares)):
            if spare is not None:
                if new_memory[i] is not spare:
                    _assign(xp, spare, new_memory[i])
                self._spares[u.name] = old[i]  # the old memory is the next step's spare
                new_memory[i] = spare
        for u, e_new in zip(units, new_memory):
            if memory.needs_feedback:
                self._set("memory", u.name, e_new)
        self.stats.add(nbytes, 0)
        return pending

    def _compress_segments(self, bucket: Bucket, xp, grads: Sequence, flat) -> "BucketPending":
        """The bucket's gradients compressed in one pass over its flat buffer, with one flat
        memory, each with its per-tensor result (``Compressor.segmented``)."""
        compressor, memory, comm = self.compression.compressor, self.compression.memory, self.communicator
        g = flat if flat is not None else self._flat_gradient(bucket, xp, grads)
        unit = Segment(bucket.key, (bucket.numel,), 0, bucket.numel)
        self._adopt(bucket, xp, g)
        step = self._next_step(bucket.key, g)
        self.stats.add(0, 4 * bucket.numel)
        e = self.store.get("memory", bucket.key, lambda t: memory.init(xp, t), g)
        pending = BucketPending(bucket, xp, [unit], g, [e], segmented=self._segmented[bucket.key],
                                defer=self._defers(xp, g))
        if self._guarded:
            pending.flag = xp.nonfinite([g])
        table, layout = pending.segmented
        infos = [TensorInfo(name=name, step=step, world_size=comm.size, rank=comm.rank) for name in bucket.names]
        fused = memory.fused_segments(xp, compressor, g, e, table, infos)
        e_new = None  # the new memory where a fused kernel made it and it stands
        if fused is not None:  # compensate, compress and the new memory in one go
            fields, pending.segment_ctx, e_new = fused
            p = p_hat = None
        else:
            p = memory.compensate(xp, g, e)
            fields, pending.segment_ctx, p_hat = compressor.compress_segments(xp, p, table, infos)
        variable = compressor.variable_length
        if compressor.collective is Collective.ALLREDUCE:  # (fixed sizes: never more than dense)
            pending.wait, nbytes = self._allreduce_units(xp, bucket.key, [tuple(fields)], pending.flag,
                                                         defer=pending.defer)
        else:
            nbytes = None
            # (fixed sizes: every rank decides alike; variable ones: each rank for its own frame)
            dense = layout.size(pending.segment_ctx[0]) > layout.dense_size() if variable else \
                layout.size > frames.frame_size([bucket.numel], [bucket.dtype], False, self._guarded)
            if dense:
                p = memory.compensate(xp, g, e) if p is None else p
                pending.sent_dense, p_hat, e_new = True, p, None
                frame = frames.dense_frame(xp, p, len(layout.dtypes), g, pending.flag) if variable else \
                    frames.frame(xp, [p], False, g, pending.flag)
            else:
                frame = layout.write(xp, *fields, pending.segment_ctx, pending.flag) if variable else \
                    layout.write(xp, fields, pending.flag)
        if memory.needs_feedback:
            with self._phase("feedback"):
                if e_new is None:  # from p and p_hat
                    if p_hat is None:
                        p_hat = compressor.decompress_segments(xp, fields, pending.segment_ctx, table)
                    e_new = memory.update(xp, p, p_hat, e)
                self._set("memory", bucket.key, e_new)
        if compressor.collective is not Collective.ALLREDUCE:
            nbytes = self._send_frame(pending, frame, variable)
        self.stats.add(nbytes, 0)
        return pending

    def _aggregate_segments(self, pending: "BucketPending"):
        """The flat mean of a segment-wise bucket's exchange, and the overflow count (or None)."""
        xp, bucket, n = pending.xp, pending.bucket, self.communicator.size
        compressor, (table, layout), flagged = self.compression.compressor, pending.segmented, pending.flag is not None
        if compressor.collective is Collective.ALLREDUCE:
            (summed,), overflow, fresh = pending.wait()  # (its waits are timed inside)
            return divided(xp, compressor.decompress_segments(xp, summed, pending.segment_ctx, table), n, fresh), \
                overflow
        received = self._wait(pending.wait)
        if compressor.variable_length:
            read, flags = layout.read(xp, received, n)
            return self._sparse_mean(xp, read, bucket.numel), \
                self._overflow(xp, [flags], pending.defer) if flagged else None
        if isinstance(received, list):  # broadcasts: one frame per rank
            received = xp.concat(received)
        if pending.sent_dense:
            nbytes = bucket.numel * frames.ITEMSIZE[bucket.dtype]  # then the flag byte, then padding
            rows = xp.reshape(received, (n, frames.frame_size([bucket.numel], [bucket.dtype], False, flagged)))
            g_hat = _with_dense(None, 0, [xp.from_bytes(rows[r, :nbytes], bucket.dtype) for r in range(n)], n)
            flags = rows[:, nbytes] if flagged else None
        else:
            fields, flags = layout.read(xp, received, n)
            g_hat = compressor.aggregate_segments(xp, fields, pending.segment_ctx, table, n)
        return g_hat, self._overflow(xp, [flags], pending.defer) if flagged else None

    def _sparse_mean(self, xp, read, numel: int):
        """The flat mean of the ranks' (value, index) pairs and dense buckets (``read``), with
        the per-tensor exchange's additions: the pairs' values over their count of ranks, rank
        after rank (``Sparsifier.aggregate``); then weighed, and the dense buckets added."""
        n = self.communicator.size
        pairs = [r for r in read if not isinstance(r, Dense)]
        dense = [r.values for r in read if isinstance(r, Dense)]
        g_hat = xp.scatter_add_rows([i for _, i in pairs], [v / len(pairs) for v, _ in pairs], numel) \
            if pairs else None
        return _with_dense(g_hat, len(pairs), dense, n) if dense else g_hat

    def finish_bucket(self, pending: "BucketPending", into=None) -> List[Any]:
        """Wait for the bucket's collective; the averaged (or summed) gradients, in segment order.
        ``into``: a flat tensor of the bucket's size (DDP's bucket buffer) where a bucket
        exchanged as one flat tensor has its result written, in one copy; the results are then
        views of it."""
        xp, compressor = pending.xp, self.compression.compressor
        whole = len(pending.units) == 1 and pending.units[0].name == pending.bucket.key
        outs = pending.outs or [None] * len(pending.bucket.segments)
        # Per-gradient units write each result where it goes at once: a transient is freed
        # before the next is made, so its memory serves again instead of fresh pages.
        unit_outs = [None] if whole else outs
        with self._phase("decompress"):
            if pending.segmented is not None:
                flat, overflow = self._aggregate_segments(pending)
                g_hat = [flat]
            elif pending.rounds is not None:
                return self._finish_bucket_rounds(pending, outs)
            elif self.compression.collective is Collective.ALLREDUCE:
                summed, overflow, fresh = pending.wait()  # (its allreduce waits are timed inside)
                g_hat = compressor.averaged_many(xp, summed, pending.ctxs, self.communicator.size, unit_outs) \
                    if all(o is not None for o in unit_outs) else None
                # A new sum is the exchange's own: averaged in place, no gradient-sized allocation
                g_hat = g_hat or [self._averaged(xp, compressor.decompress(xp, payload, ctx), fresh, out)
                                  for payload, ctx, out in zip(summed, pending.ctxs, unit_outs)]
            else:
                g_hat, overflow = self._aggregate_frames(pending, unit_outs)
            if whole:  # (poisoned at once: one operation, and no read back where the count is on the device)
                flat, overflow = _poisoned(xp, xp.flatten(g_hat[0]), overflow), None
                if into is not None:  # delivered there, all at once
                    return xp.unflatten(self._delivered(xp, flat, overflow, into), pending.bucket.numels,
                                        pending.bucket.shapes)
                g_hat = xp.unflatten(flat, pending.bucket.numels, pending.bucket.shapes)
            if pending.outs is None and self.average and _no_overflow(overflow):
                return g_hat  # delivered as they are (an accelerator's new results)
            return [self._delivered(xp, t, overflow, out) for t, out in zip(g_hat, outs)]

    def _flat_gradient(self, bucket: Bucket, xp, grads):
        """The bucket's gradients as one flat tensor, copied into a buffer kept per bucket
        where the backend's tensors are mutable (results never alias it)."""
        if len(grads) == 1:
            return xp.flatten(grads[0])
        buffer = self._reused(xp, f"{bucket.key}.gradient", bucket.dtype, bucket.numel, grads[0]) \
            if xp.mutable_tensors else None
        return xp.concat_flat(grads, buffer)

    def _joined(self, xp, name: str, tensors):
        """1-d ``tensors`` as one, in a buffer kept per ``name`` where the backend's tensors
        are mutable (``_reused``)."""
        if len(tensors) == 1:
            return tensors[0]
        if not xp.mutable_tensors:
            return xp.concat(tensors)
        numel, dtype = sum(xp.numel(t) for t in tensors), xp.dtype(tensors[0])
        return xp.concat_into(tensors, self._reused(xp, name, dtype, numel, tensors[0]))

    def _reused(self, xp, name: str, dtype: str, numel: int, like):
        """A flat buffer of ``numel`` elements kept per ``name`` (a mutable backend's; it is free
        again once the step's collective has been awaited): no step maps and faults in fresh
        pages for it. A buffer outgrown (a variable-length frame) is replaced by one an eighth
        larger than needed."""
        buffer = self._buffers.get(name)
        if buffer is None or xp.numel(buffer) < numel or xp.dtype(buffer) != dtype \
                or xp.device(buffer) != xp.device(like):
            grown = numel if buffer is None else numel + numel // 8
            buffer = self._buffers[name] = xp.zeros(grown, dtype, like=like)
        return buffer if xp.numel(buffer) == numel else buffer[:numel]

    def _spare_memory(self, key: str, xp, current):
        """``key``'s spare memory buffer (taken out), like ``current``, to write a new value into;
        None where the backend's tensors are immutable."""
        if not xp.mutable_tensors or current is None:
            return None
        spare = self._spares.pop(key, None)
        if spare is None or not _same_layout(xp, spare, current):
            spare = tuple(xp.zeros_like(t) for t in current) if isinstance(current, tuple) else xp.zeros_like(current)
        return spare

    def _allreduce_units(self, xp, key: str, payloads, flag=None, joined=None, owned=False, defer=False):
        """One allreduce per payload dtype (one, unless a method mixes them) of all units'
        payloads, and of this rank's overflow ``flag`` where given (as one more element of the
        first dtype); (wait for (the summed payloads per unit, how many ranks flagged an
        overflow or None, whether the sums are new tensors: not the buffers sent, summed in
        place), bytes sent). Where the communicator has a grouped allreduce of its own
        (Horovod's, joined in its fusion buffer off this thread) the payloads go as they are;
        else joined into one buffer here. ``joined``: the payloads' one flat buffer, where they
        were written there (one dtype, no flag), sent as it is. The exchange's own buffers, and
        the payloads where ``owned``, are summed in place where the communicator can: no
        output allocated (and faulted in) per step. ``defer``: the overflow count is left on the
        device (``_overflow``)."""
        shapes = [xp.shape(t) for payload in payloads for t in payload]
        pieces = [xp.flatten(t) for payload in payloads for t in payload]
        structure = [len(payload) for payload in payloads]
        if flag is not None:
            shapes.append((1,))
            pieces.append(xp.cast(flag, xp.dtype(pieces[0])))
        dtypes = [xp.dtype(t) for t in pieces]
        counts = [xp.numel(t) for t in pieces]
        waits, sent = {}, {}
        comm = self.communicator
        for dtype in dict.fromkeys(dtypes):
            group = [t for t, d in zip(pieces, dtypes) if d == dtype]
            name = key if len(waits) == 0 and len(set(dtypes)) == 1 else f"{key}.{dtype}"
            grouped = joined is None and len(group) > 1 and comm.grouped_allreduce(dtype)
            sent[dtype] = group if grouped else joined if joined is not None else self._joined(xp, name, group)
            ours = joined is not None or (not grouped and len(group) > 1 and xp.mutable_tensors)  # a buffer of ours
            in_place = (ours or owned) and comm.sums_in_place(group[0])
            with self._phase("collective"):
                if grouped:
                    launch = comm.grouped_allreduce_async_ if in_place else comm.grouped_allreduce_async
                else:
                    launch = comm.allreduce_async_ if in_place else comm.allreduce_async
                waits[dtype] = launch(sent[dtype], name)

        def wait():
            summed, fresh = {}, True
            for d, w in waits.items():
                out = self._wait(w)
                if isinstance(out, (list, tuple)):  # a grouped allreduce's sums, one by one
                    summed[d] = list(out)
                    fresh = fresh and all(o is not s for o, s in zip(out, sent[d]))
                else:
                    summed[d] = xp.split(out, [c for c, dd in zip(counts, dtypes) if dd == d])
                    fresh = fresh and out is not sent[d]
            ordered = [xp.reshape(summed[d].pop(0), shape) for d, shape in zip(dtypes, shapes)]
            overflow = self._overflow(xp, [ordered.pop()], defer) if flag is not None else None
            return frames.split_payloads(ordered, structure), overflow, fresh

        return wait, sum(xp.nbytes(t) for t in pieces)

    def _frame_into(self, pending: "BucketPending"):
        """Where a bucket call writes its payloads (``into`` of ``Memory.fused_steps``): as the
        pieces of this rank's frame, in the bucket's frame buffer, which then needs no join of
        them (``_launch_frame``); None where frames are joined (immutable tensors, allreduce
        methods, lengths known only after the call)."""
        xp, compressor = pending.xp, self.compression.compressor
        if not xp.mutable_tensors or compressor.collective is Collective.ALLREDUCE or compressor.variable_length:
            return None

        def into(dtypes, counts):
            pieces, flag_at, size = frames.layout(dtypes, counts, False, self._guarded)
            end = sum(count * frames.ITEMSIZE[dtype] for dtype, count in zip(dtypes, counts))
            pending.framed = (self._reused(xp, f"{pending.bucket.key}.frame", "uint8", size, pending.g), flag_at, end)
            return pending.framed[0], [offset for offset, _, _ in pieces]

        return into

    def _framed(self, pending: "BucketPending"):
        """The frame whose pieces the bucket call wrote in place (``_frame_into``), finished with
        the overflow flag and zeros to its end."""
        xp, flag = pending.xp, pending.flag
        frame, flag_at, end = pending.framed
        if (flag is None) != (flag_at is None):  # (a guarded exchange flags every bucket)
            raise RuntimeError(f"grace: {pending.bucket.key}'s frame was laid out for {'no ' * (flag_at is None)}"
                               "overflow flag")
        if flag is not None:
            xp.assign(frame[flag_at:flag_at + 1], xp.cast(xp.flatten(flag), "uint8"))
            end = flag_at + 1
        if end < xp.numel(frame):
            xp.assign(frame[end:], xp.zeros(xp.numel(frame) - end, "uint8", like=frame))
        return frame

    def _launch_frame(self, pending: "BucketPending", payloads, compensated) -> int:
        """Frame this rank's payloads, or the dense bucket (``compensated()``: its units) where
        that is smaller, and launch the allgather or the broadcasts; the bytes sent."""
        xp, bucket, g = pending.xp, pending.bucket, pending.g
        variable = self.compression.compressor.variable_length
        pieces = [t for payload in payloads for t in payload]
        pending.structure = [len(payload) for payload in payloads]
        pending.dtypes = [xp.dtype(t) for t in pieces]
        pending.counts = [xp.numel(t) for t in pieces]
        flag, flagged = pending.flag, pending.flag is not None
        join = functools.partial(self._joined, xp, f"{bucket.key}.frame")
        frame = self._framed(pending) if pending.framed is not None else \
            frames.frame(xp, pieces, variable, g, flag, join, pending.dtypes, pending.counts)
        header = 8 * len(pieces) if variable else 0
        dense_size = frames.frame_size([bucket.numel], [bucket.dtype], False, flagged) + header
        # Fixed-length methods: every rank decides alike. A length known only when a traced
        # TensorFlow step runs is never replaced (the frame's layout is fixed at trace time).
        if isinstance(xp.numel(frame), int) and xp.numel(frame) > dense_size:
            pending.sent_dense = True
            p = _concat(xp, compensated())
            frame = (frames.dense_frame(xp, p, len(pieces), g, flag, join) if variable
                     else frames.frame(xp, [p], False, g, flag, join))
        return self._send_frame(pending, frame, variable)

    def _send_frame(self, pending: "BucketPending", frame, variable: bool) -> int:
        """Launch the allgather (or the broadcasts) of this rank's ``frame``; the bytes sent."""
        xp, comm, bucket, g = pending.xp, self.communicator, pending.bucket, pending.g
        nbytes = xp.numel(frame)
        with self._phase("collective"):
            if self.compression.collective is Collective.ALLGATHER:
                gather = comm.allgather_async if variable else comm.allgather_equal_async
                pending.wait = gather(frame, bucket.key)
                return nbytes
            if variable:  # receivers must know the frames' sizes before the broadcasts
                sizes = xp.host_ints(comm.allgather_equal_async(_lengths(xp, [frame]), f"{bucket.key}.sizes")(),
                                     comm.size)
                nbytes += 8
            else:
                sizes = [nbytes] * comm.size
            waits = [comm.broadcast_async(frame if root == comm.rank or not variable
                                          else xp.zeros(sizes[root], "uint8", like=g), root,
                                          f"{bucket.key}.from{root}")
                     for root in range(comm.size)]
        pending.wait = lambda: [w() for w in waits]
        return nbytes

    def _aggregate_frames(self, pending: "BucketPending", outs) -> List[Any]:
        xp, bucket, compressor, n = pending.xp, pending.bucket, self.compression.compressor, self.communicator.size
        variable, flagged = compressor.variable_length, pending.flag is not None
        received = self._wait(pending.wait)
        if pending.sent_dense and not variable:  # every rank sent its dense bucket
            dtypes, counts = [bucket.dtype], [bucket.numel]
        else:
            dtypes, counts = pending.dtypes, pending.counts
        if isinstance(received, list):  # broadcasts: one frame per rank
            read, flags = zip(*(frames.read_frame(xp, f, 0, dtypes, counts, variable, bucket.numel, bucket.dtype,
                                                  flagged)[:2] for f in received))
        else:
            read, flags, start = [], [], 0
            expected = n * frames.frame_size(counts, dtypes, False, flagged)
            if not variable and isinstance(xp.numel(received), int) and xp.numel(received) != expected:
                raise RuntimeError(f"grace: ranks sent payloads of different lengths for {bucket.key!r} "
                                   "(are they configured differently?)")
            if not (pending.sent_dense and not variable) and all(o is not None for o in outs):
                done = self._aggregate_frames_natively(pending, received, outs)
                if done is not None:
                    return done
            for _ in range(n):
                frame, flag, start = frames.read_frame(xp, received, start, dtypes, counts, variable,
                                                       bucket.numel, bucket.dtype, flagged)
                read.append(frame)
                flags.append(flag)
        if pending.sent_dense and not variable:
            read = [Dense(pieces[0]) for pieces in read]
        dense = [f.values for f in read if isinstance(f, Dense)]
        encoded = [frames.split_payloads(f, pending.structure) for f in read if not isinstance(f, Dense)]
        overflow = self._overflow(xp, list(flags), pending.defer) if flagged else None
        if encoded and not dense and all(o is not None for o in outs):  # one native call, where there is one
            done = compressor.aggregate_many(xp, [[payloads[i] for payloads in encoded] for i in range(len(outs))],
                                             pending.ctxs, outs)
            if done is not None:
                return done, overflow
        out = []
        for i, (u, ctx, into) in enumerate(zip(pending.units, pending.ctxs, outs)):
            g_hat = compressor.aggregate(xp, [payloads[i] for payloads in encoded], ctx) if encoded else None
            if dense:  # aggregate is a mean over the payloads it gets: weigh it, add the dense ones
                g_hat = _with_dense(g_hat, len(encoded), [xp.reshape(d[u.offset:u.offset + u.numel], u.shape)
                                                          for d in dense], n)
            out.append(written(xp, g_hat, into))
        return out, overflow

    def _aggregate_frames_natively(self, pending: "BucketPending", received, outs):
        """Every rank's frame, all in one tensor, handed to the method's bucket-at-once
        aggregate as native buffers at their offsets (a tensor view per piece costs more than
        the kernel on small gradients), the flags read in one gather: (the aggregates written
        into ``outs``, the overflow count or None), or None where no such aggregate runs here
        or a rank sent its dense bucket."""
        xp, dtypes, flagged = pending.xp, pending.dtypes, pending.flag is not None
        variable = self.compression.compressor.variable_length
        starts, layouts, flags, start = [], [], [], 0
        alike = None if variable else frames.layout(dtypes, pending.counts, False, flagged)  # every rank's frame
        for _ in range(self.communicator.size):
            if variable:  # this rank's counts, from its frame's header
                counts = xp.host_ints(xp.from_bytes(received[start:start + 8 * len(dtypes)], "int64"), len(dtypes))
                if counts[0] == frames.DENSE:
                    return None
            pieces, flag_at, size = frames.layout(dtypes, counts, True, flagged) if variable else alike
            starts.append(start)
            layouts.append(pieces)
            flags.append(start + flag_at if flagged else None)
            start += size
        try:
            rows = native.frame_pieces(received, starts, layouts)
        except native.NativeUnavailable:
            return None
        encoded = [frames.split_payloads(row, pending.structure) for row in rows]
        done = self.compression.compressor.aggregate_many(
            xp, [[payloads[i] for payloads in encoded] for i in range(len(outs))], pending.ctxs, outs)
        if done is None:
            return None
        overflow = self._overflow(xp, [xp.gather(received, xp.asarray(flags, like=received))]) if flagged else None
        return done, overflow

    def _finish_bucket_rounds(self, pending: "BucketPending", outs) -> List[Any]:
        """The later rounds of a multi-round method's bucket (one allreduce each); then each
        gradient's result delivered (over its ``outs`` entry, where given), after its new memory."""
        xp, memory, key = pending.xp, self.compression.memory, pending.bucket.key
        (summed, overflow, _), delivered = pending.wait(), [None] * len(pending.units)

        def allreduce(payloads, r):
            wait, nbytes = self._allreduce_units(xp, f"{key}.round{r}", payloads)
            self.stats.add(nbytes, 0)
            return wait()[0]

        results = self._later_rounds(pending.rounds, summed, allreduce)
        new_memory = [None] * len(results)
        if memory.needs_feedback:
            with self._phase("feedback"):
                # where p is the spare buffer the new memory goes there too (written there by the
                # rounds' last pass already, where they say so), all at once; else a new one
                in_spare = [p_u is self._spares.get(u.name) for u, p_u in zip(pending.units, pending.p)]
                over = [i for i, spare in enumerate(in_spare) if spare and not pending.updates[i]]
                updated = dict(zip(over, memory.update_many_into(
                    xp, [pending.p[i] for i in over], [results[i][1] for i in over],
                    [pending.old[i] for i in over], [pending.p[i] for i in over])))
                for i, (u, p_u, e) in enumerate(zip(pending.units, pending.p, pending.old)):
                    if in_spare[i]:
                        new_memory[i] = updated.get(i, p_u)
                        self._spares[u.name] = e  # and the old memory is the next step's spare
                    else:
                        new_memory[i] = memory.update(xp, p_u, results[i][1], e)
        for i, (u, (g_u, _, state)) in enumerate(zip(pending.units, results)):
            self._set("state", u.name, state)
            if memory.needs_feedback:
                self._set("memory", u.name, new_memory[i])
            delivered[i] = self._delivered(xp, g_u, overflow, outs[i])
        return delivered

    def _later_rounds(self, rounds, summed, collective):
        """A multi-round method's suspended ``rounds`` driven to their end from the first
        round's ``summed``: each next payload launched by ``collective(payload, round)``, which
        returns its sum. The rounds' result."""
        r = 0
        while True:
            with self._phase("compress") as mark:
                try:
                    payload = rounds.send(summed)
                except StopIteration as done:
                    if mark:
                        mark[0] = "decompress"  # the last round's work: the decompression
                    return done.value
            r += 1
            summed = collective(payload, r)

    def _fused_firsts(self, xp, units, gs, old, infos, states, nonfinite):
        """A multi-round method's compensations and first payloads, each gradient's in one pass,
        the compensation written into its spare buffer (``Memory.fused_firsts``, which sets
        ``nonfinite`` where a g holds an inf or a NaN): per gradient, its first payload or None
        (not made: compensated as usual)."""
        memory, none = self.compression.memory, [None] * len(units)
        if not memory.needs_feedback or not xp.mutable_tensors or any(isinstance(e, tuple) for e in old):
            return none
        spares = [self._spare_memory(u.name, xp, e) for u, e in zip(units, old)]
        firsts = memory.fused_firsts(xp, self.compression.compressor, gs, old, infos, states, spares, nonfinite)
        for u, spare in zip(units, spares):
            if spare is not None:  # (kept either way; _finish_bucket_rounds tells by it where p is)
                self._spares[u.name] = spare
        return firsts or none

    def _compensated(self, xp, keys, gs, es):
        """``memory.compensate`` of a multi-round method's gradients, each written into its
        key's spare buffer where the backend's tensors are mutable (a gradient-sized allocation
        each step costs more than the arithmetic on a CPU: fresh pages, faulted in and zeroed
        by the kernel), all at once where the memory can (``Memory.compensate_many_into``)."""
        memory = self.compression.memory
        spares = [self._spare_memory(key, xp, e) if memory.needs_feedback and not isinstance(e, tuple) else None
                  for key, e in zip(keys, es)]
        ps = [None] * len(gs)
        into = [i for i, spare in enumerate(spares) if spare is not None]
        for i in into:
            self._spares[keys[i]] = spares[i]  # (kept: _finish_bucket_rounds tells by it where p was written)
        if into:
            made = memory.compensate_many_into(xp, [gs[i] for i in into], [es[i] for i in into],
                                               [spares[i] for i in into])
            for i, p in zip(into, made):
                ps[i] = p
        return [memory.compensate(xp, g, e) if p is None else p for p, g, e in zip(ps, gs, es)]

    def _compresses_whole(self, xp, like) -> bool:
        """Whether a bucket is compressed as one flat tensor: always with scope='bucket'; for
        elementwise methods (the same result either way) on an accelerator, where one kernel
        per bucket beats one per gradient. On a CPU each gradient goes in turn: cache-sized
        passes, and no bucket-sized temporaries to map and fault in every step."""
        if self.compression.scope == "bucket":
            return True
        return self.compression.compressor.elementwise and xp.on_accelerator(like)

    def _compresses_segmented(self, bucket: Bucket, xp, like) -> bool:
        """Whether a bucket is compressed segment-wise (one pass for all its gradients, each
        with its per-tensor result): for methods that can (``Compressor.segmented``; variable
        lengths only where tensors are mutable: their counts are read back), on their own kind
        of collective, with a memory that treats elements alone (none, residual, DGC's without
        clipping), float32, on an accelerator, where launches per gradient cost more than the
        arithmetic. On a CPU the per-gradient kernels are faster."""
        compression, compressor = self.compression, self.compression.compressor
        allreduce = compressor.collective is Collective.ALLREDUCE
        return (compressor.segmented and compression.scope != "bucket"
                and (compression.collective is Collective.ALLREDUCE) == allreduce
                and compression.memory.elementwise and bucket.dtype == "float32"
                and getattr(xp, "segmented", False) and xp.on_accelerator(like)
                and (xp.mutable_tensors or not compressor.variable_length))  # (counts read back: eager)

    @staticmethod
    def _defers(xp, like) -> bool:
        """Whether a bucket's flat result leaves its overflow count on the device: eager tensors
        on an accelerator, where a read back per bucket would stall the host on the device (one
        read a step instead, in ``end_step``)."""
        return xp.mutable_tensors and xp.on_accelerator(like)

    def _adopt(self, bucket: Bucket, xp, like) -> None:
        """The first time a bucket is used: take over its gradients' per-name state (from a
        checkpoint, or saved under another bucket size)."""
        if bucket.key in self._adopted:
            return
        self._adopted.add(bucket.key)
        self._buckets[bucket.key] = bucket
        with self.store.eager():  # a TensorFlow trace: read and create the variables once, now
            self._release(bucket)
            for table, value in self._gather(bucket, self.store.tables, xp, like, self._whole_of[bucket.key]).items():
                self.store.set(table, bucket.key, value)

    def _release(self, bucket: Bucket) -> None:
        """Buckets that held some of ``bucket``'s gradients before (DDP rebuilds its buckets after
        the first step; another plan) hand their step counters and memories back per gradient
        name, for ``bucket`` to take over. Per-bucket compressor state (``scope='bucket'``)
        belongs to the old layout and ends with it."""
        names, tables = set(bucket.names), self.store.tables
        for key, old in list(self._buckets.items()):
            if key == bucket.key or key not in self._adopted or names.isdisjoint(old.names):
                continue
            for table in ("steps", "memory"):
                value = tables[table].pop(key, None)
                if value is not None:
                    for s in old.segments:
                        tables[table][s.name] = value if table == "steps" else _state_copy(value, s)
            tables["state"].pop(key, None)
            self._adopted.discard(key)
            for per_bucket in (self._whole_of, self._segmented, self._spares, self._buckets):
                per_bucket.pop(key, None)
            for s in old.segments:
                self._spares.pop(s.name, None)
            for name in [n for n in self._buffers if n == key or n.startswith(key + ".")]:
                del self._buffers[name]

    def _gather(self, bucket: Bucket, tables: Dict[str, Dict[str, Any]], xp, like, whole: bool) -> Dict[str, Any]:
        """Pop the per-name steps (and, for a bucket compressed ``whole``, the memories) of
        ``bucket``'s gradients from ``tables``; the bucket's own values: its step (the
        largest), its flat memory (a gradient without one starts from the memory's init)."""
        out = {}
        steps = [tables["steps"].pop(name) for name in bucket.names if name in tables["steps"]]
        if steps:
            out["steps"] = max(int(s) for s in steps)
        memories = tables["memory"]
        if whole and any(name in memories for name in bucket.names):
            memory, parts = self.compression.memory, []
            for s in bucket.segments:
                value = memories.pop(s.name, None)
                if value is None:
                    value = memory.init(xp, xp.zeros(s.numel, bucket.dtype, like=like))
                parts.append(value)
            out["memory"] = (tuple(_concat(xp, list(c)) for c in zip(*parts)) if isinstance(parts[0], tuple)
                             else _concat(xp, parts))
        return out

    # --- state and checkpointing ---------------------------------------------------------
    @property
    def memory(self) -> Dict[str, Any]:
        """Error-feedback state per tensor name (views of a bucket's flat memory)."""
        return self._by_name("memory", self.store.tables["memory"], _state_view)

    @property
    def state(self) -> Dict[str, Any]:
        """Compressor state per tensor name (signum's momentum, PowerSGD's Q); with
        ``scope='bucket'``, per bucket."""
        return self.store.tables["state"]

    @property
    def steps(self) -> Dict[str, Any]:
        """Exchanges so far per tensor name (they seed the random methods); none for methods
        that keep no state (``none``, ``fp16`` without memory)."""
        return self._by_name("steps", self.store.tables["steps"], _state_view)

    def state_dict(self) -> Dict[str, Any]:
        """Per gradient name: a bucket's step counter and flat memory are saved as each of its
        gradients' own (copies: the bucket's buffers are reused), so the state loads under any
        bucket size. ``origin`` records the rank and world size the memory belongs to."""
        state = self.store.state_dict()
        state["steps"] = self._by_name("steps", state["steps"], _state_view)
        # copies: memory buffers are written again in later steps (spares)
        memory = self._by_name("memory", state["memory"], _state_view)
        state["memory"] = {name: _copied(value) for name, value in memory.items()}
        state["origin"] = self._origin()
        state["method"] = checkpoint.method_of(self.compression)
        return state

    def _origin(self) -> Dict[str, Any]:
        """Who saved a state: the rank and world size, and the process (Horovod's elastic
        training restores a process's own state after its rank or the world changed)."""
        return {"rank": self.communicator.rank, "size": self.communicator.size, "process": _PROCESS}

    def shared_state(self) -> Dict[str, Any]:
        """What every rank must hold alike: the step counters (they seed shared draws) and, for
        methods whose state all ranks share (PowerSGD's Q), that state. Memory is each rank's own."""
        state = self.state_dict()
        shared = {"steps": state["steps"]}
        if self.compression.compressor.shared_state:
            shared["state"] = state["state"]
        return shared

    def load_shared_state(self, shared: Dict[str, Any]) -> None:
        """Take another rank's ``shared_state()`` (Horovod's broadcast of the optimizer state),
        keeping this rank's own memory and per-rank state."""
        state = self.state_dict()
        state.update(shared)
        state["origin"] = self._origin()
        self.load_state_dict(state)

    def _check_origin(self, origin, state: Dict[str, Dict[str, Any]]) -> None:
        """The rule for a checkpoint saved elsewhere. Another rank's memory is that rank's
        unsent gradient: loaded on every rank it would be sent n times, so it is dropped (and
        per-rank method state with it) with a warning; this rank starts with empty memory.
        Another world size keeps everything, with a warning. A state this very process saved
        (an elastic reset, a state kept in memory) is its own, whatever its rank was."""
        if not origin or origin.get("process") == _PROCESS:
            return
        rank, size = int(origin["rank"]), int(origin["size"])
        if rank != self.communicator.rank:
            state["memory"] = {}
            if not self.compression.compressor.shared_state:
                state["state"] = {}
            warnings.warn(f"grace: this checkpoint holds rank {rank}'s error-feedback memory; rank "
                          f"{self.communicator.rank} starts with empty memory instead (save and load one checkpoint "
                          "per rank to keep it)", RuntimeWarning, stacklevel=3)
        elif size != self.communicator.size:
            warnings.warn(f"grace: this checkpoint was saved in a world of {size} ranks, this one has "
                          f"{self.communicator.size}; its memory is loaded as it is", RuntimeWarning, stacklevel=3)

    def _by_name(self, table: str, values: Dict[str, Any], part) -> Dict[str, Any]:
        """``values`` with each bucket's entry split into its gradients' (``part`` cuts one)."""
        out = {}
        for key, value in values.items():
            bucket = self._buckets.get(key)
            if bucket is None:
                out[key] = value
            else:
                out.update((s.name, value if table == "steps" else part(value, s)) for s in bucket.segments)
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Buckets already in use take their gradients' state at once (a traced step keeps
        reading the bucket's variables); the others when they are first used. A checkpoint
        saved by another rank brings its step counters and shared state, but not its memory
        (see ``_check_origin``)."""
        origin = state.get("origin")
        checkpoint.check_method(state.get("method"), self.compression)
        state = {table: dict(values) for table, values in state.items() if table in TABLES}
        for table in TABLES:
            state.setdefault(table, {})
        self._check_loaded(state, self._tensors)
        # checked again once the gradients are known
        self._unchecked = None if self._tensors else {table: dict(values) for table, values in state.items()}
        # copies: the exchange writes its memory buffers again in later steps (spares)
        state["memory"] = {name: _copied(value) for name, value in state["memory"].items()}
        self._check_origin(origin, state)
        like = next((v[0] if isinstance(v, tuple) else v for v in state["memory"].values()), None)
        xp = backend_for(like) if like is not None else None
        for key, whole in self._whole_of.items():
            for table, value in self._gather(self._buckets[key], state, xp, like, whole).items():
                state[table][key] = value
        self.store.load_state_dict(state)
        self._adopted = set(self._whole_of)
        self._journal.clear()  # a step in progress is abandoned
        self._overflows.clear()
        self._deferred.clear()
