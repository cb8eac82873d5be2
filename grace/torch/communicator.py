"""The three collective primitives on Horovod's PyTorch ops (asynchronous, named)."""
import torch
from horovod.torch import mpi_ops

from grace.core.communicator import ProcessSetCommunicator


class HorovodCommunicator(ProcessSetCommunicator):
    def __init__(self, process_set=mpi_ops.global_process_set):
        super().__init__(process_set)

    def allreduce_async(self, tensor, name):
        if tensor.dtype == torch.bfloat16:
            # Horovod's PyTorch ops carry no bfloat16: gather the raw 16 bits, sum in float32.
            gathered = self.allgather_async(tensor.reshape(1, *tensor.shape), name)
            return lambda: gathered().float().sum(0).to(torch.bfloat16)
        handle = mpi_ops.allreduce_async(tensor, name=name, op=mpi_ops.Sum, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def grouped_allreduce(self, dtype):
        return dtype != "bfloat16"

    def grouped_allreduce_async(self, tensors, name):
        """Horovod's grouped allreduce: one request, the tensors joined in its fusion buffer (each
        made contiguous: Horovod checks only the first, and reads any other's memory in order)."""
        handle = mpi_ops.grouped_allreduce_async([t.contiguous() for t in tensors], name=name, op=mpi_ops.Sum,
                                                 process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def sums_in_place(self, tensor):
        return tensor.dtype != torch.bfloat16

    def allreduce_async_(self, tensor, name):
        handle = mpi_ops.allreduce_async_(tensor, name=name, op=mpi_ops.Sum, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def grouped_allreduce_async_(self, tensors, name):
        # (a tensor that is not contiguous: its contiguous copy summed, and handed back)
        handle = mpi_ops.grouped_allreduce_async_([t.contiguous() for t in tensors], name=name, op=mpi_ops.Sum,
                                                  process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def allgather_async(self, tensor, name):
        if tensor.dtype == torch.bfloat16:
            handle = mpi_ops.allgather_async(tensor.view(torch.int16), name=name, process_set=self.process_set)
            return lambda: mpi_ops.synchronize(handle).view(torch.bfloat16)
        handle = mpi_ops.allgather_async(tensor, name=name, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)

    def alltoall_async(self, tensor, splits, name):
        splits = torch.tensor(list(splits), dtype=torch.int32)
        handle = mpi_ops.alltoall_async(tensor, splits=splits, name=name, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle)[0]  # (received, and how much from each rank)

    def broadcast_async(self, tensor, root, name):
        wire = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        handle = mpi_ops.broadcast_async(wire, root_rank=root, name=name, process_set=self.process_set)
        return lambda: mpi_ops.synchronize(handle).view(tensor.dtype)
