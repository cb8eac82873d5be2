// grace CUDA kernels: the same operations as the CPU kernels (csrc/cpu/) on device pointers; this
// header, what every family's file shares: launch helpers, scratch memory, index access, block
// sums. The device code of a family, which its own file's kernels and segments.cu's run alike, is
// in its header: signs.cuh, quantizers.cuh (max |x|, TernGrad, QSGD, natural compression),
// decoders.cuh, select.cuh. The files: runtime.cu (the library's own calls), packing.cu, signs.cu,
// quantizers.cu, decoders.cu, selection.cu, scatter.cu, segments.cu (a bucket's segments in one
// launch per kernel). build.py compiles them without relocatable device code: what several files
// use is defined in these headers (an unnamed namespace: each file its own copy), what must exist
// once (the memory pool's setting) in one file, declared here.
//
// Every function takes the caller's stream (torch.cuda.current_stream().cuda_stream, or 0) and
// launches asynchronously on it; temporaries come from the stream-ordered allocator
// (cudaMallocAsync). Only the variable-length selections (threshold, nonzero) wait, for the
// count they return. Nothing goes through host memory. Packed formats, codes and decodings
// are those of the CPU kernels; reductions (norms, means, L1 scale) are deterministic but
// sum in a GPU order, so they may differ from the CPU's in the last bit.
#pragma once
#include "grace_native.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#define API extern "C" __attribute__((visibility("default")))

namespace grace_cuda {
// (runtime.cu) up to 64 MiB kept in the device's default memory pool, set once per device
void keep_pool_memory();
}  // namespace grace_cuda
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

inline cudaStream_t as_stream(void* s) { return reinterpret_cast<cudaStream_t>(s); }

inline int grid_for(int64_t work, int per_block = kThreads, int cap = 1 << 16) {
  int64_t b = (work + per_block - 1) / per_block;
  return (int)std::max<int64_t>(1, std::min<int64_t>(b, cap));
}

inline int status() { return cudaGetLastError() == cudaSuccess ? 0 : -2; }

#define GRID_STRIDE(i, n) BLOCK_STRIDE(i, n, blockIdx.x, gridDim.x)
// the same over a virtual grid of nblocks blocks (a segment's share of a bucket's launch)
#define BLOCK_STRIDE(i, n, block, nblocks)                                                  \
  for (int64_t i = (block) * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)(nblocks) * blockDim.x)

#define WARP_STRIDE(base, n) BLOCK_WARP_STRIDE(base, n, blockIdx.x, gridDim.x)
#define BLOCK_WARP_STRIDE(base, n, block, nblocks)                                       \
  const int64_t warp_ = ((block) * (int64_t)blockDim.x + threadIdx.x) >> 5;              \
  const int64_t nwarps_ = ((int64_t)(nblocks) * blockDim.x) >> 5;                        \
  for (int64_t base = warp_ * 32; base < (n); base += nwarps_ * 32)

using grace_cuda::keep_pool_memory;

// A stream-ordered scratch allocation, freed on the same stream.
struct Scratch {
  void* p = nullptr;
  cudaStream_t s;
  Scratch(size_t bytes, cudaStream_t stream) : s(stream) {
    keep_pool_memory();
    if (cudaMallocAsync(&p, std::max<size_t>(bytes, 16), s) != cudaSuccess) p = nullptr;
  }
  ~Scratch() {
    if (p) cudaFreeAsync(p, s);
  }
  template <class T>
  T* at(size_t byte_offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(p) + byte_offset);
  }
};

inline size_t align256(size_t b) { return (b + 255) & ~size_t(255); }

// A rank's pairs in its frame, by segment (a row of GRACE_PAIR_COLUMNS each, grace_native.h): the
// row of its pair j, the last whose first pair is <= j (an empty segment's row is never the last).
__device__ __forceinline__ const int64_t* pair_row(const int64_t* rows, int64_t segments, int64_t j) {
  int64_t lo = 0, hi = segments;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (rows[mid * GRACE_PAIR_COLUMNS + 2] <= j) lo = mid; else hi = mid;
  }
  return rows + lo * GRACE_PAIR_COLUMNS;
}

// the overflow flag: 1 where `set`, else 0, a float32 or (width 1) a byte
__device__ __forceinline__ void write_flag(void* flag, int width, bool set) {
  if (width == 1) *static_cast<uint8_t*>(flag) = set ? 1 : 0;
  else *static_cast<float*>(flag) = set ? 1.0f : 0.0f;
}

__device__ __forceinline__ void put_index(void* idx, int t, int64_t pos, int64_t i) {
  switch (t) {
    case GRACE_U8: static_cast<uint8_t*>(idx)[pos] = (uint8_t)i; break;
    case GRACE_I16: static_cast<int16_t*>(idx)[pos] = (int16_t)i; break;
    case GRACE_I32: static_cast<int32_t*>(idx)[pos] = (int32_t)i; break;
    default: static_cast<int64_t*>(idx)[pos] = (int64_t)i; break;
  }
}

__device__ __forceinline__ int64_t get_index(const void* idx, int t, int64_t j) {
  switch (t) {
    case GRACE_U8: return static_cast<const uint8_t*>(idx)[j];
    case GRACE_I16: return static_cast<const int16_t*>(idx)[j];
    case GRACE_I32: return static_cast<const int32_t*>(idx)[j];
    default: return static_cast<const int64_t*>(idx)[j];
  }
}

// Sum over the block, in a fixed order (valid in thread 0). blockDim.x is a multiple of 32.
template <class T>
__device__ inline T block_sum(T v, T* smem) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFull, v, o);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) smem[w] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = threadIdx.x < nw ? smem[threadIdx.x] : T(0);
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFull, v, o);
  __syncthreads();
  return v;
}

// Residual memory's compensation read element by element: p[i] = g[i] * gamma + r[i] * beta, each
// factor applied only where flags says (1: gamma, 2: beta), as ResidualMemory.compensate
struct Compensated {
  const float* g;
  const float* r;
  float beta, gamma;
  int flags;
  __device__ __forceinline__ float operator[](int64_t i) const {
    const float a = (flags & 1) ? __fmul_rn(g[i], gamma) : g[i];
    if (flags & 4) return a;  // no residual: p is g itself (-0.0 kept)
    return __fadd_rn(a, (flags & 2) ? __fmul_rn(r[i], beta) : r[i]);
  }
};

constexpr int64_t kSegChunk = kThreads * 16;

// QSGD's rows: `bucket` elements each, or the whole tensor (bucket 0, or one past its end);
// their count; and the chunks of a row longer than 4096 (summed apart, then per row)
__host__ __device__ inline int64_t qsgd_row(int64_t n, int64_t bucket) {
  return bucket > 0 && bucket < n ? bucket : (n > 1 ? n : 1);
}
__host__ __device__ inline int64_t qsgd_rows(int64_t n, int64_t b) { return (n + b - 1) / b; }
__host__ __device__ inline int64_t row_chunks(int64_t b) { return (b + kSegChunk - 1) / kSegChunk; }
}  // namespace
