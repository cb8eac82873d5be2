"""What EF-signSGD and 1-bit SGD share: one bit per element (x >= 0) and a few float32 per
tensor that the bits decode to (EF-signSGD's scale, 1-bit SGD's two means).

On an accelerator a bucket of such tensors is compressed segment by segment in one call
(``Compressor.segmented``; grace.native runs each segment through the per-tensor kernels), so
every gradient keeps its own scale and the results are the per-tensor ones.
"""
from grace.core.compressor import Collective, Compressor
from grace.formats import packed_size


class SignBits(Compressor):
    collective = Collective.ALLGATHER
    segmented = True
    #: float32 values per tensor beside the bits
    scalars: int = 1
    #: the name of the method's native kernels ("<kernel>_compress_segments", ...)
    kernel: str = ""

    def segment_fields(self, numels, dtype):
        count = len(numels)
        return [([packed_size(n, 1) for n in numels], ["uint8"] * count), ([self.scalars] * count, ["float32"] * count)]

    def compress_segments(self, xp, p, table, infos):
        fused = xp.fused(f"{self.kernel}_compress_segments", p, xp.dtype(p))
        if not fused:
            return super().compress_segments(xp, p, table, infos)
        return fused(p, table.starts, table.numels), None, None

    def decompress_segments(self, xp, fields, ctx, table):
        fused = xp.fused(f"{self.kernel}_decompress_segments", fields[0], "float32")
        if not fused:
            return super().decompress_segments(xp, fields, ctx, table)
        return fused(*fields, table.numels)
