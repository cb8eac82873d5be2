"""The three collective primitives on a ``torch.distributed`` process group (NCCL, Gloo, MPI).

``torch.distributed`` collectives work in place and need equal lengths for an allgather, so a
receiver's broadcast gets a fresh buffer and an allgather of unequal lengths first gathers
the lengths (a small collective, awaited before the data's is launched). The work of every
collective launched is also handed to ``watch`` where one is set, so that a DDP hook can chain
its own future on theirs. Imports no Horovod module.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from grace.core.communicator import Communicator

# (all_gather_into_tensor before PyTorch 2.13 renamed it)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ProcessGroupCommunicator(Communicator):
    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.watch: Optional[Callable[[dist.Work], None]] = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def _launched(self, work: dist.Work, result) -> Callable[[], torch.Tensor]:
        future = work.get_future()  # (Gloo: Work.wait() inside a callback of its future would hang)
        if self.watch is not None:
            self.watch(work)

        def wait():
            future.wait()
            return result() if callable(result) else result

        return wait

    def allreduce_async(self, tensor, name):
        # the payloads are the exchange's own tensors, free to be summed in place
        return self._launched(dist.all_reduce(tensor, group=self.group, async_op=True), tensor)

    def allgather_equal_async(self, tensor, name):
        out = tensor.new_empty(self.size * tensor.numel())
        return self._launched(_all_gather_single(out, tensor.reshape(-1), group=self.group, async_op=True), out)

    def allgather_async(self, tensor, name):
        n = self.size
        lengths = self.allgather_equal_async(torch.tensor([tensor.numel()], device=tensor.device), name)()
        lengths = lengths.tolist()
        longest = max(lengths)
        if min(lengths) == longest:
            return self.allgather_equal_async(tensor, name)
        padded = tensor.new_zeros(longest)
        padded[:tensor.numel()] = tensor.reshape(-1)
        out = tensor.new_empty(n * longest)
        work = _all_gather_single(out, padded, group=self.group, async_op=True)
        rows = out.view(n, longest)
        return self._launched(work, lambda: torch.cat([rows[r, :lengths[r]] for r in range(n)]))

    def alltoall_async(self, tensor, splits, name):
        sent = torch.tensor(list(splits), dtype=torch.int64, device=tensor.device)
        sizes = torch.empty_like(sent)  # what each rank sends this one: told first
        dist.all_to_all_single(sizes, sent, group=self.group)
        return self._all_to_all(tensor, splits, sizes.tolist())

    def alltoall_equal_async(self, tensor, splits, name):
        return self._all_to_all(tensor, splits, list(splits))  # (every rank sends this one what it sends each)

    def _all_to_all(self, tensor, splits, sizes):
        out = tensor.new_empty(sum(sizes))
        work = dist.all_to_all_single(out, tensor, sizes, list(splits), group=self.group, async_op=True)
        return self._launched(work, out)

    def broadcast_async(self, tensor, root, name):
        buffer = tensor if root == self.rank else torch.empty_like(tensor)
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        return self._launched(dist.broadcast(buffer, src=src, group=self.group, async_op=True), buffer)
