"""A segmented bucket's tensor-op path as two functions of tensors, for the backend to fuse.

Where no native kernel runs (a GPU without grace's CUDA library), each phase of a segmented
bucket is a chain of whole-buffer tensor ops, dozens of kernel launches. Here they are written
once as plain functions of tensors, with no side effect (what ``Segmented`` runs on its first
step, the same ops in the same order):

    compress(g, e, infos) -> (what is sent, the overflow flag, the new memory, ctx)
    mean(received, ctx)   -> (the mean, poisoned; how many ranks flagged an overflow)

What is sent is this rank's frame, or the fields an allreduce sums (then mean takes the sums,
and the plan poisons by the summed flags); ctx is what the compressor keeps for the mean
(random-k's indices) or None. The plan hands both to ``xp.fused``: on a GPU torch.compile makes
a few fused kernels of each; elsewhere they run as they are.

Only where every step runs the same program: fields of a fixed layout (allreduced, or in an
allgathered frame not sent dense: not threshold's), and no schedule over the steps (DGC's
sparsity warm-up sets each step's k on the host). A method that draws gets the step as a
tensor in its infos (``TensorInfo.step``): its seeds are made on the device
(``grace.core.draws``), so the step is an input of the compiled program, not a constant of it.
"""
from __future__ import annotations

from grace.core.compressor import Collective


def tensor_ops_of(plan, pending):
    """``TensorOps`` of a segmented plan whose step (``pending``, its first) ran the tensor-op
    path where they apply; else None. Not where grace's native library runs on the bucket's
    device (every build has its ``pack``): its kernels make the phases, and what one lacks
    runs op by op as before."""
    s, xp = plan.services, pending.xp
    compressor = s.compression.compressor
    if plan.variable or compressor.traits.scheduled or pending.sent_dense or not pending.defer \
            or xp.native("pack", pending.g):
        return None
    return TensorOps(plan, xp, pending.g)


class TensorOps:
    """A segmented plan's two phases, made once per plan (see the module's docstring)."""

    def __init__(self, plan, xp, like):
        s = plan.services
        kernels, memory, table, layout = s.kernels, s.compression.memory, plan.table, plan.own_layout
        guarded, ranks = s.journal.guarded, s.communicator.size
        allreduce = s.compression.compressor.collective is Collective.ALLREDUCE
        self.ranks = ranks  # (the world the mean is of)
        self.seeded = s.compression.compressor.traits.seeded  # (then compress takes the step's infos)

        def compress(g, e, infos):
            flag = xp.nonfinite([g], plan.flag_dtype()) if guarded else None
            p = memory.compensate(xp, g, e)
            fields, ctx, p_hat = kernels.compress_segments(xp, p, table, infos)
            e_new = None
            if memory.needs_feedback:
                p_hat = kernels.decompress_segments(xp, fields, ctx, table) if p_hat is None else p_hat
                e_new = memory.update(xp, p, p_hat, e)
            return (tuple(fields) if allreduce else layout.write(xp, fields, flag)), flag, e_new, ctx

        def mean(received, ctx):
            count = xp.sum(layout.flags(xp, received, ranks)) if guarded else None  # (int64)
            fields, _ = layout.read(xp, received, ranks)
            return kernels.aggregate_segments(xp, fields, ctx, table, ranks, count), count

        def summed_mean(summed, ctx):  # (poisoned by the summed flags afterwards, as the plan does)
            return kernels.decompress_segments(xp, list(summed), ctx, table) / ranks, None

        self.compress = xp.fused(compress, "grace_compress", like)
        self.mean = xp.fused(summed_mean if allreduce else mean, "grace_mean", like)
