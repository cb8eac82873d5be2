"""What every index-and-value sparsifier shares: its payload layout and how it decodes.

Payload: (values in the gradient's dtype, indices in the smallest integer type that holds d).
"""
from grace.core.compressor import Collective, Compressor, index_bits, index_dtype, Shape, Traits


class Sparsifier(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(sparse=True, new_payload=True)

    def select(self, xp, flat, info):
        """Indices of the elements of the 1-d ``flat`` to send."""
        raise NotImplementedError

    def kernel_argument(self, numel: int):
        """What the residual kernel selects by (k, or the threshold)."""
        raise NotImplementedError

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

    # --- a bucket at once (segmented methods: a fixed k per segment, or a variable number) --
    def select_segments(self, xp, p, table, infos):
        """A mask of the elements of the flat ``p`` that each segment sends (a variable-length
        method's; a fixed k per segment is each segment's k largest)."""
        raise NotImplementedError
