"""grace as a PyTorch DistributedDataParallel communication hook (NCCL, Gloo; no Horovod).

    model = DistributedDataParallel(model)
    state = grace.torch.ddp.register(model, grace.topk(0.01))

or, in PyTorch's own idiom,

    state = grace.torch.ddp.GraceState(model, grace.topk(0.01))
    model.register_comm_hook(state, grace.torch.ddp.hook)

DDP hands the hook one ``GradBucket`` at a time, as soon as backward has filled it, and waits
at the end of backward for the future the hook returns: the averaged bucket. A DDP bucket is
a grace bucket (``grace.core.bucket``): each gradient is compressed as its own tensor, with
its own error-feedback memory, and the whole bucket travels in one collective of the method.
State lives in ``GraceState``, keyed by parameter name, so it survives DDP rebuilding its
buckets after the first step, and ``state_dict()`` goes into a checkpoint (one per rank: the
memory is this rank's unsent gradient).
"""
import atexit
import collections
import ctypes
import queue
import threading
import time
import weakref
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grace.core.bucket import Bucket, Segment, bucket_key
from grace.core.compression import GradientCompression
from grace.core.compressor import Compressor
from grace.core.exchange import Exchange
from grace.torch.parameters import gradient_specs
from grace.torch.process_group import ProcessGroupCommunicator

__all__ = ["GraceState", "hook", "register"]


