"""What every index-and-value sparsifier shares: its payload layout and how it decodes.

Payload: (values in the gradient's dtype, indices in the smallest integer type that holds d).
"""
from grace.core.compressor import Collective, Compressor, Shape, index_bits, index_dtype


class Sparsifier(Compressor):
    collective = Collective.ALLGATHER
    #: grace.native's one-pass residual step (compensate, select, new residual), if it has one
    residual_kernel = None

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
        # One scatter of everybody's values, each divided by n first (n k elements, not d),
        # instead of n dense decompressions.
        values = xp.concat([p[0] for p in payloads]) / len(payloads)
        indices = xp.concat([xp.cast(p[1], "int64") for p in payloads])
        return xp.reshape(xp.scatter_add(indices, values, ctx.numel), ctx.shape)
