"""The collectives each method needs, built once on three primitives a toolkit provides.

A toolkit adapter (Horovod for PyTorch or TensorFlow, mpi4py for NumPy) implements only the
primitives, each asynchronous (it returns a zero-argument ``wait`` callable):

    allreduce_async(tensor, name)        elementwise sum over ranks: the tensor given, summed in
                                         place, or a new tensor (then the caller's own)
    allgather_async(tensor, name)        1-d tensors, lengths may differ; concatenated in rank order
    broadcast_async(tensor, root, name)  the root's tensor, on every rank (a receiver's tensor
                                         gives only the size and dtype; it is not written to)

and, for ``communicator='alltoall'``, ``alltoall_async(tensor, splits, name)``: the 1-d tensor
cut into ``splits[j]`` elements for rank j, in rank order; ``wait()`` gives what every rank
sent this one, in rank order, as one tensor.

and, where it pays, ``allgather_equal_async`` (the same when all lengths are equal),
``grouped_allreduce_async`` (several tensors summed by one collective of the toolkit's own,
which joins them itself: Horovod's grouped allreduce) and ``allreduce_async_`` /
``grouped_allreduce_async_`` (the sums written into the tensors given, which the caller owns:
no output allocated per step).

On top of them this class exchanges whole payloads (tuples of tensors) and reports the bytes
this rank handed to the collectives, headers included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Sequence

from grace.core.tensors import backend_for
from grace.core.compressor import Collective, Payload


@dataclass
class Handle:
    wait: Callable[[], Any]  # allreduce: the summed payload; allgather/broadcast: [payload per rank]
    nbytes: int  # bytes this rank handed to the collectives


class Communicator:
    rank: int
    size: int
    #: every rank holds what this one holds (a world emulated by one process): no other rank's
    #: state to gather
    replicas: bool = False

    # --- primitives, implemented by each toolkit adapter ---------------------------------
    def allreduce_async(self, tensor, name: str) -> Callable[[], Any]:
        raise NotImplementedError

    def allgather_async(self, tensor, name: str) -> Callable[[], Any]:
        raise NotImplementedError

    def broadcast_async(self, tensor, root: int, name: str) -> Callable[[], Any]:
        raise NotImplementedError

    def alltoall_async(self, tensor, splits: Sequence[int], name: str) -> Callable[[], Any]:
        raise NotImplementedError(f"{type(self).__name__} has no alltoall: communicator='alltoall' needs one")

    def alltoall_equal_async(self, tensor, splits: Sequence[int], name: str) -> Callable[[], Any]:
        """``alltoall_async`` where every split is as long as every other, on every rank (a
        toolkit that must tell the receivers their sizes then skips that exchange)."""
        return self.alltoall_async(tensor, splits, name)

    def allgather_equal_async(self, tensor, name: str) -> Callable[[], Any]:
        """``allgather_async`` where every rank sends as many elements as this one (a toolkit
        whose allgather needs equal lengths then skips exchanging them)."""
        return self.allgather_async(tensor, name)

    def grouped_allreduce(self, dtype: str) -> bool:
        """Whether ``grouped_allreduce_async`` is the toolkit's own for tensors of ``dtype``:
        one collective for several tensors, joined by the toolkit (else the exchange joins
        them into one buffer and calls ``allreduce_async``)."""
        return False

    def grouped_allreduce_async(self, tensors: Sequence, name: str) -> Callable[[], Any]:
        """The elementwise sums over ranks of several tensors of one dtype (of any shapes), in one
        collective: ``wait()`` gives the list of sums, new tensors in the shapes given (the
        tensors given may be views of the caller's gradients: they are never written)."""
        raise NotImplementedError

    def sums_in_place(self, tensor) -> bool:
        """Whether ``allreduce_async_`` and ``grouped_allreduce_async_`` take tensors like
        ``tensor`` (else the caller uses the out-of-place primitives)."""
        return False

    def allreduce_async_(self, tensor, name: str) -> Callable[[], Any]:
        """``allreduce_async`` with the sum written into ``tensor`` (the caller's own, free to
        be overwritten): ``wait()`` gives ``tensor``."""
        raise NotImplementedError

    def grouped_allreduce_async_(self, tensors: Sequence, name: str) -> Callable[[], Any]:
        """``grouped_allreduce_async`` with each sum written into its tensor (the caller's own):
        ``wait()`` gives the tensors given (or the contiguous copy summed, of one that is not)."""
        raise NotImplementedError

    # --- payload-level collectives -------------------------------------------------------
    def exchange(self, collective: Collective, xp, payload: Payload, name: str,
                 equal_lengths: bool) -> Handle:
        if collective is Collective.ALLREDUCE:
            return self.allreduce(xp, payload, name)
        if collective is Collective.ALLGATHER:
            return self.allgather(xp, payload, name, equal_lengths)
        return self.broadcast(xp, payload, name, equal_lengths)

    def allreduce(self, xp, payload: Payload, name: str) -> Handle:
        waits = [self.allreduce_async(t, f"{name}.{i}") for i, t in enumerate(payload)]
        return Handle(lambda: tuple(w() for w in waits), _nbytes(xp, payload))

    def allgather(self, xp, payload: Payload, name: str, equal_lengths: bool) -> Handle:
        flat = [xp.flatten(t) for t in payload]
        nbytes = _nbytes(xp, flat)
        lengths_wait = None
        if not equal_lengths:
            lengths = _lengths(xp, flat)
            lengths_wait = self.allgather_equal_async(lengths, f"{name}.lengths")
            nbytes += xp.nbytes(lengths)
        gather = self.allgather_equal_async if equal_lengths else self.allgather_async
        waits = [gather(t, f"{name}.{i}") for i, t in enumerate(flat)]

        def wait() -> List[Payload]:
            gathered = [w() for w in waits]
            if lengths_wait is None:  # every rank sent as many elements as this one
                table = [[xp.numel(t)] * self.size for t in flat]
                for t, mine in zip(gathered, flat):
                    total = xp.numel(t)
                    if isinstance(total, int) and total != self.size * xp.numel(mine):
                        raise RuntimeError(f"grace: ranks sent payloads of different lengths for {name!r} "
                                           "(are they configured differently?)")
            else:
                rows = xp.reshape(lengths_wait(), (self.size, len(flat)))
                table = [rows[:, i] for i in range(len(flat))]
            per_tensor = [xp.split(t, sizes) for t, sizes in zip(gathered, table)]
            return [tuple(parts) for parts in zip(*per_tensor)]

        return Handle(wait, nbytes)

    def broadcast(self, xp, payload: Payload, name: str, equal_lengths: bool) -> Handle:
        """Each rank broadcasts its payload in turn; every rank ends up with all payloads."""
        flat = [xp.flatten(t) for t in payload]
        nbytes = _nbytes(xp, flat)
        if equal_lengths:
            table = [[xp.numel(t) for t in flat]] * self.size
        else:  # receivers must know the sizes before the broadcasts
            lengths = _lengths(xp, flat)
            nbytes += xp.nbytes(lengths)
            table = xp.reshape(self.allgather_equal_async(lengths, f"{name}.lengths")(), (self.size, len(flat)))
        waits = []
        for root in range(self.size):
            for i, t in enumerate(flat):
                # Receivers pass a buffer of the root's size whose content is ignored. With equal
                # lengths that is this rank's own payload: a fresh constant (zeros) would let
                # TensorFlow's graph optimizer run the broadcast early, on this rank alone, and hang.
                buffer = t if root == self.rank or equal_lengths else xp.zeros(table[root][i], xp.dtype(t), like=t)
                waits.append(self.broadcast_async(buffer, root, f"{name}.{i}.from{root}"))

        def wait() -> List[Payload]:
            results = [w() for w in waits]
            m = len(flat)
            return [tuple(results[r * m:(r + 1) * m]) for r in range(self.size)]

        return Handle(wait, nbytes)


class ProcessSetCommunicator(Communicator):
    """Over a group of processes that knows its own ``rank()`` and ``size()`` (a Horovod
    process set). Both are read at every use: Horovod's elastic training changes them while
    the job runs."""

    def __init__(self, process_set):
        self.process_set = process_set

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def size(self) -> int:
        return self.process_set.size()


class LocalCommunicator(Communicator):
    """A world of one: every collective hands back this rank's own tensor."""

    rank, size = 0, 1

    def allreduce_async(self, tensor, name):
        return lambda: tensor

    def allgather_async(self, tensor, name):
        return lambda: tensor

    def broadcast_async(self, tensor, root, name):
        return lambda: tensor

    def alltoall_async(self, tensor, splits, name):
        return lambda: tensor


class ReplicaCommunicator(Communicator):
    """A world of ``size`` ranks that all send what this one sends, without a network: the
    local work of an n-rank step (n payloads to decode), for measuring compression cost. Each
    collective's result is made when it is launched, as a network delivers it while the step
    goes on (made only when awaited, a result would still be in the cache when read)."""

    rank = 0
    replicas = True

    def __init__(self, size: int):
        self.size = size
        self._sent = {}  # per exchange's name: what this rank broadcast

    def allreduce_async(self, tensor, name):
        out = tensor * self.size
        return lambda: out

    def grouped_allreduce(self, dtype):
        return True  # (each tensor's sum: what a toolkit's grouped allreduce hands back)

    def grouped_allreduce_async(self, tensors, name):
        out = [t * self.size for t in tensors]
        return lambda: out

    def sums_in_place(self, tensor):
        return backend_for(tensor).mutable_tensors

    def allreduce_async_(self, tensor, name):
        backend_for(tensor).multiply_into(tensor, self.size, tensor)
        return lambda: tensor

    def grouped_allreduce_async_(self, tensors, name):
        for t in tensors:
            backend_for(t).multiply_into(t, self.size, t)
        return lambda: list(tensors)

    def allgather_async(self, tensor, name):
        out = backend_for(tensor).concat([tensor] * self.size)
        return lambda: out

    def alltoall_async(self, tensor, splits, name):
        mine = int(splits[0])  # (every rank sends this rank, rank 0, what it sends itself)
        out = backend_for(tensor).concat([tensor[:mine]] * self.size)
        return lambda: out

    def broadcast_async(self, tensor, root, name):
        # every root sends what this rank does: a receiver's buffer gets this rank's own
        # broadcast of the same exchange (the roots go in turn, this one first)
        if root == self.rank:
            self._sent[name.rsplit(".from", 1)[0]] = tensor
            return lambda: tensor
        out = self._sent.get(name.rsplit(".from", 1)[0], tensor)
        return lambda: out


def _lengths(xp, flat: Sequence):
    """int64 element counts of a payload's tensors, as one tensor (they may be dynamic)."""
    return xp.concat([xp.reshape(xp.cast(xp.asarray(xp.numel(t), like=t), "int64"), (1,)) for t in flat])


def _nbytes(xp, tensors: Sequence) -> int:
    return sum(xp.nbytes(t) for t in tensors)
