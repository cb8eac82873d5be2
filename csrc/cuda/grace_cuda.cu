// grace CUDA kernels: the same operations as csrc/cpu/grace_cpu.cpp on device pointers.
//
// Every function takes the caller's stream (torch.cuda.current_stream().cuda_stream, or 0) and
// launches asynchronously on it; temporaries come from the stream-ordered allocator
// (cudaMallocAsync). Only the variable-length selections (threshold, nonzero) wait, for the
// count they return. Nothing goes through host memory. Packed formats, codes and decodings
// are those of the CPU kernels; reductions (norms, means, L1 scale) are deterministic but
// sum in a GPU order, so they may differ from the CPU's in the last bit.
#include "grace_native.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#define API extern "C" __attribute__((visibility("default")))

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

// The default pool returns freed memory to the driver at every synchronization (release
// threshold 0), so each call's scratch would be mapped again: tens of microseconds per call.
// Keep up to 64 MiB in it instead (once per device).
void keep_pool_memory() {
  static std::atomic<unsigned long long> done{0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return;
  if (done.load(std::memory_order_relaxed) >> dev & 1) return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
    uint64_t current = 0, keep = 64ull << 20;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &current);
    if (current < keep) cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  done.fetch_or(1ull << dev);
}

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
__device__ T block_sum(T v, T* smem) {
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

// ---- packing --------------------------------------------------------------------------------
__global__ void k_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  const int64_t groups = (n + 7) / 8;
  const uint32_t m = (1u << bits) - 1;
  GRID_STRIDE(g, groups) {
    int64_t i0 = 8 * g;
    int cnt = (int)(n - i0 < 8 ? n - i0 : 8);
    uint64_t w = 0;
    for (int t = 0; t < cnt; ++t) w |= (uint64_t)(codes[i0 + t] & m) << (bits * t);
    int nb = cnt == 8 ? bits : (cnt * bits + 7) / 8;
    for (int b = 0; b < nb; ++b) out[g * bits + b] = (uint8_t)(w >> (8 * b));
  }
}

__global__ void k_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes) {
  const int64_t groups = (n + 7) / 8;
  const uint32_t m = (1u << bits) - 1;
  GRID_STRIDE(g, groups) {
    int64_t i0 = 8 * g;
    int cnt = (int)(n - i0 < 8 ? n - i0 : 8);
    int nb = cnt == 8 ? bits : (cnt * bits + 7) / 8;
    uint64_t w = 0;
    for (int b = 0; b < nb; ++b) w |= (uint64_t)packed[g * bits + b] << (8 * b);
    for (int t = 0; t < cnt; ++t) codes[i0 + t] = (uint8_t)((w >> (bits * t)) & m);
  }
}

// ---- sign family: one warp covers 32 consecutive elements per step (4 packed bytes) ----------
__device__ __forceinline__ void write_ballot(unsigned bal, int64_t base, int64_t n, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if (lane < 4) {
    int64_t byte = base / 8 + lane;
    if (byte * 8 < n) out[byte] = (uint8_t)(bal >> (8 * lane));
  }
}

#define WARP_STRIDE(base, n) BLOCK_WARP_STRIDE(base, n, blockIdx.x, gridDim.x)
#define BLOCK_WARP_STRIDE(base, n, block, nblocks)                                       \
  const int64_t warp_ = ((block) * (int64_t)blockDim.x + threadIdx.x) >> 5;              \
  const int64_t nwarps_ = ((int64_t)(nblocks) * blockDim.x) >> 5;                        \
  for (int64_t base = warp_ * 32; base < (n); base += nwarps_ * 32)

__global__ void k_sign_pack(const float* x, int64_t n, int negative, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  WARP_STRIDE(base, n) {
    int64_t i = base + lane;
    bool p = false;
    if (i < n) {
      float v = x[i];
      p = negative ? v < 0.0f : v >= 0.0f;
    }
    write_ballot(__ballot_sync(kFull, p), base, n, out);
  }
}

constexpr int kRedBlocks = 1024;  // fixed grid of the reductions: the order of the sums is fixed

// (grid_for(n, kThreads * 8, kRedBlocks), on either side: the segment kernels size themselves by it)
__host__ __device__ inline int red_grid(int64_t n) {
  const int64_t b = (n + kThreads * 8 - 1) / (kThreads * 8);
  return (int)(b < 1 ? 1 : (b > kRedBlocks ? kRedBlocks : b));
}

