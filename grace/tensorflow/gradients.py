"""The function Horovod's TensorFlow tape and Keras optimizer call to reduce gradients.

Horovod builds both around ``_allreduce_grads(grads, vars, use_generic_names=False)``, which
returns the reduced gradients in order. grace builds them with ``Compression.none`` and puts
a ``GradientExchange`` in that slot: the GRACE pipeline with the method's own collective, its
state in tf.Variables keyed by the variable's name (stable across steps and traces).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List

import tensorflow as tf
from horovod.tensorflow import mpi_ops

from grace.core.compression import GradientCompression
from grace.core import portable
from grace.core.exchange import Exchange
from grace.core.state import TABLES
from grace.tensorflow import retrace
from grace.tensorflow.communicator import HorovodCommunicator
from grace.tensorflow.state import VariableStore, VariableWireStats


_RUNNING: List[tuple] = []  # (configuration, weak references to its variables, GradientExchange)
_PENDING: Dict[tuple, Any] = {}  # shared state from rank 0 for exchanges this process has not run yet


class GradientExchange:
    """The reduction of one model's gradients. Its state belongs to the variables it reduces
    for, by identity: the same compression object called for another model's variables (a
    second tape, a new model with the same variable names) runs a state of their own. An
    equal compression built again for the same variables (every step, or in every trace, as
    Horovod's own examples do inside ``tf.function``) continues the state of the first one,
    unless it was given a state of its own (``load_state_dict``) before its first step."""

    def __init__(self, compression: GradientCompression, op=mpi_ops.Average, sparse_as_dense=False,
                 process_set=mpi_ops.global_process_set):
        self._arguments = (compression, op, sparse_as_dense, process_set)
        self._own = None  # made on first use: its wire counters are variables, which a later trace cannot create
        self.sparse_as_dense = sparse_as_dense
        self._configuration = (repr(compression), op, sparse_as_dense, process_set.process_set_id)
        self._variables = None  # weak references to the variables this one runs for, once bound
        self._runners: List[tuple] = []  # (weak references to variables, the GradientExchange that runs them)
        self._key = None  # once it runs itself: its configuration and variables' names (see _bind)

    @property
    def _exchange(self) -> Exchange:
        if self._own is None:
            compression, op, _, process_set = self._arguments
            # Horovod's TensorFlow recipes broadcast variables after the first step, so a
            # checkpoint loaded on rank 0 alone reaches the others' step counters only through grace
            self._own = Exchange(compression, HorovodCommunicator(process_set), average=op == mpi_ops.Average,
                                 store=VariableStore(), stats=VariableWireStats(), shared_state_from_rank_0=True)
        return self._own

    @property
    def exchange(self) -> Exchange:
        """The exchange of the first variables this one reduced for (``for_variables``: others')."""
        return (self._runners[0][1] if self._runners else self)._exchange

    @property
    def stats(self):
        return self.exchange.stats

    @property
    def variables(self):
        """The state variables (memory, compressor state, step counters), for checkpoints."""
        return self.exchange.store.variables

    def for_variables(self, variables) -> "GradientExchange":
        """The exchange that reduces gradients of ``variables`` (these very objects) with this
        configuration: one already running for them, or a new one, bound to them."""
        wanted = list(variables or [])
        for refs, runner in self._runners:
            if _same(refs, wanted):
                return runner
        runner = self._bind(wanted) if self._variables is None else GradientExchange(*self._arguments)._bind(wanted)
        self._runners.append(([weakref.ref(v) for v in wanted], runner))
        return runner

    def _bind(self, wanted) -> "GradientExchange":
        """An exchange of an equal configuration that already runs for these very variables,
        or this one, bound to them."""
        fresh = self._own is None or not any(self._own.store.tables[table] for table in TABLES)
        for configuration, refs, running in _prune_running() if wanted and fresh else []:
            if configuration == self._configuration and _same(refs, wanted):
                return running
        self._variables = [weakref.ref(v) for v in wanted]
        # who this exchange is across processes (Horovod's elastic sync): configuration,
        # variables' names, and its place among the exchanges of both (two models of one naming)
        names = tuple(v.name for v in wanted)
        twins = sum(1 for _, _, running in _RUNNING if running._key[:2] == (self._configuration, names))
        self._key = self._configuration, names, twins
        _RUNNING.append((self._configuration, self._variables, self))
        return self

    # Inside tf.function this runs as plain Python that builds ops (it never branches on a
    # tensor's value), so AutoGraph need not convert it, nor the backends it imports.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, variables=None, use_generic_names=False):
        runner = self.for_variables(variables)
        if runner is not self:
            return runner(grads, variables, use_generic_names)
        if self._key in _PENDING:  # joined an elastic job: rank 0's step counters (and PowerSGD's Q)
            with tf.init_scope():
                self._exchange.load_shared_state(_PENDING.pop(self._key))
        reduced = self._reduce(grads, variables, use_generic_names)
        if tf.executing_eagerly():
            return reduced
        # A traced step has the world in its graph: after an elastic reset it is traced again
        # (grace.tensorflow.retrace); a run of this trace in another world still stops here.
        retrace.record(_horovod_world())
        size = self._exchange.communicator.size
        check = tf.debugging.assert_equal(
            mpi_ops.size_op(self._arguments[3].process_set_id), size,
            message=f"grace: this step was traced for a world of {size} ranks and runs in another one (Horovod's "
                    "elastic training), and grace could not have it traced again; build the tf.function again "
                    "in a reset callback (state.register_reset_callbacks)")
        with tf.control_dependencies([check]):
            return [None if g is None else tf.identity(g) for g in reduced]

    def _reduce(self, grads, variables, use_generic_names):
        names = [f"grad_{i}" if use_generic_names or variables is None else v.name.removesuffix(":0")
                 for i, v in enumerate(variables or grads)]
        dense = {}
        for name, grad in zip(names, grads):
            if grad is None:  # no gradient for this variable on this rank: Horovod's rule too
                continue
            if isinstance(grad, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(f"grace cannot compress the sparse gradient of {name!r}; "
                                     "pass sparse_as_dense=True")
                grad = tf.convert_to_tensor(grad)
            if name in dense:  # they would share one memory: silently wrong gradients
                raise ValueError(f"two variables are named {name!r}: grace keeps error-feedback state per "
                                 "variable name, so give each variable a unique name (tf.Variable(..., name=...))")
            dense[name] = grad
        if not self._exchange.compression.bucket_mb:
            started = {name: self._exchange.start(name, grad) for name, grad in dense.items()}
            reduced = {name: self._exchange.finish(p) for name, p in started.items()}
            self._exchange.end_step()
        else:  # buckets planned in backward order: the last variables first
            reduced = self._exchange.exchange(dict(reversed(list(dense.items()))))
        return [reduced.get(name) if grad is not None else None for name, grad in zip(names, grads)]


def _same(refs, variables) -> bool:
    """Whether weak references ``refs`` point at ``variables``, these very objects, in order."""
    return len(refs) == len(variables) and all(r() is v for r, v in zip(refs, variables))


def _prune_running() -> List[tuple]:
    """``_RUNNING`` without the exchanges whose variables are gone."""
    global _RUNNING
    _RUNNING = [entry for entry in _RUNNING if all(r() is not None for r in entry[1])]
    return _RUNNING


def _running_exchanges() -> Dict[tuple, "GradientExchange"]:
    return {exchange._key: exchange for _, _, exchange in _prune_running() if exchange._own is not None}


_SAVED: Dict[tuple, Any] = {}  # each running exchange's state at the last elastic commit


def save_states() -> None:
    """Keep every running exchange's state (Horovod's elastic commit)."""
    _SAVED.clear()
    _SAVED.update((key, exchange.exchange.state_dict()) for key, exchange in _running_exchanges().items())


def restore_states() -> None:
    """Put back the states of the last commit (Horovod's elastic reset after a failed step)."""
    for key, exchange in _running_exchanges().items():
        if key in _SAVED:
            exchange.exchange.load_state_dict(_SAVED[key])


def follow_world() -> None:
    """After Horovod's elastic reset: the steps traced in another world are traced again at their
    next call (``grace.tensorflow.retrace``)."""
    retrace.follow(_horovod_world())


def _horovod_world() -> retrace.World:
    """(rank, size) in Horovod's global world: what a trace is recorded with and compared to."""
    return mpi_ops.rank(), mpi_ops.size()


def sync_shared_state() -> None:
    """Every rank takes rank 0's shared state (step counters, PowerSGD's Q) of every exchange,
    as Horovod's elastic state objects sync after a reset; each keeps its own memory. An exchange
    this process has not run yet (it just joined) takes it at its first step. Every rank calls
    this, whatever it runs: the states sent as data only (``grace.core.portable``)."""
    running = _running_exchanges()
    communicator = HorovodCommunicator()
    mine = {key: exchange.exchange.shared_state() for key, exchange in running.items()} \
        if communicator.rank == 0 else None
    with tf.init_scope():
        shared = portable.broadcast(communicator, mine, 0, tf.zeros(0), "grace.shared_state")
    for key, state in shared.items():
        if key in running:
            running[key].exchange.load_shared_state(state)
        else:
            _PENDING[key] = state


_TAPE_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def exchange_for(compression: GradientCompression, op=mpi_ops.Average, sparse_as_dense=False,
                 process_set=mpi_ops.global_process_set) -> GradientExchange:
    """The exchange that the tapes built with ``compression`` share: a tape is usually made
    anew every step, so the state lives with the compression object (and, from the first
    step, with its equals for the same variables: see ``GradientExchange``)."""
    per_compression = _TAPE_EXCHANGES.setdefault(compression, {})
    key = (process_set.process_set_id, op, sparse_as_dense)
    if key not in per_compression:
        per_compression[key] = GradientExchange(compression, op, sparse_as_dense, process_set)
    return per_compression[key]
