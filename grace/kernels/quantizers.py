"""The random quantizers' fast paths (TernGrad, QSGD, natural compression): a bucket's payloads
in one native call on a CPU (each gradient's draws from its own rank seed), the ranks' payloads
decoded and summed in one pass, and the segment-wise form: every segment's own draws (one call
for the bucket) and the per-tensor kernels on every segment in one call.
"""
from grace.compressors.natural import Natural
from grace.compressors.qsgd import QSGD
from grace.compressors.terngrad import TernGrad
from grace.core.plans.kernels import MethodKernels, kernels_for
from grace.formats import packed_size


@kernels_for(TernGrad)
class TernGradKernels(MethodKernels):
    segmented = True
    segment_kernel = "terngrad"
    sum_kernel = "terngrad_decompress_sum"
    many_kernel = "terngrad"

    def segment_fields(self, numels, dtype):
        count = len(numels)
        return [([packed_size(n, 2) for n in numels], ["uint8"] * count), ([1] * count, ["float32"] * count)]

    def draws(self, numels):
        return list(numels)


@kernels_for(QSGD)
class QSGDKernels(MethodKernels):
    segmented = True
    segment_kernel = "qsgd"
    sum_kernel = "qsgd_decompress_sum"
    many_kernel = "qsgd"

    def arguments(self):
        return self.compressor.levels, self.compressor.bucket_size

    def segment_fields(self, numels, dtype):
        qsgd, count = self.compressor, len(numels)
        return [([packed_size(n, qsgd.bits) for n in numels], ["uint8"] * count),
                ([qsgd.rows_of(n) for n in numels], ["float32"] * count)]

    def draws(self, numels):
        qsgd = self.compressor
        return [qsgd.rows_of(n) * qsgd.bucket_of(n) for n in numels]  # as compress draws


@kernels_for(Natural)
class NaturalKernels(MethodKernels):
    segmented = True
    segment_kernel = "natural"
    sum_kernel = "natural_decompress_sum"
    many_kernel = "natural"

    def segment_fields(self, numels, dtype):
        count = len(numels)
        return [([packed_size(n, 1) for n in numels], ["uint8"] * count), (list(numels), ["uint8"] * count)]

    def draws(self, numels):
        return list(numels)