// bits (x >= 0) and per-block partial sums: S = 1: |x|; S = 3: count(x >= 0), sum(x >= 0), sum
// (block `block` of a grid of nblocks: partial[s * nblocks + block])
template <int S>
__device__ void sign_sums(const float* x, int64_t n, uint8_t* out, float* partial, int64_t block, int64_t nblocks) {
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

template <int S>
__global__ void k_sign_sums(const float* x, int64_t n, uint8_t* out, float* partial) {
  sign_sums<S>(x, n, out, partial, blockIdx.x, gridDim.x);
}

// one block: the partials' sums, then the scalars
template <int S>
__device__ void sign_final(const float* partial, int nblocks, int64_t n, float* result) {
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

template <int S>
__global__ void k_sign_final(const float* partial, int nblocks, int64_t n, float* result) {
  sign_final<S>(partial, nblocks, n, result);
}

// ---- max |x| (NaN wins, as np.max) ------------------------------------------------------------
__device__ void maxabs(const float* x, int64_t n, unsigned* out, int64_t block, int64_t nblocks) {
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

__global__ void k_maxabs(const float* x, int64_t n, unsigned* out) { maxabs(x, n, out, blockIdx.x, gridDim.x); }

// ---- terngrad, QSGD, natural: one thread per group of 8 elements ------------------------------
__device__ void terngrad(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out, int64_t block,
                         int64_t nblocks) {
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

__global__ void k_terngrad(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out) {
  terngrad(x, u, n, scale, out, blockIdx.x, gridDim.x);
}

__device__ __forceinline__ uint8_t qsgd_code(float v, float u, float safe, float flevels) {
  float r = __fdiv_rn(__fmul_rn(fabsf(v), flevels), safe);
  float low = floorf(r);
  float level = __fadd_rn(low, u < __fsub_rn(r, low) ? 1.0f : 0.0f);
  level = __fsub_rn(level, level > flevels ? 1.0f : 0.0f);
  float c = __fadd_rn(__fmul_rn(level, 2.0f), v < 0.0f ? 1.0f : 0.0f);
  return c == c ? (uint8_t)(int)c : (uint8_t)0;
}

__device__ void qsgd(const float* x, const float* u, int64_t n, float flevels, int64_t b, int bits, const float* norms,
                     uint8_t* out, int64_t block, int64_t nblocks) {
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

__global__ void k_qsgd(const float* x, const float* u, int64_t n, float flevels, int64_t b, int bits,
                       const float* norms, uint8_t* out) {
  qsgd(x, u, n, flevels, b, bits, norms, out, blockIdx.x, gridDim.x);
}

// norms of short buckets (b <= 4096): one warp each
__device__ void norms_warp(const float* x, int64_t n, int64_t b, int64_t rows, float* norms, int64_t block,
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

__global__ void k_norms_warp(const float* x, int64_t n, int64_t b, int64_t rows, float* norms) {
  norms_warp(x, n, b, rows, norms, blockIdx.x, gridDim.x);
}

constexpr int64_t kSegChunk = kThreads * 16;

// QSGD's rows: `bucket` elements each, or the whole tensor (bucket 0, or one past its end);
// their count; and the chunks of a row longer than 4096 (summed apart, then per row)
__host__ __device__ inline int64_t qsgd_row(int64_t n, int64_t bucket) {
  return bucket > 0 && bucket < n ? bucket : (n > 1 ? n : 1);
}
__host__ __device__ inline int64_t qsgd_rows(int64_t n, int64_t b) { return (n + b - 1) / b; }
__host__ __device__ inline int64_t row_chunks(int64_t b) { return (b + kSegChunk - 1) / kSegChunk; }

// long buckets: block (r, c) sums chunk c of bucket r; then one block per bucket
// (block v of rows * cpr: partial[v])
__device__ void norms_partial(const float* x, int64_t n, int64_t b, int64_t cpr, float* partial, int64_t v) {
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

__global__ void k_norms_partial(const float* x, int64_t n, int64_t b, int64_t cpr, float* partial) {
  norms_partial(x, n, b, cpr, partial, blockIdx.x);
}

// row r's norm from its cpr partials
__device__ void norms_final(const float* partial, int64_t cpr, float* norms, int64_t r) {
  __shared__ float smem[32];
  float acc = 0.0f;
  for (int64_t j = threadIdx.x; j < cpr; j += blockDim.x) acc += partial[r * cpr + j];
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) norms[r] = sqrtf(acc);
}

__global__ void k_norms_final(const float* partial, int64_t cpr, float* norms) {
  norms_final(partial, cpr, norms, blockIdx.x);
}

__device__ __forceinline__ uint8_t natural_code(float v, float u) {
  uint32_t bits = __float_as_uint(v);
  uint32_t e = (bits >> 23) & 0xff;
  if (e >= 254) return 254;
  float frac = (float)(bits & 0x7fffff) * 0x1p-23f;
  return (uint8_t)(e + (u < frac ? 1 : 0));
}

__device__ void natural(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes, int64_t block,
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

__global__ void k_natural(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes) {
  natural(x, u, n, signs, codes, blockIdx.x, gridDim.x);
}

// ---- decoders ---------------------------------------------------------------------------------
// Decoders: block `block` of a grid of nblocks (the per-tensor kernels: the launch's own grid)
__device__ void sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                            int64_t nblocks) {
  const float s = scale ? scale[0] : 1.0f;
  const float lo = __fmul_rn(-1.0f, s), hi = __fmul_rn(1.0f, s);
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = (packed[i >> 3] >> (i & 7)) & 1 ? hi : lo;
}

__global__ void k_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  sign_decode(packed, n, scale, out, blockIdx.x, gridDim.x);
}

__device__ void onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out, int64_t block,
                              int64_t nblocks) {
  const float mu0 = means[0], mu1 = means[1];
  const float d = __fsub_rn(mu1, mu0);
  const float v0 = __fadd_rn(mu0, __fmul_rn(0.0f, d)), v1 = __fadd_rn(mu0, __fmul_rn(1.0f, d));
  BLOCK_STRIDE(i, n, block, nblocks) out[i] = (packed[i >> 3] >> (i & 7)) & 1 ? v1 : v0;
}

__global__ void k_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out) {
  onebit_decode(packed, n, means, out, blockIdx.x, gridDim.x);
}

__device__ void terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, int64_t block,
                                int64_t nblocks) {
  const float s = scale[0];
  const float z = __fmul_rn(0.0f, s), p = __fmul_rn(1.0f, s), m = __fmul_rn(-1.0f, s);
  BLOCK_STRIDE(i, n, block, nblocks) {
    int c = (packed[i >> 2] >> (2 * (i & 3))) & 3;
    out[i] = c == 0 ? z : (c == 1 ? p : m);
  }
}

__global__ void k_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  terngrad_decode(packed, n, scale, out, blockIdx.x, gridDim.x);
}

__device__ void qsgd_decode(const uint8_t* packed, int64_t n, float flevels, int64_t b, int bits, const float* norms,
                            float* out, int64_t block, int64_t nblocks) {
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

__global__ void k_qsgd_decode(const uint8_t* packed, int64_t n, float flevels, int64_t b, int bits,
                              const float* norms, float* out) {
  qsgd_decode(packed, n, flevels, b, bits, norms, out, blockIdx.x, gridDim.x);
}

__device__ void natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out, int64_t block,
                               int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) {
    float mag = __uint_as_float((uint32_t)codes[i] << 23);
    float sign = (signs[i >> 3] >> (i & 7)) & 1 ? -1.0f : 1.0f;
    out[i] = __fmul_rn(sign, mag);
  }
}

__global__ void k_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out) {
  natural_decode(signs, codes, n, out, blockIdx.x, gridDim.x);
}

// ---- selection ----------------------------------------------------------------------------------
// Keys: unsigned, order-preserving. Elements are selected by key > T, plus the first `need`
// (in index order) with key == T; an ordered compaction writes them at
// pos = (# selected-by-gt before) + min(# eq before, need).
struct SelState {
  uint32_t prefix;      // key bits fixed so far (topk), or the threshold key
  uint32_t mask;        // which bits of prefix are fixed
  long long need;       // how many elements with key == prefix to take
};

struct KeyAbs {
  const float* x;
  __device__ uint32_t operator()(int64_t i) const { return __float_as_uint(x[i]) & 0x7fffffffu; }
};
struct KeySigned {
  const float* x;
  __device__ uint32_t operator()(int64_t i) const {
    uint32_t u = __float_as_uint(x[i]);
    return (u >> 31) ? ~u : (u | 0x80000000u);
  }
};

__global__ void k_init_state(SelState* st, long long need) {
  st->prefix = 0;
  st->mask = 0;
  st->need = need;
}

