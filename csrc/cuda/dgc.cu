// grace CUDA kernels: DGC's momentum correction (see common.cuh; its selection is segments.cu's)
#include "common.cuh"

namespace {
// p = v + (m u + g) into v_out and p - v into u_out (a product, then two sums, as the tensor ops
// round them; outputs may be their inputs)
__global__ void k_dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float* u_out,
                                 float* v_out) {
  GRID_STRIDE(i, n) {
    const float vv = v[i], p = __fadd_rn(vv, __fadd_rn(__fmul_rn(m, u[i]), g[i]));
    u_out[i] = __fsub_rn(p, vv);
    v_out[i] = p;
  }
}
}  // namespace

API void grace_cuda_dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float* u_out,
                                   float* v_out, void* stream) {
  if (n > 0) k_dgc_compensate<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(u, v, g, n, m, u_out, v_out);
}
