// grace CUDA kernels: the decoders' device code, run by decoders.cu and segments.cu (see common.cuh)
#pragma once
#include "common.cuh"

namespace {
// ---- decoders ---------------------------------------------------------------------------------
// Decoders: block `block` of a grid of nblocks (the per-tensor kernels: the launch's own grid)
__device__ inline void sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                                   int64_t nblocks) {
  const float s = scale ? scale[0] : 1.0f;
  const float lo = __fmul_rn(-1.0f, s), hi = __fmul_rn(1.0f, s);
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = (packed[i >> 3] >> (i & 7)) & 1 ? hi : lo;
}

__device__ inline void onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out, int64_t block,
                                     int64_t nblocks) {
  const float mu0 = means[0], mu1 = means[1];
  const float d = __fsub_rn(mu1, mu0);
  const float v0 = __fadd_rn(mu0, __fmul_rn(0.0f, d)), v1 = __fadd_rn(mu0, __fmul_rn(1.0f, d));
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = (packed[i >> 3] >> (i & 7)) & 1 ? v1 : v0;
}

__device__ inline void terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                                       int64_t nblocks) {
  const float s = scale[0];
  const float z = __fmul_rn(0.0f, s), p = __fmul_rn(1.0f, s), m = __fmul_rn(-1.0f, s);
  BLOCK_STRIDE(i, n, block, nblocks) {
    int c = (packed[i >> 2] >> (2 * (i & 3))) & 3;
    out[i] = c == 0 ? z : (c == 1 ? p : m);
  }
}

__device__ inline void qsgd_decode(const uint8_t* packed, int64_t n, float flevels, int64_t b, int bits,
                                   const float* norms, float* out, int64_t block, int64_t nblocks) {
  const uint32_t mask = (1u << bits) - 1;
  BLOCK_STRIDE(i, n, block, nblocks) {
    int64_t bit = i * bits;
    uint32_t w = packed[bit >> 3];
    if ((bit & 7) + bits > 8) w |= (uint32_t)packed[(bit >> 3) + 1] << 8;
    float c = (float)((w >> (bit & 7)) & mask);
    float level = floorf(__fdiv_rn(c, 2.0f));
    float sign = __fsub_rn(1.0f, __fmul_rn(2.0f, __fsub_rn(c, __fmul_rn(2.0f, level))));
    float v = __fdiv_rn(__fmul_rn(sign, level), flevels);
    out[i] = __fmul_rn(v, norms[i / b]);
  }
}

__device__ inline void natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out, int64_t block,
                                      int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) {
    float mag = __uint_as_float((uint32_t)codes[i] << 23);
    float sign = (signs[i >> 3] >> (i & 7)) & 1 ? -1.0f : 1.0f;
    out[i] = __fmul_rn(sign, mag);
  }
}
}  // namespace