template <class Key>
__device__ void hist(Key key, int64_t n, const SelState* st, int shift, int nbins, unsigned long long* hist,
                     int64_t block, int64_t nblocks) {
  __shared__ unsigned sh[2048];
  for (int j = threadIdx.x; j < nbins; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix, mask = st->mask;
  const int lane = threadIdx.x & 31;
  // shared-memory atomics, except where the whole warp falls in one bin (runs of zeros, or
  // the later passes where most keys match no prefix): one add for the warp. Aggregating
  // every warp with __match_any_sync costs more than the collisions it saves (H200).
  BLOCK_WARP_STRIDE(base, n, block, nblocks) {
    int64_t i = base + lane;
    int bin = nbins;  // none
    if (i < n) {
      uint32_t k = key(i);
      if ((k & mask) == prefix) bin = (int)((k >> shift) & (nbins - 1));
    }
    if (__all_sync(kFull, bin == __shfl_sync(kFull, bin, 0))) {
      if (lane == 0 && bin < nbins) atomicAdd(&sh[bin], 32u);
    } else if (bin < nbins) {
      atomicAdd(&sh[bin], 1u);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < nbins; j += blockDim.x)
    if (sh[j]) atomicAdd(&hist[j], (unsigned long long)sh[j]);
}

template <class Key>
__global__ void k_hist(Key key, int64_t n, const SelState* st, int shift, int nbins, unsigned long long* h) {
  hist(key, n, st, shift, nbins, h, blockIdx.x, gridDim.x);
}

// one warp: the bin (from the top) where the count reaches `need`; narrow the state to it
__device__ void find(const unsigned long long* hist, int nbins, int shift, SelState* st) {
  const int lane = threadIdx.x;
  const int per = nbins / 32;
  long long s = 0;
  for (int j = 0; j < per; ++j) s += (long long)hist[nbins - lane * per - 1 - j];
  long long incl = s;
  for (int o = 1; o < 32; o <<= 1) {
    long long t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  const long long excl = incl - s;
  const long long need = st->need;
  unsigned ball = __ballot_sync(kFull, excl < need && need <= incl);
  int L = __ffs(ball) - 1;
  if (L < 0) L = 31;  // cannot happen with 1 <= need <= count; keep the state sane
  if (lane == L) {
    long long acc = excl;
    int b = nbins - L * per - 1;
    for (; b > nbins - (L + 1) * per; --b) {
      long long h = (long long)hist[b];
      if (acc + h >= need) break;
      acc += h;
    }
    st->need = need - acc;
    st->prefix |= (uint32_t)b << shift;
    st->mask |= (uint32_t)(nbins - 1) << shift;
  }
}

__global__ void k_find(const unsigned long long* hist, int nbins, int shift, SelState* st) {
  find(hist, nbins, shift, st);
}

constexpr int kItems = 16;
constexpr int64_t kTile = (int64_t)kThreads * kItems;

__host__ __device__ inline int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// The predicate of the compaction: gt(i) (always taken) and eq(i) (taken while rank < need).
template <class Key>
struct TopkPred {
  Key key;
  __device__ void operator()(int64_t i, const SelState& st, bool& gt, bool& eq) const {
    uint32_t k = key(i);
    gt = k > st.prefix;
    eq = k == st.prefix;
  }
};

struct ThresholdPredF {
  const float* x;
  float thr;
  int by_abs;
  __device__ void operator()(int64_t i, const SelState&, bool& gt, bool& eq) const {
    float v = x[i];
    gt = (by_abs ? fabsf(v) : v) >= thr;
    eq = false;
  }
};

struct MaskPred {
  const uint8_t* mask;
  __device__ void operator()(int64_t i, const SelState&, bool& gt, bool& eq) const {
    gt = mask[i] != 0;
    eq = false;
  }
};

// tile `tile`'s counts
template <class Pred>
__device__ void count(Pred pred, int64_t n, const SelState* st_, long long* cnt_gt, long long* cnt_eq, int64_t tile) {
  __shared__ long long smem[32];
  const SelState st = *st_;
  const int64_t base = tile * kTile;
  long long gt_n = 0, eq_n = 0;
  for (int j = 0; j < kItems; ++j) {
    int64_t i = base + j * kThreads + threadIdx.x;
    if (i < n) {
      bool gt, eq;
      pred(i, st, gt, eq);
      gt_n += gt;
      eq_n += eq;
    }
  }
  gt_n = block_sum(gt_n, smem);
  eq_n = block_sum(eq_n, smem);
  if (threadIdx.x == 0) {
    cnt_gt[tile] = gt_n;
    cnt_eq[tile] = eq_n;
  }
}

template <class Pred>
__global__ void k_count(Pred pred, int64_t n, const SelState* st_, long long* cnt_gt, long long* cnt_eq) {
  count(pred, n, st_, cnt_gt, cnt_eq, blockIdx.x);
}

// one block of 1024: exclusive scans of both count arrays; totals[0..1] their sums
__device__ void scan2(long long* a, long long* b, int64_t m, long long* totals) {
  __shared__ long long sa[1024], sb[1024];
  const int t = threadIdx.x;
  long long ca = 0, cb = 0;
  for (int64_t base = 0; base < m; base += 1024) {
    int64_t i = base + t;
    long long va = i < m ? a[i] : 0, vb = i < m ? b[i] : 0;
    sa[t] = va;
    sb[t] = vb;
    __syncthreads();
    for (int o = 1; o < 1024; o <<= 1) {
      long long ta = t >= o ? sa[t - o] : 0, tb = t >= o ? sb[t - o] : 0;
      __syncthreads();
      sa[t] += ta;
      sb[t] += tb;
      __syncthreads();
    }
    if (i < m) {
      a[i] = ca + sa[t] - va;
      b[i] = cb + sb[t] - vb;
    }
    ca += sa[1023];
    cb += sb[1023];
    __syncthreads();
  }
  if (t == 0) {
    totals[0] = ca;
    totals[1] = cb;
  }
}

__global__ void k_scan2(long long* a, long long* b, int64_t m, long long* totals) { scan2(a, b, m, totals); }

// Emit: what to write for a selected element i at output position pos.
struct EmitIdx {
  void* idx;
  int idx_type;
  const float* values_src;  // NULL: no values
  float* values;
  float* new_r;             // error feedback: new_r[i] = p - (0 + p) where sent
  __device__ void operator()(int64_t pos, int64_t i) const {
    put_index(idx, idx_type, pos, i);
    if (values) {
      float p = values_src[i];
      values[pos] = p;
      if (new_r) new_r[i] = __fsub_rn(p, __fadd_rn(0.0f, p));
    }
  }
};

// Warp w of a block owns kItems rounds of 32 consecutive elements of the block's tile, so the
// block needs one synchronization (for the warps' counts); each warp keeps its ballots in
// registers and writes in order with its own running offsets.
template <class Pred>
__device__ void write(Pred pred, int64_t n, const SelState* st_, const long long* off_gt, const long long* off_eq,
                      const EmitIdx& emit, int64_t tile) {
  __shared__ int wg[kThreads / 32], we[kThreads / 32];
  const SelState st = *st_;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const unsigned lt = (1u << lane) - 1;
  const int64_t wbase = tile * kTile + (int64_t)w * kItems * 32;
  unsigned bg[kItems], be[kItems];
  int count_g = 0, count_e = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = wbase + j * 32 + lane;
    bool gt = false, eq = false;
    if (i < n) pred(i, st, gt, eq);
    bg[j] = __ballot_sync(kFull, gt);
    be[j] = __ballot_sync(kFull, eq);
    count_g += __popc(bg[j]);
    count_e += __popc(be[j]);
  }
  if (lane == 0) {
    wg[w] = count_g;
    we[w] = count_e;
  }
  __syncthreads();
  long long run_gt = off_gt[tile], run_eq = off_eq[tile];
  for (int v = 0; v < w; ++v) {
    run_gt += wg[v];
    run_eq += we[v];
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const long long rg = run_gt + __popc(bg[j] & lt), re = run_eq + __popc(be[j] & lt);
    const bool gt = bg[j] >> lane & 1, eq = be[j] >> lane & 1;
    if (gt || (eq && re < st.need)) emit(rg + (re < st.need ? re : st.need), wbase + j * 32 + lane);
    run_gt += __popc(bg[j]);
    run_eq += __popc(be[j]);
  }
}

template <class Pred>
__global__ void k_write(Pred pred, int64_t n, const SelState* st_, const long long* off_gt, const long long* off_eq,
                        EmitIdx emit) {
  write(pred, n, st_, off_gt, off_eq, emit, blockIdx.x);
}

__device__ void compensate(const float* g, const float* r, int64_t n, float beta, float gamma, int flags, float* p,
                           int64_t block, int64_t nblocks) {
  BLOCK_STRIDE(i, n, block, nblocks) {
    float a = (flags & 1) ? __fmul_rn(g[i], gamma) : g[i];
    p[i] = __fadd_rn(a, (flags & 2) ? __fmul_rn(r[i], beta) : r[i]);
  }
}

__global__ void k_compensate(const float* g, const float* r, int64_t n, float beta, float gamma, int flags,
                             float* p) {
  compensate(g, r, n, beta, gamma, flags, p, blockIdx.x, gridDim.x);
}

__global__ void k_take_all(int64_t n, EmitIdx emit) {
  GRID_STRIDE(i, n) emit(i, i);
}

// Ordered compaction by `pred`; st_dev must be valid. Returns 0, or < 0 on a CUDA error.
// If total_host is not NULL, the number written is copied there (synchronizing the stream).
template <class Pred>
int compact(Pred pred, int64_t n, const SelState* st_dev, const EmitIdx& emit, long long* total_host,
            cudaStream_t s) {
  const int64_t tiles = tiles_of(n);
  Scratch sc(align256(4 * tiles * sizeof(long long)) + 256, s);
  if (!sc.p) return -3;
  long long* cg = sc.at<long long>(0);
  long long* ce = cg + tiles;
  long long* totals = sc.at<long long>(align256(4 * tiles * sizeof(long long)));
  k_count<<<(unsigned)tiles, kThreads, 0, s>>>(pred, n, st_dev, cg, ce);
  k_scan2<<<1, 1024, 0, s>>>(cg, ce, tiles, totals);
  k_write<<<(unsigned)tiles, kThreads, 0, s>>>(pred, n, st_dev, cg, ce, emit);
  if (total_host) {
    long long t[2];
    cudaMemcpyAsync(t, totals, sizeof(t), cudaMemcpyDeviceToHost, s);
    if (cudaStreamSynchronize(s) != cudaSuccess) return -2;
    *total_host = t[0];
  }
  return status();
}

// Radix select (11 + 11 + 10 bits) of the k largest keys, then the ordered compaction.
template <class Key>
int topk_run(Key key, int64_t n, int64_t k, const EmitIdx& emit, cudaStream_t s) {
  Scratch sc(align256(2048 * sizeof(unsigned long long)) + 256, s);
  if (!sc.p) return -3;
  unsigned long long* hist = sc.at<unsigned long long>(0);
  SelState* st = sc.at<SelState>(align256(2048 * sizeof(unsigned long long)));
  k_init_state<<<1, 1, 0, s>>>(st, k);
  const int shifts[3] = {21, 10, 0}, bins[3] = {2048, 2048, 1024};
  const int grid = grid_for(n, kThreads * 16, 2048);
  for (int d = 0; d < 3; ++d) {
    cudaMemsetAsync(hist, 0, bins[d] * sizeof(unsigned long long), s);
    k_hist<<<grid, kThreads, 0, s>>>(key, n, st, shifts[d], bins[d], hist);
    k_find<<<1, 32, 0, s>>>(hist, bins[d], shifts[d], st);
  }
  return compact(TopkPred<Key>{key}, n, st, emit, nullptr, s);
}

// state for a threshold (no ties): need = 0
int threshold_state(SelState** st, Scratch& sc, cudaStream_t s) {
  *st = sc.at<SelState>(0);
  k_init_state<<<1, 1, 0, s>>>(*st, 0);
  return status();
}

// ---- a bucket's segments, one launch per kernel ---------------------------------------------------
// A bucket's gradients lie one after another in a flat buffer. A batch of up to kSegBatch
// segments travels as a kernel argument (no copy to the device, no host wait). A launch's grid
// is the segments' blocks one after another, each segment as many as it needs (seg_grid), so
// a small segment beside a large one costs no empty blocks. The reductions give each segment
// the blocks its per-tensor kernel launches (the same blocks summing in the same order), so a
// segment's result is the per-tensor one bit for bit.
constexpr int kSegBatch = 64;
struct SegBatch {
  int count;               // segments in this batch
  int64_t n[kSegBatch];    // elements
  int64_t x[kSegBatch];    // first element in the flat input (and the flat decoded output)
  int64_t u[kSegBatch];    // first draw; the draws' kernels: the seed words s0 | s1 << 32
  int64_t p[kSegBatch];    // first byte of its packed codes (natural compression: of its sign bits)
  int64_t q[kSegBatch];    // first scalar (scale, means, norms); natural compression: first code
  int64_t r[kSegBatch];    // first slot of its partial sums in the scratch
  int block0[kSegBatch + 1];  // this launch's blocks of segment k: [block0[k], block0[k + 1])
};

// the segment that block blockIdx.x works on, and the block's place among that segment's blocks
struct SegBlock {
  int s;
  int64_t block, blocks;
};

__device__ __forceinline__ SegBlock seg_block(const SegBatch& t) {
  const int b = blockIdx.x;
  int lo = 0, hi = t.count - 1;  // the last segment whose blocks start at or before b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.block0[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return {lo, b - t.block0[lo], t.block0[lo + 1] - t.block0[lo]};
}

__device__ __forceinline__ uint32_t hash32(uint32_t h) {  // grace/core/draws.py's hash32
  h ^= h >> 16;
  h *= 0x21F0AAADu;
  h ^= h >> 15;
  h *= 0x735A2D97u;
  return h ^ (h >> 15);
}

__device__ __forceinline__ uint32_t draw_hash(int64_t j, int64_t words) {
  return hash32(hash32((uint32_t)j ^ (uint32_t)words) ^ (uint32_t)(words >> 32));
}

// counter-based draws: uniform floats, or the sort keys segment << 32 | hash (random indices)
__global__ void k_uniform_seg(SegBatch t, float* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  float* o = out + t.x[s];
  BLOCK_STRIDE(j, t.n[s], sb.block, sb.blocks) o[j] = (float)(draw_hash(j, t.u[s]) >> 8) * 0x1p-24f;
}

__global__ void k_hash_keys_seg(SegBatch t, int64_t first, int64_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  int64_t* o = out + t.x[s];
  const int64_t high = (first + s) << 32;
  BLOCK_STRIDE(j, t.n[s], sb.block, sb.blocks) o[j] = high | (int64_t)draw_hash(j, t.u[s]);
}

__global__ void k_maxabs_seg(SegBatch t, const float* x, unsigned* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  maxabs(x + t.x[s], t.n[s], out + t.q[s], sb.block, sb.blocks);
}

__global__ void k_terngrad_seg(SegBatch t, const float* x, const float* u, const float* scale, uint8_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  terngrad(x + t.x[s], u + t.u[s], t.n[s], scale + t.q[s], out + t.p[s], sb.block, sb.blocks);
}

__global__ void k_natural_seg(SegBatch t, const float* x, const float* u, uint8_t* signs, uint8_t* codes) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  natural(x + t.x[s], u + t.u[s], t.n[s], signs + t.p[s], codes + t.q[s], sb.block, sb.blocks);
}

// QSGD's norms: rows of b <= 4096 a warp each; longer rows by chunks (partials from t.r[s]), then
// one block per row
__global__ void k_norms_seg(SegBatch t, const float* x, int64_t bucket, float* norms, float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
  if (b <= 4096) {
    norms_warp(x + t.x[s], n, b, rows, norms + t.q[s], sb.block, sb.blocks);
    return;
  }
  const int64_t cpr = row_chunks(b);
  for (int64_t v = sb.block; v < rows * cpr; v += sb.blocks) {
    norms_partial(x + t.x[s], n, b, cpr, partial + t.r[s], v);
    __syncthreads();  // (block_sum's shared memory, again)
  }
}

__global__ void k_norms_final_seg(SegBatch t, int64_t bucket, float* norms, const float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
  if (b <= 4096) return;
  for (int64_t r = sb.block; r < rows; r += sb.blocks) {
    norms_final(partial + t.r[s], row_chunks(b), norms + t.q[s], r);
    __syncthreads();
  }
}

__global__ void k_qsgd_seg(SegBatch t, const float* x, const float* u, float flevels, int64_t bucket, int bits,
                           const float* norms, uint8_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket);
  qsgd(x + t.x[s], u + t.u[s], n, flevels, b, bits, norms + t.q[s], out + t.p[s], sb.block, sb.blocks);
}

