"""What every index-and-value sparsifier shares: its payload layout and how it decodes.

Payload: (values in the gradient's dtype, indices in the smallest integer type that holds d).
"""
import numpy as np

from grace.core.compressor import Collective, Compressor, index_bits, index_dtype, native_or_none, Shape, Traits


class Sparsifier(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(sparse=True, new_payload=True)
    #: grace.native's one-pass residual step (compensate, select, new residual), if it has one
    residual_kernel = None
    #: grace.native's residual step for a whole bucket in one call (CPU), if it has one
    residual_kernel_many = None
    #: grace.native's selection with values, if it has one (segmented buckets run
    #: "<kernel>_segments": the per-tensor kernel on each segment; so does the residual step)
    select_kernel = None

    def select(self, xp, flat, info):
        """Indices of the elements of the 1-d ``flat`` to send."""
        raise NotImplementedError

    def kernel_argument(self, numel: int):
        """What the residual kernel selects by (k, or the threshold)."""
        raise NotImplementedError

    def compress_with_residual(self, xp, g, residual, beta, gamma, info, out=None):
        fused = xp.fused(self.residual_kernel, g, xp.dtype(g)) if self.residual_kernel else None
        if not fused:
            return None
        where = {} if out is None else {"out": out}
        values, indices, residual = fused(g, residual, self.kernel_argument(xp.numel(g)), beta, gamma, **where)
        return (values, indices), Shape(xp.shape(g), xp.dtype(g)), xp.reshape(residual, xp.shape(g))

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None):
        if self.residual_kernel_many is None:  # (DGC's selection with residual memory)
            return None
        placed = {} if into is None else {"into": into}  # (fixed-length payloads only)
        done = native_or_none(xp, self.residual_kernel_many, gs[0], gs, residuals,
                              [self.kernel_argument(xp.numel(g)) for g in gs], beta, gamma, outs=outs, nonfinite=flag,
                              **placed)
        if done is None:
            return None
        return [((v, i), Shape(xp.shape(g), xp.dtype(g)), xp.reshape(r, xp.shape(g))) for v, i, r, g in zip(*done, gs)]

    def compress(self, xp, x, info):
        flat = xp.flatten(x)
        indices = self.select(xp, flat, info)
        values = xp.gather(flat, indices)
        return (values, xp.cast(indices, index_dtype(xp.numel(flat)))), Shape(xp.shape(x), xp.dtype(x))

    def ideal_bits(self, xp, payload, ctx):
        return xp.numel(payload[0]) * (32 + index_bits(ctx.numel))

    def decompress(self, xp, payload, ctx):
        values, indices = payload
        return xp.reshape(xp.scatter_add(indices, values, ctx.numel), ctx.shape)

    def aggregate(self, xp, payloads, ctx):
        # Everybody's values, each divided by n first (n k elements, not d), scattered payload
        # after payload instead of n dense decompressions: the same additions in the same
        # order on every rank and run (one scatter of them all would add a GPU's colliding
        # indices in any order, and replicas could drift apart)
        n = len(payloads)
        return xp.reshape(xp.scatter_add_rows([p[1] for p in payloads], [p[0] / n for p in payloads], ctx.numel),
                          ctx.shape)

    def aggregate_many(self, xp, payloads, ctxs, outs):
        # each rank's values divided by n, added payload after payload: as aggregate
        return native_or_none(xp, "scatter_add_segments_into", outs[0],
                              [[(p[0], p[1]) for p in rows] for rows in payloads], outs, len(payloads[0]))

    # --- a bucket at once (segmented methods: a fixed k per segment, or a variable number) --
    def segment_fields(self, numels, dtype):
        k = [self.kernel_argument(d) for d in numels]
        return [(k, [dtype] * len(k)), (k, [index_dtype(d) for d in numels])]

    def select_segments(self, xp, p, table, infos):
        """A mask of the elements of the flat ``p`` that each segment sends (a variable-length
        method's: that it may send, ``cut_segments`` then keeping some of them)."""
        raise NotImplementedError

    def cut_segments(self, xp, p, table, indices, counts, infos):
        """A variable-length selection cut once its counts are known: (indices, counts) as
        ``_selected_segments`` has them; here kept as they are."""
        return indices, counts

    def _ks(self, table):
        return table.cached("k", lambda: [self.kernel_argument(d) for d in table.numels])

    def _sent_starts(self, xp, table, like):
        """Each sent element's segment start (k_i of each segment, in order)."""
        return table.cached("sent starts", lambda: xp.asarray(np.repeat(table.starts, self._ks(table)), like=like))

    def compress_segments(self, xp, p, table, infos):
        if self.traits.variable_length:
            return self._selected_segments(xp, p, table, infos)
        fused = xp.fused(f"{self.select_kernel}_segments", p, xp.dtype(p)) if self.select_kernel else None
        if fused:  # the per-tensor kernel on each segment
            return fused(p, table.starts, table.numels, self._ks(table)), None, None
        take = self.select_segments(xp, p, table, infos)
        starts = self._sent_starts(xp, table, p)
        indices = xp.nonzero(take, size=xp.numel(starts))  # ascending: k_i per segment, in order
        return (xp.gather(p, indices), indices - starts), None, xp.where(take, p, 0.0)

    def _selected_segments(self, xp, p, table, infos):
        """A variable-length selection of every segment (``select_segments``, then
        ``cut_segments``): ((values, indices within their segment), (each segment's count as
        host ints, and as a tensor: the frame's header), p_hat as ``decompress`` makes it).
        Its only wait for the device is the counts."""
        take = self.select_segments(xp, p, table, infos)
        running = xp.cumsum(xp.cast(take, "int64"))
        last = table.cached("last elements", lambda: xp.asarray(  # (buckets hold no empty gradients)
            np.asarray(table.starts, np.int64) + np.asarray(table.numels, np.int64) - 1, like=p))
        at_last = xp.gather(running, last)  # selected up to each segment's end
        counts = at_last - xp.concat([xp.zeros(1, "int64", like=p), at_last[:-1]])
        host = xp.host_ints(counts, len(table.numels))
        indices = xp.nonzero(take, size=sum(host))  # ascending: each segment's in a row
        indices, (host, counts) = self.cut_segments(xp, p, table, indices, (host, counts), infos)
        values = xp.gather(p, indices)
        local = indices - xp.repeat(table.start, counts, sum(host))
        return (values, local), (host, counts), xp.scatter_add(indices, values, table.numel)

    def compress_segments_with_residual(self, xp, g, residual, beta, gamma, table, infos):
        if self.traits.variable_length:  # (selected by tensor ops: _selected_segments)
            return None
        fused = xp.fused(f"{self.residual_kernel}_segments", g, xp.dtype(g)) if self.residual_kernel else None
        if not fused:
            return None
        values, local, residual = fused(g, residual, table.starts, table.numels, self._ks(table), beta, gamma)
        return (values, local), None, residual

    def decompress_segments(self, xp, fields, ctx, table):
        values, local = fields
        return xp.scatter_add(local + self._sent_starts(xp, table, values), values, table.numel)

    def aggregate_segments(self, xp, fields, ctx, table, ranks):
        values, local = fields
        starts = self._sent_starts(xp, table, values)
        rows = range(ranks)  # payload after payload, as aggregate adds them
        return xp.scatter_add_rows([local[r] + starts for r in rows], [values[r] / ranks for r in rows], table.numel)
