// grace CUDA kernels: scatter-add (see common.cuh)
#include "common.cuh"

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

// Whether any rank's frame carries its overflow flag (the block's first thread reads them all).
__device__ __forceinline__ bool block_poisoned(const uint8_t* frames, int ranks, int64_t frame_size,
                                               int64_t flag_at) {
  __shared__ int poisoned;
  if (threadIdx.x == 0) {
    int p = 0;
    for (int r = 0; r < ranks && flag_at >= 0; ++r) p |= frames[r * frame_size + flag_at];
    poisoned = p != 0;
  }
  __syncthreads();
  return poisoned != 0;
}

__global__ void k_frames_fill(const uint8_t* frames, int ranks, int64_t frame_size, int64_t flag_at, int64_t numel,
                              float* out) {
  const float v = block_poisoned(frames, ranks, frame_size, flag_at) ? __int_as_float(0x7fc00000) : 0.0f;
  GRID_STRIDE(i, numel) out[i] = v;
}

// One rank's pairs (the indices of a rank's frame are distinct: no atomics), added to out.
__global__ void k_frame_pairs(const uint8_t* frame, const uint8_t* frames, int ranks, int64_t frame_size,
                              int64_t flag_at, const int64_t* slots, int64_t count, float divisor, int64_t numel,
                              float* out) {
  if (block_poisoned(frames, ranks, frame_size, flag_at)) return;  // (out stays NaN)
  GRID_STRIDE(j, count) {
    const uint8_t* at = frame + slots[count + j];
    uint64_t x = 0;  // byte loads: a narrow index need not be aligned to 8
    for (int b = 0; b < (int)slots[2 * count + j]; ++b) x |= (uint64_t)at[b] << (8 * b);
    const int64_t i = slots[3 * count + j] + (int64_t)x;
    const float v = *reinterpret_cast<const float*>(frame + slots[j]);  // (values lie 4-aligned)
    if (i >= 0 && i < numel) out[i] = __fadd_rn(out[i], __fdiv_rn(v, divisor));
  }
}

// an allreduced sum's mean: 0, or NaN everywhere where the summed flag is above 0
__global__ void k_flagged_fill(const float* flag, int64_t numel, float* out) {
  const float v = flag && *flag > 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
  GRID_STRIDE(i, numel) out[i] = v;
}

// its values / divisor added at their indices (distinct: no atomics)
__global__ void k_sum_pairs(const float* values, const int64_t* idx, int64_t count, float divisor, const float* flag,
                            int64_t numel, float* out) {
  if (flag && *flag > 0.0f) return;  // (out stays NaN)
  GRID_STRIDE(j, count) {
    const int64_t i = idx[j];
    if (i >= 0 && i < numel) out[i] = __fadd_rn(out[i], __fdiv_rn(values[j], divisor));
  }
}
}  // namespace

API int grace_cuda_sparse_sum_mean(const float* values, const int64_t* idx, int64_t count, float divisor,
                                   const float* flag, int64_t numel, float* out, void* stream) {
  if (count < 0 || numel < 0) return -1;
  cudaStream_t s = as_stream(stream);
  if (numel == 0) return status();
  k_flagged_fill<<<grid_for(numel), kThreads, 0, s>>>(flag, numel, out);
  if (count > 0) k_sum_pairs<<<grid_for(count), kThreads, 0, s>>>(values, idx, count, divisor, flag, numel, out);
  return status();
}

API int grace_cuda_sparse_frames_mean(const uint8_t* frames, int ranks, int64_t frame_size, const int64_t* slots,
                                      int64_t count, int64_t flag_at, float divisor, int64_t numel, float* out,
                                      void* stream) {
  if (ranks < 0 || count < 0 || numel < 0 || frame_size < 0) return -1;
  cudaStream_t s = as_stream(stream);
  if (numel == 0) return status();
  k_frames_fill<<<grid_for(numel), kThreads, 0, s>>>(frames, ranks, frame_size, flag_at, numel, out);
  for (int r = 0; r < ranks && count > 0; ++r)
    k_frame_pairs<<<grid_for(count), kThreads, 0, s>>>(frames + r * frame_size, frames, ranks, frame_size, flag_at,
                                                       slots, count, divisor, numel, out);
  return status();
}

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
