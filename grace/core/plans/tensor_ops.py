"""A segmented bucket's tensor-op path as two functions of tensors, for the backend to fuse.

Where no native kernel runs (a GPU without grace's CUDA library), each phase of a segmented
bucket is a chain of whole-buffer tensor ops, dozens of kernel launches:

    compress(g, e)     -> (this rank's frame, its overflow flag, the new memory)
    mean(received)     -> (the mean of the ranks' frames, poisoned; how many flagged an overflow)

written here once as plain functions of tensors, with no side effect (what ``Segmented`` runs
on its first step, the same ops in the same order). The plan hands them to ``xp.fused``: on a
GPU, torch.compile makes a few fused kernels of each; elsewhere they run as they are.

Only where every step runs the same program: fields of a fixed layout in an allgathered frame,
not sent dense, and no draws (a step's seeds would be constants of the compiled program).
"""
from __future__ import annotations

from grace.core.compressor import Collective


def tensor_ops_of(plan, pending):
    """``TensorOps`` of a segmented plan whose step (``pending``, its first) ran the tensor-op
    path where they apply; else None."""
    s = plan.services
    compressor = s.compression.compressor
    if plan.variable or compressor.collective is Collective.ALLREDUCE or compressor.traits.seeded \
            or pending.segment_ctx is not None or pending.sent_dense or not pending.defer:
        return None
    return TensorOps(plan, pending.xp, pending.g)


class TensorOps:
    """A segmented plan's two phases, made once per plan (see the module's docstring)."""

    def __init__(self, plan, xp, like):
        s = plan.services
        kernels, memory, table, layout = s.kernels, s.compression.memory, plan.table, plan.own_layout
        guarded, ranks = s.journal.guarded, s.communicator.size
        self.ranks = ranks  # (the world the mean is of)

        def compress(g, e):
            flag = xp.nonfinite([g], "uint8") if guarded else None
            p = memory.compensate(xp, g, e)
            fields, _, p_hat = kernels.compress_segments(xp, p, table, ())  # (no draws: no step infos)
            e_new = None
            if memory.needs_feedback:
                p_hat = kernels.decompress_segments(xp, fields, None, table) if p_hat is None else p_hat
                e_new = memory.update(xp, p, p_hat, e)
            return layout.write(xp, fields, flag), flag, e_new

        def mean(received):
            count = xp.sum(layout.flags(xp, received, ranks)) if guarded else None  # (int64)
            fields, _ = layout.read(xp, received, ranks)
            return kernels.aggregate_segments(xp, fields, None, table, ranks, count), count

        self.compress = xp.fused(compress, "grace_compress", like)
        self.mean = xp.fused(mean, "grace_mean", like)
