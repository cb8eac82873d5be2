// grace CUDA kernels: the sign family's device code, run by signs.cu and segments.cu (see common.cuh)
#pragma once
#include "common.cuh"

namespace {
// ---- sign family: one warp covers 32 consecutive elements per step (4 packed bytes) ----------
__device__ __forceinline__ void write_ballot(unsigned bal, int64_t base, int64_t n, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if (lane < 4) {
    int64_t byte = base / 8 + lane;
    if (byte * 8 < n) out[byte] = (uint8_t)(bal >> (8 * lane));
  }
}

constexpr int kRedBlocks = 1024;  // fixed grid of the reductions: the order of the sums is fixed

// (grid_for(n, kThreads * 8, kRedBlocks), on either side: the segment kernels size themselves by it)
__host__ __device__ inline int red_grid(int64_t n) {
  const int64_t b = (n + kThreads * 8 - 1) / (kThreads * 8);
  return (int)(b < 1 ? 1 : (b > kRedBlocks ? kRedBlocks : b));
}

// bits (x >= 0) and per-block partial sums: S = 1: |x|; S = 3: count(x >= 0), sum(x >= 0), sum
// (block `block` of a grid of nblocks: partial[s * nblocks + block]); x: a pointer, or any X with
// x[i] (the compensated gradient, made as it is read)
template <int S, class X>
__device__ inline void sign_sums(X x, int64_t n, uint8_t* out, float* partial, int64_t block, int64_t nblocks) {
  __shared__ float smem[32];
  const int lane = threadIdx.x & 31;
  float acc[S];
  for (int s = 0; s < S; ++s) acc[s] = 0.0f;
  BLOCK_WARP_STRIDE(base, n, block, nblocks) {
    int64_t i = base + lane;
    bool p = false;
    if (i < n) {
      float v = x[i];
      p = v >= 0.0f;
      if constexpr (S == 1) {
        acc[0] += fabsf(v);
      } else {
        acc[0] += p ? 1.0f : 0.0f;
        acc[1] += p ? v : 0.0f;
        acc[2] += v;
      }
    }
    write_ballot(__ballot_sync(kFull, p), base, n, out);
  }
  for (int s = 0; s < S; ++s) {
    float t = block_sum(acc[s], smem);
    if (threadIdx.x == 0) partial[s * nblocks + block] = t;
  }
}

// one block: the partials' sums, then the scalars
template <int S>
__device__ inline void sign_final(const float* partial, int nblocks, int64_t n, float* result) {
  __shared__ float smem[32];
  float tot[S];
  for (int s = 0; s < S; ++s) {
    float v = 0.0f;
    for (int j = threadIdx.x; j < nblocks; j += blockDim.x) v += partial[s * nblocks + j];
    tot[s] = block_sum(v, smem);
  }
  if (threadIdx.x == 0) {
    if constexpr (S == 1) {
      result[0] = tot[0] / (float)(n > 1 ? n : 1);
    } else {
      float n_pos = tot[0], sum_pos = tot[1], total = tot[2];
      float rest = (float)n - n_pos;
      result[1] = sum_pos / (n_pos < 1.0f ? 1.0f : n_pos);
      result[0] = (total - sum_pos) / (rest < 1.0f ? 1.0f : rest);
    }
  }
}
}  // namespace