// the sign family's bits and scalars: each segment on red_grid(n) blocks, as alone
template <int S>
__global__ void k_sign_sums_seg(SegBatch t, const float* x, uint8_t* out, float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  sign_sums<S>(x + t.x[s], t.n[s], out + t.p[s], partial + t.r[s], sb.block, sb.blocks);
}

template <int S>
__global__ void k_sign_final_seg(SegBatch t, const float* partial, float* scalars) {
  const int s = blockIdx.x;
  sign_final<S>(partial + t.r[s], red_grid(t.n[s]), t.n[s], scalars + t.q[s]);
}

// every segment's decompression into the flat out (Method: 0 sign bits, scalars[q] the scale or
// NULL (signSGD), 1 1-bit SGD, 2 TernGrad, 3 QSGD, 4 natural compression (b: its codes))
template <int Method>
__global__ void k_decode_seg(SegBatch t, const uint8_t* a, const void* b, float flevels, int64_t bucket, int bits,
                             float* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s];
  const float* scalars = static_cast<const float*>(b);
  float* o = out + t.x[s];
  if constexpr (Method == 0) sign_decode(a + t.p[s], n, scalars ? scalars + t.q[s] : nullptr, o, sb.block, sb.blocks);
  if constexpr (Method == 1) onebit_decode(a + t.p[s], n, scalars + t.q[s], o, sb.block, sb.blocks);
  if constexpr (Method == 2) terngrad_decode(a + t.p[s], n, scalars + t.q[s], o, sb.block, sb.blocks);
  if constexpr (Method == 3)
    qsgd_decode(a + t.p[s], n, flevels, qsgd_row(n, bucket), bits, scalars + t.q[s], o, sb.block, sb.blocks);
  if constexpr (Method == 4)
    natural_decode(a + t.p[s], static_cast<const uint8_t*>(b) + t.q[s], n, o, sb.block, sb.blocks);
}

