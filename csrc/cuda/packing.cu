// grace CUDA kernels: bit packing of codes (see common.cuh)
#include "common.cuh"

namespace {
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
}  // namespace
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
