"""One rank's side of the GRACE pipeline, for any backend and any communicator.

``start`` runs up to launching the collective and ``finish`` waits for it, so a toolkit can
overlap the exchange of one gradient with the backward pass of the next. With ``bucket_mb=0``
each gradient goes alone, through the reference plan (``grace.core.plans.reference``: the
pipeline as GRACE writes it). Otherwise gradients travel in buckets (``grace.core.bucket``):
``start_bucket`` and ``finish_bucket`` run the plan chosen once for that bucket
(``grace.core.plans``), and ``plan_of(name)`` says which and why.

Around the plans the exchange keeps what every plan shares: the state store (memory,
compressor state, step counters; saved per gradient name, so a checkpoint loads under any
bucket size), the overflow journal (an inf or a NaN on any rank costs one step and leaves no
trace: ``grace.core.journal``), buffers kept from step to step, the transport to the
communicator, and the ranks' first-step agreement (``grace.core.agreement``).
"""
from __future__ import annotations

import numbers
import os
import socket
import uuid
from typing import Any, Dict, List, Optional, Sequence

from grace.core.tensors import backend_for
from grace.core import agreement, checkpoint, portable
from grace.core import bucket as frames
from grace.core import state as states
from grace.core.bucket import Bucket
from grace.core.buffers import Buffers, Pieces, laid_out
from grace.core.communicator import Communicator, Handle
from grace.core.compression import GradientCompression
from grace.core.compressor import FLOAT_DTYPES, Collective
from grace.core.journal import Journal
from grace.core.phases import NO_CLOCK, PhaseClock
from grace.core.plans import BucketPending, BucketPlan, Pending, PlanChoice, Reference, Services, choose, outgrown
from grace.core.plans.feedback import feedback_of
from grace.core.plans.kernels import kernels_of
from grace.core.plans.segmented import read_headers
from grace.core.plans.warmup import WarmUp
from grace.core.state import TABLES, StateStore
from grace.native.status import warn_if_missing
from grace.core.transport import Transport, WireStats

__all__ = ["BucketPending", "Exchange", "Pending", "PlanChoice", "WireStats"]

_DIRECT = object()  # ctx of a gradient whose handle gives its result (an empty one, one in warm-up)
_PROCESS = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this process, in saved states


def _check_float(xp, name: str, g) -> None:
    if xp.dtype(g) not in FLOAT_DTYPES:
        raise TypeError(f"grace compresses floating-point gradients; {name!r} has dtype {xp.dtype(g)}")


