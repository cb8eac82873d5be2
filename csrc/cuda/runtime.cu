// grace CUDA kernels: the library's own calls (ABI, devices) and the memory pool's setting (see
// common.cuh)
#include "common.cuh"

namespace grace_cuda {
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
}  // namespace grace_cuda
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