// top-k with error feedback (grace_cuda_topk_ef) of every segment: t.u holds its k, t.p its first
// value and index, t.q its first compaction tile; selection state s and histogram s per segment
__host__ __device__ __forceinline__ bool selects(const SegBatch& t, int s) { return t.u[s] > 0 && t.u[s] < t.n[s]; }

constexpr int kHistBins = 2048;

__global__ void k_compensate_seg(SegBatch t, const float* g, const float* r, float beta, float gamma, int flags,
                                 float* p) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t o = t.x[s];
  compensate(g + o, r + o, t.n[s], beta, gamma, flags, p + o, sb.block, sb.blocks);
}

__global__ void k_topk_init_seg(SegBatch t, SelState* st) {
  const int s = threadIdx.x;
  if (s < t.count) st[s] = SelState{0u, 0u, (long long)t.u[s]};
}

__global__ void k_topk_hist_seg(SegBatch t, const float* p, const SelState* st, int shift, int nbins,
                                unsigned long long* h) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  if (!selects(t, s)) return;
  hist(KeyAbs{p + t.x[s]}, t.n[s], st + s, shift, nbins, h + (int64_t)s * kHistBins, sb.block, sb.blocks);
}

__global__ void k_topk_find_seg(SegBatch t, const unsigned long long* h, int nbins, int shift, SelState* st) {
  const int s = blockIdx.x;
  if (selects(t, s)) find(h + (int64_t)s * kHistBins, nbins, shift, st + s);
}

__global__ void k_topk_count_seg(SegBatch t, const float* p, const SelState* st, long long* cg, long long* ce) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  if (!selects(t, s)) return;
  count(TopkPred<KeyAbs>{KeyAbs{p + t.x[s]}}, t.n[s], st + s, cg + t.q[s], ce + t.q[s], sb.block);
}

__global__ void k_topk_scan_seg(SegBatch t, long long* cg, long long* ce, long long* totals) {
  const int s = blockIdx.x;
  if (selects(t, s)) scan2(cg + t.q[s], ce + t.q[s], tiles_of(t.n[s]), totals + 2 * s);
}

__global__ void k_topk_write_seg(SegBatch t, float* p, const SelState* st, const long long* cg, const long long* ce,
                                 int64_t* idx, float* values) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], k = t.u[s];
  const EmitIdx emit{idx + t.p[s], GRACE_I64, p + t.x[s], values + t.p[s], p + t.x[s]};
  if (k >= n) {  // every element (k_take_all)
    BLOCK_STRIDE(i, n, sb.block, sb.blocks) emit(i, i);
    return;
  }
  if (k <= 0) return;
  write(TopkPred<KeyAbs>{KeyAbs{p + t.x[s]}}, n, st + s, cg + t.q[s], ce + t.q[s], emit, sb.block);
}

// Runs launch(batch, its first segment) on each batch of up to kSegBatch segments, fill(batch,
// k, segment) setting batch slot k; each launch's grid: seg_grid(batch, blocks of slot k).
template <class Fill, class Launch>
int for_batches(int64_t segments, Fill fill, Launch launch) {
  if (segments < 0) return -1;
  for (int64_t first = 0; first < segments; first += kSegBatch) {
    SegBatch t;
    std::memset(&t, 0, sizeof(t));
    t.count = (int)std::min<int64_t>(kSegBatch, segments - first);
    for (int k = 0; k < t.count; ++k) fill(t, k, first + k);
    const int rc = launch(t, first);
    if (rc != 0) return rc;
  }
  return status();
}

// a launch's grid: slot k's blocks(k) blocks (at least 1, at most 2^16) after the slots before
// it, recorded in t.block0 for seg_block
template <class Blocks>
dim3 seg_grid(SegBatch& t, Blocks blocks) {
  int at = 0;
  for (int k = 0; k < t.count; ++k) {
    t.block0[k] = at;
    at += (int)std::max<int64_t>(1, std::min<int64_t>(blocks(k), 1 << 16));
  }
  t.block0[t.count] = at;
  return dim3((unsigned)at);
}

// the grids of the kernels with a thread per element, and a thread per 8 elements
inline dim3 per_element(SegBatch& t) {
  return seg_grid(t, [&](int k) { return (t.n[k] + kThreads - 1) / kThreads; });
}
inline dim3 per_byte(SegBatch& t) {
  return seg_grid(t, [&](int k) { return (t.n[k] + 7) / 8 / kThreads + 1; });
}

inline int64_t packed_bytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// The fields every drawn segment of a compress batch fills alike: its size, where its input and its
// draws start, and where its codes (`bits` per element, from a byte boundary) go, `bytes` on past them
inline void drawn_segment(SegBatch& t, int k, int64_t n, int64_t start, int64_t draw_start, int bits,
                          int64_t& bytes) {
  t.n[k] = n;
  t.x[k] = start;
  t.u[k] = draw_start;
  t.p[k] = bytes;
  bytes += packed_bytes(n, bits);
}

}  // namespace

// ===============================================================================================
API int grace_cuda_abi(void) { return GRACE_NATIVE_ABI; }

API int grace_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

API int grace_cuda_device_sync(void) { return cudaDeviceSynchronize() == cudaSuccess ? 0 : -2; }

API int grace_cuda_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out, void* stream) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  if (n == 0) return 0;
  k_pack<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(codes, n, bits, out);
  return status();
}

API int grace_cuda_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes, void* stream) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  if (n == 0) return 0;
  k_unpack<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(packed, n, bits, codes);
  return status();
}

API int grace_cuda_sign_pack(const float* x, int64_t n, int negative, uint8_t* out, void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_sign_pack<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(x, n, negative, out);
  return status();
}

template <int S>
static int sign_sums(const float* x, int64_t n, uint8_t* out, float* result, cudaStream_t s) {
  const int grid = red_grid(n);
  Scratch sc(S * grid * sizeof(float), s);
  if (!sc.p) return -3;
  float* partial = sc.at<float>(0);
  if (n > 0) k_sign_sums<S><<<grid, kThreads, 0, s>>>(x, n, out, partial);
  else cudaMemsetAsync(partial, 0, S * grid * sizeof(float), s);
  k_sign_final<S><<<1, 1024, 0, s>>>(partial, grid, n, result);
  return status();
}

API int grace_cuda_efsign_compress(const float* x, int64_t n, uint8_t* out, float* scale, void* stream) {
  if (n < 0) return -1;
  return sign_sums<1>(x, n, out, scale, as_stream(stream));
}

