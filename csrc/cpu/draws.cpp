// grace CPU kernels: counter-based uniform draws (see common.h)
#include "draws.h"

// ---- counter-based uniform draws --------------------------------------------------------------
namespace {
#if defined(GRACE_SIMD) && defined(__AVX2__)
// The draws of [j, end) 16 at a time with AVX-512, where the CPU has it (the same integer hash
// and conversion as the 8-lane loop below, so the same floats): the draws are bound by their
// multiplications, and twice the lanes take the same instructions. Returns where it stopped.
GRACE_AVX512 int64_t uniform_range16(int64_t j, int64_t end, int64_t lo, uint32_t s0,
                                                           uint32_t s1, float* out) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                c1 = _mm512_set1_epi32(0x21F0AAAD), c2 = _mm512_set1_epi32(0x735A2D97),
                w0 = _mm512_set1_epi32((int)s0), w1 = _mm512_set1_epi32((int)s1);
  const __m512 unit = _mm512_set1_ps(1.0f / 16777216.0f);
  for (; j + 16 <= end; j += 16) {
    __m512i h = _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)j), lane), w0);
    for (int round = 0; round < 2; ++round) {  // hash32(hash32(j ^ s0) ^ s1)
      if (round) h = _mm512_xor_si512(h, w1);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
      h = _mm512_mullo_epi32(h, c1);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
      h = _mm512_mullo_epi32(h, c2);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    }
    _mm512_storeu_ps(out + j - lo, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), unit));
  }
  return j;
}
#endif
}  // namespace

namespace grace_cpu {
void uniform_range(int64_t lo, int64_t hi, uint32_t s0, uint32_t s1, float* out) {
  int64_t j = lo;
#if defined(GRACE_SIMD) && defined(__AVX2__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), c1 = _mm256_set1_epi32(0x21F0AAAD),
                c2 = _mm256_set1_epi32(0x735A2D97), w0 = _mm256_set1_epi32((int)s0), w1 = _mm256_set1_epi32((int)s1);
  const __m256 unit = _mm256_set1_ps(1.0f / 16777216.0f);
  auto h8 = [&](__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, c1);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, c2);
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  };
  const int64_t simd_end = std::min<int64_t>(hi, (int64_t)1 << 32);  // (j in 32 bits)
  if (kAvx512) j = uniform_range16(j, simd_end, lo, s0, s1, out);
  for (; j + 8 <= simd_end; j += 8) {
    const __m256i jj = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)j), lane);
    const __m256i h = h8(_mm256_xor_si256(h8(_mm256_xor_si256(jj, w0)), w1));
    _mm256_storeu_ps(out + j - lo, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), unit));
  }
#endif
  for (; j < hi; ++j) out[j - lo] = (float)(hash32(hash32((uint64_t)j ^ s0) ^ s1) >> 8) * (1.0f / 16777216.0f);
}
}  // namespace grace_cpu
