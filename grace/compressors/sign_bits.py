"""What EF-signSGD and 1-bit SGD share: one bit per element (x >= 0) and a few float32 per
tensor that the bits decode to (EF-signSGD's scale, 1-bit SGD's two means).

On an accelerator a bucket of such tensors is compressed segment by segment in one call
(``Compressor.segmented``; grace.native runs each segment through the per-tensor kernels), so
every gradient keeps its own scale and the results are the per-tensor ones.
"""
from grace.core.compressor import Collective, Compressor, native_or_none, Shape, Traits
from grace.formats import packed_size


class SignBits(Compressor):
    collective = Collective.ALLGATHER
    segmented = True
    traits = Traits(new_payload=True)
    #: float32 values per tensor beside the bits
    scalars: int = 1

    def residual_into(self, xp, p, payload, ctx, out):
        return native_or_none(xp, f"{self.segment_kernel}_residual_into", p, p, payload[0], payload[1], out)

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None):
        """Residual memory's step for every gradient of a bucket in one native call (CPU): each
        gradient compensated into its spare, compressed and its new memory written over it."""
        done = native_or_none(xp, f"{self.segment_kernel}_ef_step_many", gs[0], gs, residuals, beta, gamma, outs,
                              nonfinite=flag, into=into)
        if done is None:
            return None
        payloads, news = done
        return [(payload, Shape(xp.shape(g), xp.dtype(g)), xp.reshape(e, xp.shape(g)))
                for payload, e, g in zip(payloads, news, gs)]

    def segment_fields(self, numels, dtype):
        count = len(numels)
        return [([packed_size(n, 1) for n in numels], ["uint8"] * count), ([self.scalars] * count, ["float32"] * count)]
