"""``DistributedOptimizer`` for grace methods, on Horovod's own PyTorch optimizer machinery.

Horovod's ``_DistributedOptimizer`` registers the gradient hooks, counts
``backward_passes_per_step`` and, in ``synchronize()``, accepts a callable as a handle ("it
returns the aggregated tensor result"). grace overrides only the per-gradient exchange: the
hook runs the GRACE pipeline (memory, compress, the method's own collective) and hands
Horovod a callable that finishes it. Everything else is Horovod's code, unmodified.
"""
from __future__ import annotations

import weakref
from typing import List, Tuple

from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum, global_process_set
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from grace.horovod_common import check_horovod_arguments
from grace.core.exchange import Exchange
from grace.core.ready import ReadyBuckets
from grace.torch.communicator import HorovodCommunicator
from grace.torch.parameters import gradient_specs


_MADE: List[weakref.ref] = []  # every grace optimizer made in this process, in order


def made_optimizers() -> Tuple[List[tuple], int]:
    """(place in the order of making, optimizer) of the grace optimizers alive in this process,
    and how many were made. Every rank makes the same optimizers in the same order, but may
    free them at other times (the garbage collector), so ranks match optimizers by place."""
    return [(i, ref()) for i, ref in enumerate(_MADE) if ref() is not None], len(_MADE)


class _GraceOptimizer:
    """Methods that replace Horovod's in the dynamically built optimizer class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 sparse_as_dense, process_set):
        # Horovod's own hook sees Compression.none: grace's handle returns the final gradient.
        _HorovodOptimizer.__init__(self, params, named_parameters, Compression.none,
                                   backward_passes_per_step, op, 1.0, None, sparse_as_dense, process_set)
        # in place, as Horovod's own allreduce: Horovod sets p.grad to the result
        self._grace = Exchange(compression, HorovodCommunicator(process_set), average=op == Average, in_place=True)
        _MADE.append(weakref.ref(self))
        self._grace_buckets = None
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        specs = gradient_specs((self._parameter_names[p], p) for p in reversed(params))
        if compression.bucket_mb:  # planned in backward order: the last parameters first
            self._grace_buckets = ReadyBuckets(self._grace, self._grace.bucket_layout(specs))
        else:
            self._grace.expect(specs)
        # Horovod skips communication on a single rank; a compression method still applies
        # there, so that training with it behaves the same at any scale.
        if process_set.included() and not self._grad_accs:
            self._register_hooks()

    def _allreduce_grad_async(self, p):
        if p.grad is None:  # another rank may have a gradient for p: exchange zeros
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names[p]
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"grace cannot compress the sparse gradient of {name!r}; "
                                 "pass sparse_as_dense=True to DistributedOptimizer")
            grad = grad.to_dense()
        if self._grace_buckets is not None:
            return self._grace_buckets.add(name, grad), None
        pending = self._grace.start(name, grad)
        return (lambda: self._grace.finish(pending)), None

    def synchronize(self):
        try:
            _HorovodOptimizer.synchronize(self)
        finally:
            if self._grace_buckets is not None:
                self._grace_buckets.reset()
            self._grace.end_step()

    @property
    def grace_stats(self):
        """Bytes this rank handed to the collectives (``last_step_bytes``, ``bytes_sent``, ...)."""
        return self._grace.stats

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["grace"] = self._grace.state_dict()  # this rank's error-feedback memory
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        grace_state = state_dict.pop("grace", None)
        _HorovodOptimizer.load_state_dict(self, state_dict)
        if self._grace_buckets is not None:
            self._grace_buckets.reset()
        if grace_state is not None:
            self._grace.load_state_dict(grace_state)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Horovod's ``DistributedOptimizer`` for a grace ``compression`` (same arguments).

    Gradients travel with the method's own collective and error feedback; ``op`` is
    ``hvd.Average`` or ``hvd.Sum``. ``gradient_predivide_factor`` has no effect on the result
    (the sum is formed in full precision, or, for fp16, pre-divided by the number of ranks).
    """
    check_horovod_arguments(compression, op, Average, Sum, Adasum, groups, num_groups)
    if backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")

    # Like Horovod: a class made on the fly that inherits from the user's optimizer class.
    # It keeps Horovod's __module__, which hvd.broadcast_optimizer_state relies on.
    methods = {k: v for k, v in _GraceOptimizer.__dict__.items() if not k.startswith("__") or k == "__init__"}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {**_HorovodOptimizer.__dict__, **methods})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               sparse_as_dense, process_set)