API int grace_cuda_onebit_compress(const float* x, int64_t n, uint8_t* out, float* means, void* stream) {
  if (n < 0) return -1;
  return sign_sums<3>(x, n, out, means, as_stream(stream));
}

API int grace_cuda_maxabs(const float* x, int64_t n, float* out, void* stream) {
  cudaStream_t s = as_stream(stream);
  cudaMemsetAsync(out, 0, sizeof(float), s);
  if (n > 0) k_maxabs<<<grid_for(n, kThreads * 8, 1024), kThreads, 0, s>>>(x, n, reinterpret_cast<unsigned*>(out));
  return status();
}

API int grace_cuda_terngrad_compress(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out,
                                     void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_terngrad<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(x, u, n, scale, out);
  return status();
}

API int grace_cuda_qsgd_norms(const float* x, int64_t n, int64_t bucket, float* norms, void* stream) {
  cudaStream_t s = as_stream(stream);
  const int64_t b = qsgd_row(n, bucket);
  const int64_t rows = n > 0 ? qsgd_rows(n, b) : 1;
  if (n == 0) {
    cudaMemsetAsync(norms, 0, sizeof(float), s);
    return status();
  }
  if (b <= 4096) {
    k_norms_warp<<<grid_for(rows * 32), kThreads, 0, s>>>(x, n, b, rows, norms);
    return status();
  }
  const int64_t cpr = row_chunks(b);
  Scratch sc(rows * cpr * sizeof(float), s);
  if (!sc.p) return -3;
  k_norms_partial<<<(unsigned)(rows * cpr), kThreads, 0, s>>>(x, n, b, cpr, sc.at<float>(0));
  k_norms_final<<<(unsigned)rows, kThreads, 0, s>>>(sc.at<float>(0), cpr, norms);
  return status();
}

// norms: given (have_norms) or computed first, on the same stream
API int grace_cuda_qsgd_compress(const float* x, const float* u, int64_t n, int levels, int64_t bucket, int bits,
                                 float* norms, int have_norms, uint8_t* out, void* stream) {
  if (bits < 1 || bits > 8 || levels < 1 || n < 0) return -1;
  if (n == 0) return 0;
  if (!have_norms) {
    const int rc = grace_cuda_qsgd_norms(x, n, bucket, norms, stream);
    if (rc != 0) return rc;
  }
  const int64_t b = qsgd_row(n, bucket);
  k_qsgd<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(x, u, n, (float)levels, b, bits, norms, out);
  return status();
}

API int grace_cuda_natural_compress(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes,
                                    void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_natural<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(x, u, n, signs, codes);
  return status();
}

API int grace_cuda_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_sign_decode<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(packed, n, scale, out);
  return status();
}

API int grace_cuda_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out, void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_onebit_decode<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(packed, n, means, out);
  return status();
}

__global__ void k_bits_sum(const uint8_t* packed, int64_t count, int64_t n, const float* scalars, int mode,
                           float* out) {
  const int64_t row = mode == 3 ? (2 * n + 7) / 8 : (n + 7) / 8;
  GRID_STRIDE(i, n) {
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      float lo, hi;
      if (mode == 3) {  // TernGrad: 2-bit codes 0, +s, -s, -s
        const float s = scalars[j];
        const int code = (packed[j * row + (i >> 2)] >> (2 * (i & 3))) & 3;
        const float v = code == 0 ? __fmul_rn(0.0f, s) : code == 1 ? __fmul_rn(1.0f, s) : __fmul_rn(-1.0f, s);
        acc = j ? __fadd_rn(acc, v) : v;
        continue;
      }
      if (mode == 2) {
        const float mu0 = scalars[2 * j], d = __fsub_rn(scalars[2 * j + 1], mu0);
        lo = __fadd_rn(mu0, __fmul_rn(0.0f, d));
        hi = __fadd_rn(mu0, __fmul_rn(1.0f, d));
      } else {
        const float s = mode == 1 ? scalars[j] : 1.0f;
        lo = __fmul_rn(-1.0f, s);
        hi = __fmul_rn(1.0f, s);
      }
      const float v = (packed[j * row + (i >> 3)] >> (i & 7)) & 1 ? hi : lo;
      acc = j ? __fadd_rn(acc, v) : v;
    }
    out[i] = acc;
  }
}

API int grace_cuda_bits_sum(const uint8_t* packed, int64_t count, int64_t n, const float* scalars, int mode,
                            float* out, void* stream) {
  if (n <= 0 || count <= 0) return n < 0 || count < 0 ? -1 : 0;
  k_bits_sum<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(packed, count, n, scalars, mode, out);
  return status();
}

API int grace_cuda_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_terngrad_decode<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(packed, n, scale, out);
  return status();
}

API int grace_cuda_qsgd_decode(const uint8_t* packed, int64_t n, int levels, int64_t bucket, int bits,
                               const float* norms, float* out, void* stream) {
  if (bits < 1 || bits > 8 || levels < 1 || n < 0) return -1;
  if (n == 0) return 0;
  const int64_t b = qsgd_row(n, bucket);
  k_qsgd_decode<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(packed, n, (float)levels, b, bits, norms, out);
  return status();
}

API int grace_cuda_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out, void* stream) {
  if (n <= 0) return n < 0 ? -1 : 0;
  k_natural_decode<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(signs, codes, n, out);
  return status();
}

API int64_t grace_cuda_topk(const void* x, int val_type, int64_t n, int64_t k, int by_abs, void* idx, int idx_type,
                            void* values, void* stream) {
  if (val_type != GRACE_F32 || idx_type < 0 || idx_type > 3 || n < 0) return -1;
  cudaStream_t s = as_stream(stream);
  const float* xf = static_cast<const float*>(x);
  EmitIdx emit{idx, idx_type, xf, static_cast<float*>(values), nullptr};
  if (k <= 0 || n == 0) return 0;
  if (k >= n) {
    k_take_all<<<grid_for(n), kThreads, 0, s>>>(n, emit);
    int st = status();
    return st ? st : n;
  }
  int st = by_abs ? topk_run(KeyAbs{xf}, n, k, emit, s) : topk_run(KeySigned{xf}, n, k, emit, s);
  return st ? st : k;
}

API int64_t grace_cuda_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma,
                               int flags, float* values, void* idx, int idx_type, float* new_r, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  cudaStream_t s = as_stream(stream);
  if (n == 0) return 0;
  k_compensate<<<grid_for(n), kThreads, 0, s>>>(g, r, n, beta, gamma, flags, new_r);
  if (k <= 0) return status();
  EmitIdx emit{idx, idx_type, new_r, values, new_r};
  if (k >= n) {
    k_take_all<<<grid_for(n), kThreads, 0, s>>>(n, emit);
    int st = status();
    return st ? st : n;
  }
  int st = topk_run(KeyAbs{new_r}, n, k, emit, s);
  return st ? st : k;
}

API int64_t grace_cuda_threshold(const void* x, int val_type, int64_t n, double thr, int by_abs, void* idx,
                                 int idx_type, void* values, void* stream) {
  if (val_type != GRACE_F32 || idx_type < 0 || idx_type > 3 || n < 0) return -1;
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  Scratch sc(256, s);
  if (!sc.p) return -3;
  SelState* st;
  threshold_state(&st, sc, s);
  const float* xf = static_cast<const float*>(x);
  EmitIdx emit{idx, idx_type, xf, static_cast<float*>(values), nullptr};
  long long total = 0;
  int rc = compact(ThresholdPredF{xf, (float)thr, by_abs}, n, st, emit, &total, s);
  return rc ? rc : total;
}

