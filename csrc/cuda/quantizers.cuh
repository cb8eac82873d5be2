// grace CUDA kernels: max |x|, TernGrad, QSGD and natural compression, the device code run by
// quantizers.cu and segments.cu (see common.cuh)
#pragma once
#include "common.cuh"

namespace {
// ---- max |x| (NaN wins, as np.max) ------------------------------------------------------------
__device__ inline void maxabs(const float* x, int64_t n, unsigned* out, int64_t block, int64_t nblocks) {
  __shared__ unsigned smem[32];
  unsigned m = 0;
  BLOCK_STRIDE(i, n, block, nblocks) {
    unsigned u = __float_as_uint(x[i]) & 0x7fffffffu;  // NaN > inf > finite as unsigned
    m = max(m, u);
  }
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_down_sync(kFull, m, o));
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) b = max(b, smem[w]);
    atomicMax(out, b);
  }
}

// ---- terngrad, QSGD, natural: one thread per group of 8 elements ------------------------------
// (u: the uniform draws, a pointer or any U with u[i]: counter-based draws made where they are used)
template <class U>
__device__ inline void terngrad(const float* x, U u, int64_t n, const float* scale, uint8_t* out,
                                int64_t block, int64_t nblocks) {
  const float s = scale[0];
  const float safe = s > 0.0f ? s : s + 1.0f;
  const int64_t groups = (n + 7) / 8;
  BLOCK_STRIDE(g, groups, block, nblocks) {
    int64_t i0 = 8 * g;
    int cnt = (int)(n - i0 < 8 ? n - i0 : 8);
    uint32_t w = 0;
    for (int j = 0; j < cnt; ++j) {
      float v = x[i0 + j];
      bool keep = u[i0 + j] < __fdiv_rn(fabsf(v), safe);
      w |= (uint32_t)(keep ? (v < 0.0f ? 2 : 1) : 0) << (2 * j);
    }
    out[2 * g] = (uint8_t)w;
    if (cnt > 4) out[2 * g + 1] = (uint8_t)(w >> 8);
  }
}

__device__ __forceinline__ uint8_t qsgd_code(float v, float u, float safe, float flevels) {
  float r = __fdiv_rn(__fmul_rn(fabsf(v), flevels), safe);
  float low = floorf(r);
  float level = __fadd_rn(low, u < __fsub_rn(r, low) ? 1.0f : 0.0f);
  level = __fsub_rn(level, level > flevels ? 1.0f : 0.0f);
  float c = __fadd_rn(__fmul_rn(level, 2.0f), v < 0.0f ? 1.0f : 0.0f);
  return c == c ? (uint8_t)(int)c : (uint8_t)0;
}

template <class U>
__device__ inline void qsgd(const float* x, U u, int64_t n, float flevels, int64_t b, int bits,
                            const float* norms, uint8_t* out, int64_t block, int64_t nblocks) {
  const int64_t groups = (n + 7) / 8;
  BLOCK_STRIDE(g, groups, block, nblocks) {
    int64_t i0 = 8 * g;
    int cnt = (int)(n - i0 < 8 ? n - i0 : 8);
    uint64_t w = 0;
    for (int j = 0; j < cnt; ++j) {
      int64_t i = i0 + j;
      float norm = norms[i / b];
      float safe = norm > 0.0f ? norm : norm + 1.0f;
      w |= (uint64_t)qsgd_code(x[i], u[i], safe, flevels) << (bits * j);
    }
    int nb = cnt == 8 ? bits : (cnt * bits + 7) / 8;
    for (int k = 0; k < nb; ++k) out[g * bits + k] = (uint8_t)(w >> (8 * k));
  }
}

// norms of short buckets (b <= 4096): one warp each
__device__ inline void norms_warp(const float* x, int64_t n, int64_t b, int64_t rows, float* norms, int64_t block,
                                  int64_t nblocks) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (block * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (nblocks * blockDim.x) >> 5;
  for (int64_t r = warp; r < rows; r += nwarps) {
    int64_t start = r * b, end = start + b < n ? start + b : n;
    float acc = 0.0f;
    for (int64_t i = start + lane; i < end; i += 32) acc = __fadd_rn(acc, __fmul_rn(x[i], x[i]));
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(kFull, acc, o);
    if (lane == 0) norms[r] = sqrtf(acc);
  }
}

// long buckets: block (r, c) sums chunk c of bucket r; then one block per bucket
// (block v of rows * cpr: partial[v])
__device__ inline void norms_partial(const float* x, int64_t n, int64_t b, int64_t cpr, float* partial, int64_t v) {
  __shared__ float smem[32];
  const int64_t r = v / cpr, c = v % cpr;
  const int64_t start = r * b + c * kSegChunk;
  int64_t end = start + kSegChunk;
  if (end > r * b + b) end = r * b + b;
  if (end > n) end = n;
  float acc = 0.0f;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(x[i], x[i]));
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) partial[v] = acc;
}

// row r's norm from its cpr partials
__device__ inline void norms_final(const float* partial, int64_t cpr, float* norms, int64_t r) {
  __shared__ float smem[32];
  float acc = 0.0f;
  for (int64_t j = threadIdx.x; j < cpr; j += blockDim.x) acc += partial[r * cpr + j];
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) norms[r] = sqrtf(acc);
}

__device__ __forceinline__ uint8_t natural_code(float v, float u) {
  uint32_t bits = __float_as_uint(v);
  uint32_t e = (bits >> 23) & 0xff;
  if (e >= 254) return 254;
  float frac = (float)(bits & 0x7fffff) * 0x1p-23f;
  return (uint8_t)(e + (u < frac ? 1 : 0));
}

template <class U>
__device__ inline void natural(const float* x, U u, int64_t n, uint8_t* signs, uint8_t* codes, int64_t block,
                               int64_t nblocks) {
  const int64_t groups = (n + 7) / 8;
  BLOCK_STRIDE(g, groups, block, nblocks) {
    int64_t i0 = 8 * g;
    int cnt = (int)(n - i0 < 8 ? n - i0 : 8);
    uint32_t m = 0;
    for (int j = 0; j < cnt; ++j) {
      float v = x[i0 + j];
      m |= (uint32_t)(v < 0.0f) << j;
      codes[i0 + j] = natural_code(v, u[i0 + j]);
    }
    signs[g] = (uint8_t)m;
  }
}
}  // namespace
