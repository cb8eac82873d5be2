// grace CUDA kernels: decoders, and the sum of every rank's decoded bits (see common.cuh)
#include "decoders.cuh"

namespace {
__global__ void k_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  sign_decode(packed, n, scale, out, blockIdx.x, gridDim.x);
}

__global__ void k_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out) {
  onebit_decode(packed, n, means, out, blockIdx.x, gridDim.x);
}

__global__ void k_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  terngrad_decode(packed, n, scale, out, blockIdx.x, gridDim.x);
}

__global__ void k_qsgd_decode(const uint8_t* packed, int64_t n, float flevels, int64_t b, int bits,
                              const float* norms, float* out) {
  qsgd_decode(packed, n, flevels, b, bits, norms, out, blockIdx.x, gridDim.x);
}

__global__ void k_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out) {
  natural_decode(signs, codes, n, out, blockIdx.x, gridDim.x);
}
}  // namespace
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
    for (int64_t j = 0; j < count; ++j) {  // mode 3 TernGrad, 2 1-bit SGD (two means), 1 a scale, 0 none
      const uint8_t* bits = packed + j * row;
      const float v = mode == 3   ? terngrad_value(bits, scalars + j, i)
                      : mode == 2 ? onebit_value(bits, scalars + 2 * j, i)
                                  : sign_value(bits, mode == 1 ? scalars + j : nullptr, i);
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
