// grace CUDA kernels: the decoders' device code, run by decoders.cu and segments.cu (see common.cuh)
#pragma once
#include "common.cuh"

namespace {
// ---- decoders ---------------------------------------------------------------------------------
// Element i's decoded value, from its segment's fields (the decoders below write them all; a
// decoded sum adds them rank after rank)
__device__ __forceinline__ float sign_value(const uint8_t* packed, const float* scale, int64_t i) {
  const float s = scale ? scale[0] : 1.0f;
  return (packed[i >> 3] >> (i & 7)) & 1 ? __fmul_rn(1.0f, s) : __fmul_rn(-1.0f, s);
}

__device__ __forceinline__ float onebit_value(const uint8_t* packed, const float* means, int64_t i) {
  const float mu0 = means[0], d = __fsub_rn(means[1], mu0);
  return __fadd_rn(mu0, __fmul_rn((packed[i >> 3] >> (i & 7)) & 1 ? 1.0f : 0.0f, d));
}

__device__ __forceinline__ float terngrad_value(const uint8_t* packed, const float* scale, int64_t i) {
  const int c = (packed[i >> 2] >> (2 * (i & 3))) & 3;  // 0, +s, -s (3 as 2)
  return __fmul_rn(c == 0 ? 0.0f : (c == 1 ? 1.0f : -1.0f), scale[0]);
}

// b: the row length (elements per norm)
__device__ __forceinline__ float qsgd_value(const uint8_t* packed, float flevels, int64_t b, int bits,
                                            const float* norms, int64_t i) {
  const uint32_t mask = (1u << bits) - 1;
  const int64_t bit = i * bits;
  uint32_t w = packed[bit >> 3];
  if ((bit & 7) + bits > 8) w |= (uint32_t)packed[(bit >> 3) + 1] << 8;
  const float c = (float)((w >> (bit & 7)) & mask);
  const float level = floorf(__fdiv_rn(c, 2.0f));
  const float sign = __fsub_rn(1.0f, __fmul_rn(2.0f, __fsub_rn(c, __fmul_rn(2.0f, level))));
  return __fmul_rn(__fdiv_rn(__fmul_rn(sign, level), flevels), norms[i / b]);
}

__device__ __forceinline__ float natural_value(const uint8_t* signs, const uint8_t* codes, int64_t i) {
  const float mag = __uint_as_float((uint32_t)codes[i] << 23);
  return __fmul_rn((signs[i >> 3] >> (i & 7)) & 1 ? -1.0f : 1.0f, mag);
}

// Decoders: block `block` of a grid of nblocks (the per-tensor kernels: the launch's own grid)
__device__ inline void sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                                   int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = sign_value(packed, scale, i);
}

__device__ inline void onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out, int64_t block,
                                     int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = onebit_value(packed, means, i);
}

__device__ inline void terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                                       int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = terngrad_value(packed, scale, i);
}

__device__ inline void qsgd_decode(const uint8_t* packed, int64_t n, float flevels, int64_t b, int bits,
                                   const float* norms, float* out, int64_t block, int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = qsgd_value(packed, flevels, b, bits, norms, i);
}

__device__ inline void natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out, int64_t block,
                                      int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = natural_value(signs, codes, i);
}
}  // namespace
