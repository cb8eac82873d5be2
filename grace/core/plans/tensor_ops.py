"""A segmented bucket's tensor-op path as functions of tensors, for the backend to fuse.

Where no native kernel runs (a GPU without grace's CUDA library), each phase of a segmented
bucket is a chain of whole-buffer tensor ops, dozens of kernel launches. Here they are written
once as plain functions of tensors, with no side effect (what ``Segmented`` runs on its first
step, the same ops in the same order). A bucket of fixed layout (``TensorOps``):

    compress(g, e, infos) -> (what is sent, the overflow flag, the new memory, ctx)
    mean(received, ctx)   -> (the mean, poisoned; how many ranks flagged an overflow)

What is sent is this rank's frame, or the fields an allreduce sums (then mean takes the sums,
and the plan poisons by the summed flags); ctx is what the compressor keeps for the mean
(random-k's indices) or None. A bucket of variable-length selections (threshold's:
``SelectionOps``), whose frame is made once the ranks' counts are read back:

    select(g, e, infos)  -> (p, the mask, the counts, the header, the flag, the new memory)
    pairs(received, rows, total) -> (every rank's indices in the bucket, values over the ranks)

(``rows``: where every rank's pairs lie); the plan adds them rank after rank, one scatter a
rank (atomics in one would add the ranks in any order: a rank's mean unlike another's).

The plan hands them to ``xp.fused``: on a GPU torch.compile makes a few fused kernels of each
(the variable-length pairs one program for every length); elsewhere they run as they are. The
frame between them stays op by op (a handful, sized by the counts).

Not where a schedule over the steps runs (DGC's sparsity warm-up sets each step's k on the
host). A method that draws gets the step as a tensor in its infos (``TensorInfo.step``): its
seeds are made on the device (``grace.core.draws``), so the step is an input of the compiled
program, not a constant of it.
"""
from __future__ import annotations

from grace.core.bucket import ITEMSIZE
from grace.core.compressor import Collective


def tensor_ops_of(plan, pending):
    """``TensorOps`` (``SelectionOps``: variable lengths) of a segmented plan whose step
    (``pending``, its first) ran the tensor-op path where they apply; else None. Not where
    grace's native library runs on the bucket's device (every build has its ``pack``): its
    kernels make the phases, and what one lacks runs op by op as before."""
    s, xp = plan.services, pending.xp
    compressor = s.compression.compressor
    if compressor.traits.scheduled or pending.sent_dense or not pending.defer or xp.native("pack", pending.g):
        return None
    return (SelectionOps if plan.variable else TensorOps)(plan, xp, pending.g)


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


class SelectionOps:
    """A segmented plan's variable-length selection and the reading of the ranks' pairs, made
    once per plan (see the module's docstring)."""

    def __init__(self, plan, xp, like):
        s = plan.services
        kernels, memory, table, layout = s.kernels, s.compression.memory, plan.table, plan.own_layout
        guarded, ranks = s.journal.guarded, s.communicator.size
        widths = {ITEMSIZE[d]: d for d in layout.kinds}  # (the index types the frames hold)
        self.ranks, self.seeded = ranks, s.compression.compressor.traits.seeded

        def select(g, e, infos):
            flag = xp.nonfinite([g], plan.flag_dtype()) if guarded else None
            p = memory.compensate(xp, g, e)
            take, counts = kernels.select_segments(xp, p, table, infos)
            e_new = None
            if memory.needs_feedback:  # (p_hat as the pairs' scatter makes it: 0.0 + p where selected)
                zero = xp.zeros_like(p)
                e_new = memory.update(xp, p, zero + xp.where(take, p, zero), e)
            return p, take, counts, layout.header_of(xp, counts, flag), flag, e_new

        def pairs(received, rows, total):
            """Every rank's pairs read where they lie: pair j of row (rank, segment) r, its
            value and its index (of the row's width) at the bytes ``rows`` give (``SparseFrames.
            pair_table``'s columns, each row's first pair counted over all ranks'): the indices
            in the bucket and the values over the ranks, rank after rank."""
            value_at, index_at, firsts, counts, starts, width_at = (rows[c] for c in range(6))
            row = xp.repeat(xp.arange(xp.numel(counts), like=rows), counts, total, starts=firsts)
            k = xp.arange(total, like=rows) - xp.gather(firsts, row)  # (the pair's place in its row)
            values = xp.gather(xp.from_bytes(received, layout.dtype),
                               xp.gather(value_at, row) // ITEMSIZE[layout.dtype] + k)
            width = xp.gather(width_at, row)
            byte = xp.gather(index_at, row) + width * k
            local = None
            for size, dtype in widths.items():  # (each pair's index read from the view of its width)
                read = xp.cast(xp.gather(xp.from_bytes(received, dtype), xp.where(width == size, byte // size, 0)),
                               "int64")
                local = read if local is None else xp.where(width == size, read, local)
            return xp.gather(starts, row) + local, values / ranks

        self.select = xp.fused(select, "grace_select", like)
        self.pairs = xp.fused(pairs, "grace_pairs", like, dynamic=True)
