"""fp16's fast paths on a CPU: a bucket's payloads written in one native call into one buffer
that the exchange keeps and sends as it is, and the summed halves decoded and averaged in one.
"""
from grace.compressors.fp16 import FP16
from grace.core.buffers import Pieces, column, shapes_of
from grace.core.compressor import native_or_none
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(FP16)
class FP16Kernels(MethodKernels):
    def compress_many_into(self, xp, gs, infos, pieces, step_bytes=0):
        dtype = self.compressor.dtype
        if dtype != "float16" or not xp.native("fp16_compress_many_into", gs[0], xp.dtype(gs[0])):
            return None
        views = pieces(dtype, [xp.numel(g) for g in gs])
        n = infos[0].world_size
        # (the step's halves: float32 gradients, two bytes of payload for four)
        if native_or_none(xp, "fp16_compress_many_into", gs[0], gs, n, views, step_bytes // 2) is None:
            return None
        # the payloads kept with the views (their column 0, the views again, keeps its native buffers)
        payloads = views.derived.get("payloads")
        if payloads is None:
            payloads = views.derived["payloads"] = Pieces([(view,) for view in views])
        return payloads, [(shape, n) for shape in shapes_of(xp, gs)]

    def averaged_many(self, xp, summed, ctxs, n, outs):
        factors = {factor for _, factor in ctxs}
        if len(factors) != 1:
            return None
        return native_or_none(xp, "fp16_decompress_many_into", outs[0], column(summed, 0), factors.pop(), n, outs)