class GraceState:
    """What the hook keeps between buckets and steps: the exchange (memory, method state, step
    counters, bytes sent) and the parameter names of ``model``."""

    def __init__(self, model: DistributedDataParallel, compression: GradientCompression,
                 process_group: Optional[dist.ProcessGroup] = None):
        _check_ddp(model)
        self._start(compression, process_group if process_group is not None else model.process_group)
        self.attach(model)

    def _start(self, compression: GradientCompression, group: Optional[dist.ProcessGroup]) -> None:
        # (refuses a non-grace compression); results are written into DDP's buffer where it saves work
        self.exchange = Exchange(compression, ProcessGroupCommunicator(group), in_place=True)
        if not compression.bucket_mb:
            raise ValueError("grace.torch.ddp exchanges DDP's own buckets; bucket_mb=0 (one exchange per "
                             "tensor) cannot apply. Size them with DistributedDataParallel(bucket_cap_mb=...)")
        if compression.scope == "bucket" and type(compression.compressor).init_state is not Compressor.init_state:
            raise ValueError(f"scope='bucket' keeps {type(compression.compressor).__name__}'s state per bucket, "
                             "and DDP rebuilds its buckets after the first step; use scope='tensor'")
        self._names: Dict[int, str] = {}
        self._parameters = []
        self._buckets: Dict[tuple, Bucket] = {}
        self._lock = threading.Lock()
        self._open = 0  # buckets launched and not finished in this step
        self._last_launched = False
        # The collectives' works of this step and the last two, held so that a communication thread
        # never drops the last reference to one (see _AtExit)
        self._step_works = []
        self._works = collections.deque(maxlen=2)
        _AT_EXIT.states.add(self)

    def attach(self, model: DistributedDataParallel) -> "GraceState":
        """Bind the state to ``model``'s parameters (by name): done by the constructor, and needed
        again after unpickling (``torch.load``), which keeps no model."""
        _check_ddp(model)
        sparse = [name for name, m in model.module.named_modules() if getattr(m, "sparse", False) is True]
        if sparse:
            raise ValueError(f"grace compresses dense gradients; {', '.join(sparse)} produce sparse ones "
                             "(construct them with sparse=False)")
        ignored = getattr(model, "parameters_to_ignore", set())
        named = [(name, p) for name, p in model.module.named_parameters()
                 if p.requires_grad and name not in ignored]
        self._names = {id(p): name for name, p in named}
        self._parameters = [p for _, p in named]  # keeps the ids above valid
        self._buckets = {}
        self.exchange.expect(gradient_specs(named))
        return self

    def __getstate__(self) -> Dict[str, Any]:
        """What ``torch.save(state)`` keeps: the method, and this rank's memory, method state and
        step counters; not the process group or the model, as PyTorch's ``PowerSGDState`` drops
        its group. Loaded again (``torch.load(..., weights_only=False)``), the state uses the
        default process group and is bound to its model by ``attach(model)`` or ``register``."""
        return {"compression": self.exchange.compression, "state": self.state_dict()}

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        self._start(saved["compression"], None)
        self.load_state_dict(saved["state"])

    @property
    def stats(self):
        """Bytes this rank handed to the collectives (``last_step_bytes``, ``bytes_sent``, ...)."""
        return self.exchange.stats

    def state_dict(self) -> Dict[str, Any]:
        """This rank's memory, method state and step counters, per parameter name."""
        return self.exchange.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.exchange.load_state_dict(state)

    # --- one bucket ----------------------------------------------------------------------
    def launch(self, grad_bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self._names:
            raise RuntimeError("grace: this GraceState is bound to no model (it was loaded from a pickle); "
                               "bind it first: state.attach(model), or grace.torch.ddp.register(model, state)")
        buffer = grad_bucket.buffer()
        bucket, grads = self._bucket(grad_bucket)
        comm = self.exchange.communicator
        works = []
        comm.watch = works.append
        try:
            pending = self.exchange.start_bucket(bucket, grads, flat=buffer)
            if pending.selection is not None:  # (a frame sized by the ranks' counts: sent in hook order, as the rest)
                self.exchange.read_counts([pending])
        finally:
            comm.watch = None
        self._step_works.extend(works)
        with self._lock:
            self._open += 1
            self._last_launched |= grad_bucket.is_last()
        if self.exchange.compression.compressor.traits.multi_round:
            # Later rounds launch collectives: here, in hook order, every rank launches them in
            # the same order (a callback would run on a communication thread, at any time).
            done = torch.futures.Future()
            done.set_result(self._finish(pending, buffer, grads))
            return done
        return torch.futures.collect_all([work.get_future() for work in works]).then(_AT_EXIT.track(
            lambda _: self._finish(pending, buffer, grads)))

    def _finish(self, pending, buffer: torch.Tensor, grads) -> torch.Tensor:
        results = self.exchange.finish_bucket(pending, into=buffer)
        if any(r.data_ptr() != g.data_ptr() for r, g in zip(results, grads)):  # not in the buffer already
            flat = [g.reshape(-1) for g in results]
            storage = buffer.untyped_storage().data_ptr()
            if any(g.untyped_storage().data_ptr() == storage for g in flat):  # a result that is DDP's buffer
                buffer.copy_(torch.cat(flat))
            else:  # written straight into DDP's buffer: no bucket-sized temporary
                torch.cat(flat, out=buffer)
        with self._lock:
            self._open -= 1
            if self._last_launched and not self._open:  # the step's last bucket
                self._last_launched = False
                self.exchange.end_step()
                self._works.append(self._step_works)
                self._step_works = []
        return buffer

    def _bucket(self, grad_bucket: dist.GradBucket):
        """The grace bucket for DDP's (its parameters by name, in buffer order), and its
        non-empty gradients (views of the buffer)."""
        params, grads = grad_bucket.parameters(), grad_bucket.gradients()
        names = tuple(self._names[id(p)] for p in params)
        bucket = self._buckets.get(names)
        if bucket is None:
            segments, offset = [], 0
            for name, p in zip(names, params):
                if p.numel():
                    segments.append(Segment(name, tuple(p.shape), offset, p.numel()))
                offset += p.numel()
            if offset != grad_bucket.buffer().numel():
                raise RuntimeError(f"grace: DDP bucket {grad_bucket.index()} holds {grad_bucket.buffer().numel()} "
                                   f"elements, its parameters {offset}; its layout is not one grace can read")
            dtype = str(grad_bucket.buffer().dtype).removeprefix("torch.")
            key = bucket_key(grad_bucket.index(), names, prefix="grace.ddp")  # new when DDP rebuilds its buckets
            bucket = self._buckets[names] = Bucket(key, dtype, tuple(segments))
        return bucket, [g for g, p in zip(grads, params) if p.numel()]


class _AtExit:
    """What a communication thread must not do while the interpreter exits: take the GIL, which
    aborts the process ("terminate called without an active exception"). It would, to drop a
    bucket's callback, or a collective's work holding tensors whose Python objects only it still
    references. So at exit grace waits until every callback is dropped, signalled by a weak
    reference's callback that runs no Python code (``SimpleQueue.put``: the thread then gives
    the GIL back for good), and keeps the last steps' works forever: the thread's reference to
    a work is then never the last."""

    def __init__(self, patience_s: float = 10.0):
        self._held = set()  # weak references to the callbacks in flight
        self._dropped = queue.SimpleQueue()  # ... those whose callback was dropped
        self.patience_s = patience_s
        self.states = weakref.WeakSet()  # every GraceState, for its works

    def track(self, fn):
        self._forget(block=False)
        self._held.add(weakref.ref(fn, self._dropped.put))
        return fn

    def _forget(self, block: bool, deadline: float = 0.0) -> None:
        while self._held:
            try:
                ref = self._dropped.get(timeout=max(0.0, deadline - time.monotonic())) if block else \
                    self._dropped.get_nowait()
            except queue.Empty:
                return
            self._held.discard(ref)

    def __call__(self) -> None:
        self._forget(block=True, deadline=time.monotonic() + self.patience_s)
        for state in list(self.states):
            for works in (state._works, state._step_works):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(works))  # never freed: the process is ending


_AT_EXIT = _AtExit()
atexit.register(_AT_EXIT)


def _check_ddp(model) -> None:
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"grace.torch.ddp needs a DistributedDataParallel model, got {type(model).__name__}")


def hook(state: GraceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: compress ``bucket``, exchange it, hand back its average."""
    return state.launch(bucket)


def register(model: DistributedDataParallel, compression: "GradientCompression | GraceState",
             process_group: Optional[dist.ProcessGroup] = None) -> "GraceState":
    """Register grace's hook for ``compression`` on ``model``; returns its state (checkpoint
    it with ``state_dict()``, or pickle it whole). ``compression`` may be a ``GraceState`` loaded
    from a pickle: it is bound to ``model`` and registered."""
    if isinstance(compression, GraceState):
        if process_group is not None:
            raise ValueError("a loaded GraceState uses the default process group; process_group cannot apply")
        state = compression.attach(model)
    else:
        state = GraceState(model, compression, process_group)
    model.register_comm_hook(state, hook)
    return state