class Exchange:
    def __init__(self, compression: GradientCompression, communicator: Communicator,
                 average: bool = True, store: Optional[StateStore] = None, stats=None,
                 shared_state_from_rank_0: bool = False, in_place: bool = False):
        """``in_place``: the caller no longer needs the gradients it hands over, and the exchange
        writes each result over its input gradient where that saves work: on a CPU, where every
        new gradient-sized result held until the step ends costs fresh pages (Horovod's optimizer
        allreduces in place too). On an accelerator results are new (the caching allocator
        reuses memory; a copy per gradient would be a launch).

        ``shared_state_from_rank_0``: where only the ranks' step counters differ at the first
        step (a checkpoint loaded on rank 0 alone), every rank takes rank 0's shared state then,
        instead of raising: the rule for toolkits whose resume recipe broadcasts after the first
        step (TensorFlow's ``hvd.broadcast_variables`` at the first batch)."""
        if not isinstance(compression, GradientCompression):
            raise TypeError(f"expected a grace compression such as grace.topk(0.01), got {compression!r}")
        self.compression = compression
        self.communicator = communicator
        self.average = average
        self.store = store if store is not None else StateStore()
        self.stats = stats if stats is not None else WireStats()
        self.shared_state_from_rank_0 = shared_state_from_rank_0
        self.in_place = in_place
        self.phases: Optional[PhaseClock] = None  # a benchmark's clock (grace.core.phases)
        self.buffers = Buffers()
        self.journal = Journal(self.store, compression.flags_overflow)
        self.transport = Transport(compression, communicator, self.stats, self.buffers, self.journal, self._phase)
        self.services = Services(compression, communicator, self.store, self.journal, self.buffers, self.transport,
                                 self._phase, feedback_of(compression.memory),
                                 kernels_of(compression.compressor), average, in_place)
        self.reference = Reference(self.services)
        self._layouts: Dict[tuple, List[Bucket]] = {}  # the buckets planned per set of tensors
        self._buckets: Dict[str, Bucket] = {}  # every bucket planned or in use, by key
        self._plans: Dict[str, BucketPlan] = {}  # per bucket in use: its plan (it holds its gradients' state)
        self.expected: set = set()  # (name, shape, dtype) of every gradient expected or planned
        self._agreed_in = None  # (rank, size) of the world the ranks last compared configurations in
        self._unchecked = None  # a state loaded before the gradients were known, checked when they are

    def _phase(self, name: str):
        return NO_CLOCK if self.phases is None else self.phases.phase(name)

    # --- one gradient at a time ------------------------------------------------------------
    def start(self, name: str, g) -> Pending:
        xp = backend_for(g)
        _check_float(xp, name, g)
        if self._unchecked is not None:  # (per gradient: a toolkit that plans no buckets says no names before)
            mine = {table: {name: values.pop(name)} for table, values in self._unchecked.items() if name in values}
            if not any(self._unchecked.values()):
                self._unchecked = None
            self._check_loaded(mine, {(name, xp.shape(g), xp.dtype(g))})
        self._agree_once(xp, g)
        if xp.numel(g) == 0:  # nothing to send, nothing to remember
            return Pending(name, xp, _DIRECT, Handle(lambda: g, 0))
        out = g if self.services.writes_over(xp, g) else None
        if self._warming(name, xp, g):
            warmup = WarmUp.of_gradient(self.services, name, xp, g)
            started = warmup.start(xp, [g], None)
            started.outs = None if out is None else [out]
            return Pending(name, xp, _DIRECT, Handle(lambda: warmup.finish(started)[0], 0))
        with self._phase("compress"):
            pending = self.reference.start(name, xp, g)
        pending.out = out
        return pending

    def finish(self, pending: Pending):
        if pending.ctx is _DIRECT:
            return pending.handle.wait()
        with self._phase("decompress"):
            return self.reference.finish(pending)

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
            started = [self.start_bucket(b, [grads[s] for s in b.names]) for b in self.bucket_layout(specs)]
            self.read_counts(started)
            for pending in started:
                out.update(zip(pending.bucket.names, self.finish_bucket(pending)))
            out = {name: out[name] for name in grads}
        self.end_step()
        return out

    def end_step(self) -> None:
        """Close a step (every exchange of it finished). Where any rank flagged an overflow,
        put back every memory, compressor state and step counter as they were before it."""
        self.journal.end_step(self.buffers.spares)
        self.stats.end_step()

    # --- buckets ---------------------------------------------------------------------------
    def bucket_layout(self, tensors: Sequence[tuple]) -> List[Bucket]:
        """The buckets for ``(name, shape, dtype, group)`` tuples in backward order (see
        ``grace.core.bucket.plan``), remembered so that their state is saved per name."""
        key = tuple(tensors)
        if key not in self._layouts:
            self.expect(tensors)
            self._layouts[key] = frames.plan(tensors, self.compression.bucket_mb * 2**20)
        self._buckets.update((b.key, b) for b in self._layouts[key])  # (again, where another layout released them)
        return self._layouts[key]

    def start_bucket(self, bucket: Bucket, grads: Sequence, flat=None) -> BucketPending:
        """Compensate, compress and launch the one collective of ``bucket``; ``grads`` are its
        gradients in segment order, ``flat`` (optional) all of them in one flat tensor, in
        which case ``grads`` are views of it (DDP's bucket buffer)."""
        xp = backend_for(grads[0])
        # (what a kernel derives from them serves its compress and its aggregate into them; their
        # ctxs are the bucket's)
        grads = laid_out(Pieces(grads), bucket.ctx_shapes)
        _check_float(xp, bucket.names[0], grads[0])
        self._agree_once(xp, grads[0])
        with self._phase("compress"):
            plan = self._plans.get(bucket.key) or self._take_over(bucket, xp, grads[0])
            if self._warming(bucket.key, xp, grads[0]):
                plan = WarmUp(self.services, bucket, "warm-up")
            pending = plan.start(xp, grads, flat)
        pending.plan = plan
        pending.outs = grads if self.services.writes_over(xp, grads[0]) else None
        return pending

    def read_counts(self, pendings: Sequence[BucketPending]) -> None:
        """Read back the headers of the launched buckets ``pendings`` (variable lengths) in one
        wait for all, not one per bucket, and send the frames that waited for them."""
        with self._phase("decompress"):
            read_headers(pendings)

    def finish_bucket(self, pending: BucketPending, into=None) -> List[Any]:
        """Wait for the bucket's collective; the averaged (or summed) gradients, in segment order.
        ``into``: a flat tensor of the bucket's size (DDP's bucket buffer) where a bucket
        exchanged as one flat tensor has its result written, in one copy; the results are then
        views of it."""
        with self._phase("decompress"):
            return pending.plan.finish(pending, into)

    def _warming(self, key: str, xp, like) -> bool:
        """Whether ``key``'s exchange is one of the first ``warmup_steps`` (its step counter, read
        on the host: the choice is made before the step is launched)."""
        steps = self.compression.warmup_steps
        if not steps:
            return False
        step = self.store.get("steps", key, lambda _: 0, like)
        if isinstance(step, numbers.Integral):  # (an int; a NumPy integer from a loaded checkpoint)
            step = int(step)
        else:
            step = xp.host_ints(xp.reshape(xp.cast(step, "int64"), (1,)), 1)[0]
        if not isinstance(step, int):
            raise NotImplementedError(
                "grace: warmup_steps chooses between a plain allreduce and the method on the host, before each "
                "step; a traced tf.function bakes one choice in. Run the step eagerly (model.compile(..., "
                "run_eagerly=True)), or leave warmup_steps=0")
        return step < steps

    def plan_of(self, name: str) -> PlanChoice:
        """Which plan gradient ``name`` takes, in which bucket, and why (after its first step)."""
        for key, plan in self._plans.items():
            if name in plan.bucket.names:
                return PlanChoice(plan.name, key, plan.why)
        if not self.compression.bucket_mb:
            return PlanChoice(Reference.name, "", Reference.why)
        raise KeyError(f"grace: {name!r} has not been exchanged in a bucket yet; its plan is chosen at its first step")

    def bucket_plans(self) -> Dict[str, BucketPlan]:
        """The plan of every bucket in use, by bucket key."""
        return dict(self._plans)

    def _take_over(self, bucket: Bucket, xp, like) -> BucketPlan:
        """A bucket's first use: its plan chosen, and its gradients' per-name state taken over
        (from a checkpoint, or from buckets of another layout that held them)."""
        plan = self._plans[bucket.key] = choose(self.services, bucket, xp, like)
        self._buckets[bucket.key] = bucket
        self.stats.plans[bucket.key] = plan.name
        with self.store.eager():  # a TensorFlow trace: read and create the variables once, now
            self._release_overlapping(bucket)
            taken = states.gather(bucket, self.store.tables, self.compression.memory, xp, like, plan.flat_memory)
            for table, value in taken.items():
                self.store.set(table, bucket.key, value)
        return plan

    def _plan_again(self) -> None:
        """The world changed size: a bucket that 'auto' would now send another way hands its
        state back per gradient name and is planned again at its next step (``outgrown``)."""
        if not self.compression.auto:
            return
        for key, plan in list(self._plans.items()):
            if outgrown(self.services, plan):
                with self.store.eager():
                    plan.leave()
                    states.release(plan.bucket, self.store)
                self._end_plan(key, plan)

    def _release_overlapping(self, bucket: Bucket) -> None:
        """Buckets in use that held some of ``bucket``'s gradients (DDP rebuilds its buckets after
        the first step; another layout) hand their state back per gradient name, and end."""
        names = set(bucket.names)
        for key, plan in list(self._plans.items()):
            old = plan.bucket
            if key == bucket.key or names.isdisjoint(old.names):
                continue
            states.release(old, self.store)
            self._end_plan(key, plan)
            self._buckets.pop(key, None)

    def _end_plan(self, key: str, plan: BucketPlan) -> None:
        del self._plans[key]
        self.stats.plans.pop(key, None)
        self.buffers.forget(key, plan.bucket.names)

    # --- the ranks' agreement ----------------------------------------------------------------
    def expect(self, tensors: Sequence[tuple]) -> None:
        """The ``(name, shape, dtype, group)`` tuples of the gradients this exchange will see,
        for the ranks' first-step agreement (``bucket_layout`` records its own)."""
        self.expected.update((name, tuple(shape), str(dtype)) for name, shape, dtype, *_ in tensors)
        if self._unchecked is not None:
            state, self._unchecked = self._unchecked, None
            self._check_loaded(state, self.expected)

    def _world(self):
        return self.communicator.rank, self.communicator.size

    def _agree_once(self, xp, like) -> None:
        """The ranks' agreement (``grace.core.agreement``) before the first exchange, and again
        after the world changed (elastic training) or after ``hvd.join()``."""
        if self._agreed_in != self._world():
            if self._agreed_in is not None and self._agreed_in[1] != self.communicator.size:
                self._plan_again()
            self._agreed_in = self._world()
            agreement.agree(self, xp, like)
            warn_if_missing(like)  # (a missing native library makes every step several times slower)

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

    # --- state and checkpointing -----------------------------------------------------------
    @property
    def memory(self) -> Dict[str, Any]:
        """Error-feedback state per tensor name (views of a bucket's flat memory; a state whose
        last operation was deferred, PowerSGD's residual on a CPU, made: a new tensor)."""
        return states.by_name("memory", self.store.tables["memory"], self._buckets)

    @property
    def state(self) -> Dict[str, Any]:
        """Compressor state per tensor name (signum's momentum, PowerSGD's Q); with
        ``scope='bucket'``, per bucket."""
        return self.store.tables["state"]

    @property
    def steps(self) -> Dict[str, Any]:
        """Exchanges so far per tensor name (they seed the random methods); none for methods
        that keep no state (``none``, ``fp16`` without memory)."""
        return states.by_name("steps", self.store.tables["steps"], self._buckets)

    def state_dict(self) -> Dict[str, Any]:
        """Per gradient name: a bucket's step counter and flat memory are saved as each of its
        gradients' own (copies, as are the compressor states: the bucket's buffers are reused), so
        the state loads under any bucket size. ``origin`` records the rank and world size the
        memory belongs to."""
        state = self.store.state_dict()
        state["steps"] = states.by_name("steps", state["steps"], self._buckets)
        memory = states.by_name("memory", state["memory"], self._buckets)
        state["memory"] = {name: states.copied(value) for name, value in memory.items()}
        state["state"] = {name: states.copied(value) for name, value in state["state"].items()}  # (kept buffers too)
        owner = states.by_name("owner", state["owner"], self._buckets)
        state["owner"] = {name: states.copied(value) for name, value in owner.items()}
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
        if self.compression.compressor.traits.shared_state:
            shared["state"] = state["state"]
        return shared

    def load_shared_state(self, shared: Dict[str, Any]) -> None:
        """Take another rank's ``shared_state()`` (Horovod's broadcast of the optimizer state),
        keeping this rank's own memory and per-rank state."""
        state = self.state_dict()
        state.update(shared)
        state["origin"] = self._origin()
        self.load_state_dict(state)

    def _check_loaded(self, state, tensors) -> None:
        """A ValueError naming the parameter where a loaded ``state`` cannot be this exchange's."""
        # (compressor state is per bucket where a bucket is compressed as a whole, or cut into shards,
        # as 'auto' may do)
        compression = self.compression
        per_name = compression.scope == "tensor" and compression.collective is not Collective.ALLTOALL \
            and not compression.auto
        checkpoint.check_state(state, self.compression, tensors, per_name_state=per_name)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Buckets already in use take their gradients' state at once (a traced step keeps
        reading the bucket's variables); the others when they are first used. A checkpoint
        saved by another rank brings its step counters and shared state, but not its memory
        (``checkpoint.check_origin``)."""
        origin = state.get("origin")
        checkpoint.check_method(state.get("method"), self.compression)
        state = {table: dict(values) for table, values in state.items() if table in TABLES}
        for table in TABLES:
            state.setdefault(table, {})
        self._check_loaded(state, self.expected)
        # checked again once the gradients are known
        self._unchecked = None if self.expected else {table: dict(values) for table, values in state.items()}
        # copies: the exchange writes its memory buffers again in later steps (spares)
        state["memory"] = {name: states.copied(value) for name, value in state["memory"].items()}
        checkpoint.check_origin(origin, state, self.communicator.rank, self.communicator.size, _PROCESS,
                                self.compression.compressor.traits.shared_state)
        like = next((v[0] if isinstance(v, tuple) else v for v in state["memory"].values()), None)
        xp = backend_for(like) if like is not None else None
        for key, plan in self._plans.items():
            taken = states.gather(plan.bucket, state, self.compression.memory, xp, like, plan.flat_memory)
            for table, value in taken.items():
                state[table][key] = value
        self.store.load_state_dict(state)
        self.journal.abandon()  # a step in progress is abandoned