API int64_t grace_cuda_nonzero(const uint8_t* mask, int64_t n, void* idx, int idx_type, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  Scratch sc(256, s);
  if (!sc.p) return -3;
  SelState* st;
  threshold_state(&st, sc, s);
  EmitIdx emit{idx, idx_type, nullptr, nullptr, nullptr};
  long long total = 0;
  int rc = compact(MaskPred{mask}, n, st, emit, &total, s);
  return rc ? rc : total;
}

API int64_t grace_cuda_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                                    int flags, float* values, void* idx, int idx_type, float* new_r, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  k_compensate<<<grid_for(n), kThreads, 0, s>>>(g, r, n, beta, gamma, flags, new_r);
  Scratch sc(256, s);
  if (!sc.p) return -3;
  SelState* st;
  threshold_state(&st, sc, s);
  EmitIdx emit{idx, idx_type, new_r, values, new_r};
  long long total = 0;
  int rc = compact(ThresholdPredF{new_r, thr, 1}, n, st, emit, &total, s);
  return rc ? rc : total;
}

namespace {
// atomicAdd on float flushes subnormals to zero; a compare-and-swap loop adds exactly as the
// CPU does (one try when the indices of a payload are distinct, as sparsifiers send them)
__device__ __forceinline__ void add_exact(float* addr, float v) {
  unsigned* a = reinterpret_cast<unsigned*>(addr);
  unsigned old = *a, assumed;
  do {
    assumed = old;
    old = atomicCAS(a, assumed, __float_as_uint(__fadd_rn(__uint_as_float(assumed), v)));
  } while (assumed != old);
}

__device__ __forceinline__ void add_exact(double* addr, double v) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a, assumed;
  do {
    assumed = old;
    old = atomicCAS(a, assumed, __double_as_longlong(__dadd_rn(__longlong_as_double(assumed), v)));
  } while (assumed != old);
}

template <class T>
__global__ void k_scatter(const void* idx, int t, const T* v, int64_t len, int64_t numel, T* dense) {
  GRID_STRIDE(j, len) {
    int64_t i = get_index(idx, t, j);
    if (i >= 0 && i < numel) add_exact(&dense[i], v[j]);
  }
}
}  // namespace

API int grace_cuda_scatter_add(int count, const void* const* idx, const int* idx_types, const void* const* values,
                               const int64_t* lengths, int val_type, int64_t numel, void* dense, void* stream) {
  if (count < 0 || numel < 0 || (val_type != GRACE_F32 && val_type != GRACE_F64)) return -1;
  cudaStream_t s = as_stream(stream);
  const size_t vs = val_type == GRACE_F32 ? 4 : 8;
  if (numel > 0) cudaMemsetAsync(dense, 0, numel * vs, s);
  for (int p = 0; p < count; ++p) {
    if (idx_types[p] < 0 || idx_types[p] > 3) return -1;
    if (lengths[p] <= 0) continue;
    if (val_type == GRACE_F32)
      k_scatter<float><<<grid_for(lengths[p]), kThreads, 0, s>>>(idx[p], idx_types[p], (const float*)values[p],
                                                                 lengths[p], numel, (float*)dense);
    else
      k_scatter<double><<<grid_for(lengths[p]), kThreads, 0, s>>>(idx[p], idx_types[p], (const double*)values[p],
                                                                  lengths[p], numel, (double*)dense);
  }
  return status();
}

// ---- a bucket's segments (host arrays of segment sizes and offsets; device data) -----------------
// launch(batch, first segment) for the batches of segment s's numels[s] draws of the seed words
// (s0[s], s1[s]), the segments' draws in a row
template <class Launch>
static int draw_batches(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                        Launch launch) {
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 0 || numels[s] > (int64_t(1) << 32)) return -1;  // draw numbers are 32-bit
  int64_t at = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = at;
        t.u[k] = (int64_t)s0[s] | (int64_t)s1[s] << 32;
        at += numels[s];
      },
      launch);
}

API int grace_cuda_uniform_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                    float* out, void* stream) {
  return draw_batches(segments, numels, s0, s1, [&](SegBatch& t, int64_t) {
    const dim3 grid = per_element(t);
    k_uniform_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, out);
    return 0;
  });
}

// out[j] = segment << 32 | the hash of its draw j (segment draws in a row): random indices' sort keys
API int grace_cuda_hash_keys_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                      int64_t* out, void* stream) {
  return draw_batches(segments, numels, s0, s1, [&](SegBatch& t, int64_t first) {
    const dim3 grid = per_element(t);
    k_hash_keys_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, first, out);
    return 0;
  });
}

// the segments' payloads in a row: codes (packed per segment, each from a byte boundary) and
// the scalars, as terngrad_compress / qsgd_compress / natural_compress make them for each alone
API int grace_cuda_terngrad_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                              const int64_t* numels, const float* u, const int64_t* draw_starts,
                                              uint8_t* out, float* scale, void* stream) {
  cudaStream_t st = as_stream(stream);
  if (segments > 0) cudaMemsetAsync(scale, 0, segments * sizeof(float), st);
  int64_t bytes = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        drawn_segment(t, k, numels[s], starts[s], draw_starts[s], 2, bytes);
        t.q[k] = s;
      },
      [&](SegBatch& t, int64_t) {
        const dim3 max_grid = seg_grid(t, [&](int k) { return red_grid(t.n[k]); });
        k_maxabs_seg<<<max_grid, kThreads, 0, st>>>(t, x, reinterpret_cast<unsigned*>(scale));
        const dim3 grid = per_byte(t);
        k_terngrad_seg<<<grid, kThreads, 0, st>>>(t, x, u, scale, out);
        return 0;
      });
}

API int grace_cuda_natural_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                             const int64_t* numels, const float* u, const int64_t* draw_starts,
                                             uint8_t* signs, uint8_t* codes, void* stream) {
  int64_t bytes = 0, at = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        drawn_segment(t, k, numels[s], starts[s], draw_starts[s], 1, bytes);
        t.q[k] = at;
        at += numels[s];
      },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = per_byte(t);
        k_natural_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, x, u, signs, codes);
        return 0;
      });
}

API int grace_cuda_qsgd_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                          const int64_t* numels, const float* u, const int64_t* draw_starts,
                                          int levels, int64_t bucket, int bits, uint8_t* out, float* norms,
                                          void* stream) {
  if (bits < 1 || bits > 8 || levels < 1 || bucket < 0) return -1;
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 1) return -1;
  cudaStream_t st = as_stream(stream);
  // scratch for the partial sums of the rows longer than 4096
  int64_t slots = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t b = qsgd_row(numels[s], bucket);
    if (b > 4096) slots += qsgd_rows(numels[s], b) * row_chunks(b);
  }
  Scratch sc(slots * sizeof(float), st);
  if (!sc.p) return -3;
  int64_t bytes = 0, row = 0, slot = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        const int64_t n = numels[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
        drawn_segment(t, k, n, starts[s], draw_starts[s], bits, bytes);
        t.q[k] = row;
        t.r[k] = slot;
        row += rows;
        if (b > 4096) slot += rows * row_chunks(b);
      },
      [&](SegBatch& t, int64_t) {
        bool long_rows = false;  // rows longer than 4096: by chunks, then a block per row
        const dim3 norm_grid = seg_grid(t, [&](int k) {
          const int64_t b = qsgd_row(t.n[k], bucket), rows = qsgd_rows(t.n[k], b);
          if (b <= 4096) return (rows * 32 + kThreads - 1) / kThreads;  // a warp per row
          long_rows = true;
          return rows * row_chunks(b);
        });
        float* partial = sc.at<float>(0);
        k_norms_seg<<<norm_grid, kThreads, 0, st>>>(t, x, bucket, norms, partial);
        if (long_rows) {
          const dim3 final_grid = seg_grid(t, [&](int k) {
            const int64_t b = qsgd_row(t.n[k], bucket);
            return b > 4096 ? qsgd_rows(t.n[k], b) : int64_t(1);
          });
          k_norms_final_seg<<<final_grid, kThreads, 0, st>>>(t, bucket, norms, partial);
        }
        const dim3 grid = per_byte(t);
        k_qsgd_seg<<<grid, kThreads, 0, st>>>(t, x, u, (float)levels, bucket, bits, norms, out);
        return 0;
      });
}

