// grace CUDA kernels: max |x|, TernGrad, QSGD and natural compression (see common.cuh)
#include "quantizers.cuh"

namespace {
__global__ void k_maxabs(const float* x, int64_t n, unsigned* out) { maxabs(x, n, out, blockIdx.x, gridDim.x); }

__global__ void k_terngrad(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out) {
  terngrad(x, u, n, scale, out, blockIdx.x, gridDim.x);
}

__global__ void k_qsgd(const float* x, const float* u, int64_t n, float flevels, int64_t b, int bits,
                       const float* norms, uint8_t* out) {
  qsgd(x, u, n, flevels, b, bits, norms, out, blockIdx.x, gridDim.x);
}

__global__ void k_norms_warp(const float* x, int64_t n, int64_t b, int64_t rows, float* norms) {
  norms_warp(x, n, b, rows, norms, blockIdx.x, gridDim.x);
}

__global__ void k_norms_partial(const float* x, int64_t n, int64_t b, int64_t cpr, float* partial) {
  norms_partial(x, n, b, cpr, partial, blockIdx.x);
}

__global__ void k_norms_final(const float* partial, int64_t cpr, float* norms) {
  norms_final(partial, cpr, norms, blockIdx.x);
}

__global__ void k_natural(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes) {
  natural(x, u, n, signs, codes, blockIdx.x, gridDim.x);
}
}  // namespace
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
