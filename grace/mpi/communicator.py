"""The three collective primitives over mpi4py, for NumPy arrays.

Blocking and simple on purpose: this is the reference that the Horovod paths must match,
so every reduction is done in NumPy, in rank order.
"""
import numpy as np
from mpi4py import MPI

from grace.core.communicator import Communicator


class MPICommunicator(Communicator):
    def __init__(self, comm=None):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allreduce_async(self, tensor, name):
        parts = self.comm.allgather(np.ascontiguousarray(tensor))
        if tensor.dtype.itemsize < 4:  # half precision: sum in float32, like Horovod
            total = sum(p.astype(np.float32) for p in parts).astype(tensor.dtype)
        else:
            total = sum(parts[1:], parts[0].copy())
        return lambda: total

    def allgather_async(self, tensor, name):
        gathered = np.concatenate(self.comm.allgather(np.ascontiguousarray(tensor)))
        return lambda: gathered

    def alltoall_async(self, tensor, splits, name):
        starts = np.cumsum([0, *splits])
        parts = self.comm.alltoall([np.ascontiguousarray(tensor[a:b]) for a, b in zip(starts[:-1], starts[1:])])
        received = np.concatenate(parts)
        return lambda: received

    def broadcast_async(self, tensor, root, name):
        received = self.comm.bcast(tensor if self.rank == root else None, root=root)
        return lambda: received