// EF-signSGD's (S = 1: the scale) and 1-bit SGD's (S = 3: the two means) bits and scalars of
// every segment, as efsign_compress / onebit_compress make them for each alone
template <int S>
static int sign_compress_segments(const float* x, int64_t segments, const int64_t* starts, const int64_t* numels,
                                  uint8_t* out, float* scalars, cudaStream_t st) {
  int64_t slots = 0;
  for (int64_t s = 0; s < segments; ++s) slots += S * red_grid(numels[s]);
  Scratch sc(slots * sizeof(float), st);
  if (!sc.p) return -3;
  int64_t bytes = 0, slot = 0;
  constexpr int per = S == 1 ? 1 : 2;  // scalars per segment
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = starts[s];
        t.p[k] = bytes;
        t.q[k] = per * s;
        t.r[k] = slot;
        bytes += packed_bytes(numels[s], 1);
        slot += S * red_grid(numels[s]);
      },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = seg_grid(t, [&](int k) { return red_grid(t.n[k]); });
        k_sign_sums_seg<S><<<grid, kThreads, 0, st>>>(t, x, out, sc.at<float>(0));
        k_sign_final_seg<S><<<t.count, 1024, 0, st>>>(t, sc.at<float>(0), scalars);
        return 0;
      });
}

API int grace_cuda_efsign_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                            const int64_t* numels, uint8_t* out, float* scale, void* stream) {
  return sign_compress_segments<1>(x, segments, starts, numels, out, scale, as_stream(stream));
}

API int grace_cuda_onebit_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                            const int64_t* numels, uint8_t* out, float* means, void* stream) {
  return sign_compress_segments<3>(x, segments, starts, numels, out, means, as_stream(stream));
}

// every segment's payload decompressed into the flat out (segments in a row): method 0 sign
// bits (b: a scale per segment, or NULL), 1 1-bit SGD (two means each), 2 TernGrad (a scale
// each), 3 QSGD (its norms), 4 natural compression (a: sign bits, b: codes)
API int grace_cuda_decode_segments(int method, int64_t segments, const int64_t* numels, const uint8_t* a,
                                   const void* b, int levels, int64_t bucket, int bits, float* out, void* stream) {
  if (method < 0 || method > 4 || (method == 3 && (bits < 1 || bits > 8 || levels < 1 || bucket < 0))) return -1;
  const int code_bits = method == 2 ? 2 : (method == 3 ? bits : 1);
  int64_t bytes = 0, at = 0, scalar = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        const int64_t n = numels[s];
        t.n[k] = n;
        t.x[k] = at;
        t.p[k] = bytes;
        t.q[k] = method == 4 ? at : scalar;
        bytes += packed_bytes(n, code_bits);
        at += n;
        scalar += method == 1 ? 2 : (method == 3 ? qsgd_rows(n, qsgd_row(n, bucket)) : 1);
      },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = per_element(t);
        cudaStream_t st = as_stream(stream);
        const float fl = (float)levels;
        switch (method) {
          case 0: k_decode_seg<0><<<grid, kThreads, 0, st>>>(t, a, b, fl, bucket, bits, out); break;
          case 1: k_decode_seg<1><<<grid, kThreads, 0, st>>>(t, a, b, fl, bucket, bits, out); break;
          case 2: k_decode_seg<2><<<grid, kThreads, 0, st>>>(t, a, b, fl, bucket, bits, out); break;
          case 3: k_decode_seg<3><<<grid, kThreads, 0, st>>>(t, a, b, fl, bucket, bits, out); break;
          default: k_decode_seg<4><<<grid, kThreads, 0, st>>>(t, a, b, fl, bucket, bits, out); break;
        }
        return 0;
      });
}

// grace_cuda_topk_ef of every segment (0 <= ks[s] <= numels[s]): p = compensate(g, r) into new_r,
// the ks[s] largest |p| (ties to the lowest index) into values and idx (int64, in the segment)
// from the previous segments' ks on, new_r = 0 where sent; one launch per kernel per 64 segments
API int grace_cuda_topk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                    const int64_t* numels, const int64_t* ks, float beta, float gamma, int flags,
                                    float* values, int64_t* idx, float* new_r, void* stream) {
  int64_t most_tiles = 0;
  for (int64_t s = 0; s < segments; ++s) {
    if (numels[s] < 0 || ks[s] < 0 || ks[s] > numels[s]) return -1;
    most_tiles += tiles_of(numels[s]);
  }
  cudaStream_t st = as_stream(stream);
  const size_t hist_bytes = align256((size_t)kSegBatch * kHistBins * sizeof(unsigned long long));
  const size_t state_bytes = align256(kSegBatch * sizeof(SelState));
  const size_t totals_bytes = align256(2 * kSegBatch * sizeof(long long));
  Scratch sc(hist_bytes + state_bytes + totals_bytes + 2 * std::max<int64_t>(most_tiles, 1) * sizeof(long long), st);
  if (!sc.p) return -3;
  unsigned long long* h = sc.at<unsigned long long>(0);
  SelState* state = sc.at<SelState>(hist_bytes);
  long long* totals = sc.at<long long>(hist_bytes + state_bytes);
  long long* cg = sc.at<long long>(hist_bytes + state_bytes + totals_bytes);
  long long* ce = cg + std::max<int64_t>(most_tiles, 1);
  int64_t sent = 0, tile = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = starts[s];
        t.u[k] = ks[s];
        t.p[k] = sent;
        t.q[k] = tile;
        sent += ks[s];
        tile += tiles_of(numels[s]);
      },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = per_element(t);
        k_compensate_seg<<<grid, kThreads, 0, st>>>(t, g, r, beta, gamma, flags, new_r);
        k_topk_init_seg<<<1, kSegBatch, 0, st>>>(t, state);
        const int shifts[3] = {21, 10, 0}, bins[3] = {2048, 2048, 1024};
        // (segments that send all or nothing select nothing: a block each, which returns)
        const dim3 hist_grid =
            seg_grid(t, [&](int k) { return selects(t, k) ? grid_for(t.n[k], kThreads * 16, 2048) : 1; });
        for (int d = 0; d < 3; ++d) {
          cudaMemsetAsync(h, 0, (size_t)t.count * kHistBins * sizeof(unsigned long long), st);
          k_topk_hist_seg<<<hist_grid, kThreads, 0, st>>>(t, new_r, state, shifts[d], bins[d], h);
          k_topk_find_seg<<<t.count, 32, 0, st>>>(t, h, bins[d], shifts[d], state);
        }
        const dim3 tile_grid = seg_grid(t, [&](int k) { return selects(t, k) ? tiles_of(t.n[k]) : 1; });
        k_topk_count_seg<<<tile_grid, kThreads, 0, st>>>(t, new_r, state, cg, ce);
        k_topk_scan_seg<<<t.count, 1024, 0, st>>>(t, cg, ce, totals);
        const dim3 write_grid = seg_grid(t, [&](int k) {  // all: a thread per element; none: a block
          return t.u[k] >= t.n[k] ? (t.n[k] + kThreads - 1) / kThreads : (t.u[k] > 0 ? tiles_of(t.n[k]) : 1);
        });
        k_topk_write_seg<<<write_grid, kThreads, 0, st>>>(t, new_r, state, cg, ce, idx, values);
        return 0;
      });
}
