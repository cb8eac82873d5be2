"""What EF-signSGD and 1-bit SGD share: one bit per element (x >= 0) and a few float32 per
tensor that the bits decode to (EF-signSGD's scale, 1-bit SGD's two means).

On an accelerator a bucket of such tensors is compressed segment by segment in one call
(``MethodKernels.segmented``; grace.native runs each segment through the per-tensor kernels), so
every gradient keeps its own scale and the results are the per-tensor ones.
"""
from grace.core.compressor import Collective, Compressor, Traits


class SignBits(Compressor):
    collective = Collective.ALLGATHER
    traits = Traits(new_payload=True)
    #: float32 values per tensor beside the bits
    scalars: int = 1
