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
