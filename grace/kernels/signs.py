"""The sign family's fast paths: a bucket's payloads (signSGD) or residual steps (EF-signSGD,
1-bit SGD) in one native call on a CPU, the ranks' bits decoded and summed in one pass, the
residual written without a dense decompression (or its subtraction deferred to the next step's
pass: ``SignResidual``), and the segment-wise form (the per-tensor kernels on every segment in one
call; without them, the formula on the whole bucket).
"""
from dataclasses import dataclass
from typing import Any

from grace.compressors.efsignsgd import EFSignSGD
from grace.compressors.onebit import OneBit
from grace.compressors.sign_bits import SignBits
from grace.compressors.signsgd import SignSGD
from grace.core import segment_packing
from grace.core.buffers import shapes_of
from grace.core.compressor import Shape, native_or_none
from grace.core.memory import Deferred, buffer_of, stored
from grace.core.plans.kernels import MethodKernels, kernels_for
from grace.core.tensors import backend_for
from grace.formats import packed_size


@kernels_for(SignSGD)
class SignSGDKernels(MethodKernels):
    sum_kernel = "signsgd_decompress_sum"
    mean_kernel = "signsgd_mean_segments"
    many_kernel = "signsgd"


@kernels_for(SignBits)
class SignBitsKernels(MethodKernels):
    segmented = True
    flags_in_segment_steps = True
    defers_residual = True

    def residual_into(self, xp, p, payload, ctx, out):
        return native_or_none(xp, f"{self.segment_kernel}_residual_into", p, p, payload[0], payload[1], out)

    def compress_many_with_residual(self, xp, gs, residuals, beta, gamma, infos, outs, flag=None, into=None,
                                    defer=False):
        """Residual memory's step for every gradient of a bucket in one native call (CPU): each
        gradient compensated into its spare, compressed and its new memory written over it; or,
        ``defer``, left there as p in a SignResidual (the next call's pass subtracts the payload,
        a pass over the gradients fewer a step)."""
        codes = deferred_codes(residuals)
        residuals = [buffer_of(e) if codes is not None else stored(e) for e in residuals]
        done = native_or_none(xp, f"{self.segment_kernel}_ef_step_many", gs[0], gs, residuals, beta, gamma, outs,
                              nonfinite=flag, into=into, deferred=codes, keep=defer)
        if done is None:
            return None
        payloads, news, *kept = done
        if defer:
            news = [SignResidual(out, kept[0], i, self.compressor) for i, out in enumerate(news)]
        return [(payload, shape, e if defer else xp.reshape(e, shape.shape))
                for payload, e, shape in zip(payloads, news, shapes_of(xp, gs))]

    def compress_segments_with_residual(self, xp, g, residual, beta, gamma, table, infos, nonfinite=None,
                                        into=None):
        fused = xp.native(f"{self.segment_kernel}_ef_step_segments", g, xp.dtype(g))
        if not fused:
            return None
        packed, scalars, new_residual = fused(g, residual, table.starts, table.numels, beta, gamma,
                                              nonfinite=nonfinite)
        return [packed, scalars], None, new_residual

    def segment_fields(self, numels, dtype):
        count = len(numels)
        return [([packed_size(n, 1) for n in numels], ["uint8"] * count),
                ([self.compressor.scalars] * count, ["float32"] * count)]

    def encode_segments(self, xp, p, table, infos, signs=None):
        signs = p >= 0 if signs is None else signs
        return [segment_packing.pack(xp, signs, 1, table), self.compressor.scalars_of(xp, p, table)]

    def compress_segments(self, xp, p, table, infos):
        if self._segment_decoder(xp, p):  # (its kernels compress, and decode where the memory needs it)
            return super().compress_segments(xp, p, table, infos)
        # without the kernels, p_hat from the signs themselves, not from the bits unpacked again
        signs = p >= 0
        fields = self.encode_segments(xp, p, table, infos, signs)
        return fields, None, self.compressor.values(xp, signs, fields[1], table)

    def decode_segments(self, xp, fields, table):
        packed, scalars = fields
        return self.compressor.values(xp, segment_packing.unpack(xp, packed, 1, table), scalars, table)


@kernels_for(EFSignSGD)
class EFSignSGDKernels(SignBitsKernels):
    segment_kernel = "efsignsgd"
    sum_kernel = "efsignsgd_decompress_sum"


@kernels_for(OneBit)
class OneBitKernels(SignBitsKernels):
    segment_kernel = "onebit"
    sum_kernel = "onebit_decompress_sum"


@dataclass(frozen=True)
class SignResidual(Deferred):
    """EF-signSGD's or 1-bit SGD's residual e = p - decode(payload), kept as p (``buffer``, the
    gradient's spare) and its payload's bits and scalars (``codes``, the SignCodes of the bucket
    call that made it, gradient ``index`` of it): the next call subtracts them in its pass."""

    buffer: Any
    codes: Any
    index: int
    compressor: Any

    def value(self):
        xp = backend_for(self.buffer)
        p_hat = self.compressor.decompress(xp, self.codes.payload(self.index),
                                           Shape(xp.shape(self.buffer), xp.dtype(self.buffer)))
        return self.buffer - p_hat


def deferred_codes(residuals):
    """The SignCodes that a bucket's residuals defer to, where each is the SignResidual of one
    call's gradient in turn; else None (their values are then made)."""
    codes = getattr(residuals[0], "codes", None) if residuals else None
    if codes is None or len(codes.numels) != len(residuals):
        return None
    if any(type(e) is not SignResidual or e.codes is not codes or e.index != i for i, e in enumerate(residuals)):
        return None
    return codes
