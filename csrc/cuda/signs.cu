// grace CUDA kernels: the sign family (see common.cuh)
#include "signs.cuh"

namespace {
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

template <int S>
__global__ void k_sign_sums(const float* x, int64_t n, uint8_t* out, float* partial) {
  sign_sums<S>(x, n, out, partial, blockIdx.x, gridDim.x);
}

template <int S>
__global__ void k_sign_final(const float* partial, int nblocks, int64_t n, float* result) {
  sign_final<S>(partial, nblocks, n, result);
}
}  // namespace
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
