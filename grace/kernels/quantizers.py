"""The random quantizers' fast paths (TernGrad, QSGD, natural compression): a bucket's payloads
in one native call on a CPU (each gradient's draws from its own rank seed), the ranks' payloads
decoded and summed in one pass, and the segment-wise form: every segment's own draws (one call
for the bucket) and the per-tensor kernels on every segment in one call; without them, each
method's formula on the whole bucket (each segment packed apart).
"""
from grace.compressors.natural import Natural
from grace.compressors.qsgd import QSGD
from grace.compressors.terngrad import TernGrad
from grace.core import segment_packing, segments
from grace.core.compressor import uniform_draws
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

    def encode_segments(self, xp, p, table, infos):
        terngrad, magnitude = self.compressor, xp.abs(p)
        scales = xp.segment_max(magnitude, table.counts)
        u = uniform_draws(xp, table.numels, infos, terngrad.seed, p)
        codes = terngrad.codes(xp, p, magnitude, u, table.per_element(xp, terngrad.safe(xp, scales)))
        return [segment_packing.pack(xp, codes, 2, table), scales]

    def decode_segments(self, xp, fields, table):
        packed, scales = fields
        return self.compressor.values(xp, segment_packing.unpack(xp, packed, 2, table), table.per_element(xp, scales))


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

    def _rows(self, xp, table):
        """Every segment's rows (QSGD's buckets) in a row, a last one as long as it is and as
        padded to a whole bucket; and each segment's bucket."""
        def make():
            qsgd, buckets = self.compressor, [self.compressor.bucket_of(d) for d in table.numels]
            whole = [b for d, b in zip(table.numels, buckets) for _ in range(qsgd.rows_of(d))]
            short = [n for d, b in zip(table.numels, buckets) for n in segments.row_lengths(d, b)]
            return (segments.SegmentTable.build(xp, short, table.counts),
                    segments.SegmentTable.build(xp, whole, table.counts), buckets)
        return table.cached("qsgd rows", make)

    def encode_segments(self, xp, p, table, infos):
        qsgd, (rows, whole_rows, buckets) = self.compressor, self._rows(xp, table)
        norms = qsgd.norms(xp, segment_packing.padded(xp, p * p, table, 1, buckets), whole_rows)
        drawn = uniform_draws(xp, self.draws(table.numels), infos, qsgd.seed, p)
        u = segment_packing.unpadded(xp, drawn, table, 1, buckets)  # (the padding drew too)
        return [segment_packing.pack(xp, qsgd.codes(xp, p, u, norms, rows), qsgd.bits, table), norms]

    def decode_segments(self, xp, fields, table):
        packed, norms = fields
        rows = self._rows(xp, table)[0]
        return self.compressor.values(xp, segment_packing.unpack(xp, packed, self.compressor.bits, table),
                                      rows.per_element(xp, norms))


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

    def encode_segments(self, xp, p, table, infos):
        u = uniform_draws(xp, table.numels, infos, self.compressor.seed, p)
        negative, codes = self.compressor.codes(xp, p, u)
        return [segment_packing.pack(xp, negative, 1, table), codes]

    def decode_segments(self, xp, fields, table):
        negative, codes = fields
        return self.compressor.values(xp, segment_packing.unpack(xp, negative, 1, table), codes)
