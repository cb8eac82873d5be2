// grace CPU kernels: half precision (see common.h)
#include "lanes.h"

// ---- half precision: fp16's payload, a bucket at a time -----------------------------------------
namespace {
// float -> IEEE half, rounded to nearest even as torch's and NumPy's casts round; a NaN becomes
// the quiet NaN 0x7E00 with its sign (F16C, where built, keeps a NaN's top payload bits instead:
// the same for the NaNs arithmetic makes)
inline uint16_t to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to inf
  if (a >= 0x38800000u) {  // a normal half: the exponent rebased, 13 bits rounded off (ties to even)
    a += 0xC8000FFFu + ((a >> 13) & 1u);
    return sign | (uint16_t)(a >> 13);
  }
  // subnormal (or zero): m * 2^-24 with m rounded to nearest even; m = 1024 is the least normal
  return sign | (uint16_t)std::nearbyint(std::fabs(f) * 16777216.0f);
}

inline float from_half(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {  // zero or subnormal: exact
    const float v = (float)m * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (e == 0x1F ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The vector loops below stream their stores where `kStream` (the call's outputs beyond the
// caches, common.h): the leading elements up to a 32-byte boundary go the scalar way, the same values.
// They read one stream each, which the hardware prefetcher follows: no prefetch of their own (one
// every 8 elements made the encoding ~10% slower on an AMD EPYC, measured).
template <bool kReciprocal, bool kStream>
void half_encode(const float* x, int64_t n, float divisor, uint16_t* out) {
  int64_t i = 0;
  auto one = [&](int64_t j) { out[j] = to_half(x[j] / divisor); };
#if defined(__F16C__) && defined(__AVX__)
  if (kStream)
    for (; i < n && (uintptr_t)(out + i) % 32 != 0; ++i) one(i);
  const __m256 d = _mm256_set1_ps(kReciprocal ? 1.0f / divisor : divisor);
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i), v = kReciprocal ? _mm256_mul_ps(xi, d) : _mm256_div_ps(xi, d);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (kStream)
      _mm_stream_si128((__m128i*)(out + i), h);
    else
      _mm_storeu_si128((__m128i*)(out + i), h);
  }
  fence_streams(kStream);
#endif
  for (; i < n; ++i) one(i);
}

template <bool kReciprocal, bool kStream>
void half_decode(const uint16_t* h, int64_t n, float factor, float divisor, float* out) {
  int64_t i = 0;
  auto one = [&](int64_t j) { out[j] = from_half(h[j]) * factor / divisor; };
#if defined(__F16C__) && defined(__AVX__)
  if (kStream)
    for (; i < n && (uintptr_t)(out + i) % 32 != 0; ++i) one(i);
  const __m256 f = _mm256_set1_ps(factor), d = _mm256_set1_ps(kReciprocal ? 1.0f / divisor : divisor);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))), f);
    const __m256 r = kReciprocal ? _mm256_mul_ps(v, d) : _mm256_div_ps(v, d);
    if (kStream)
      _mm256_stream_ps(out + i, r);
    else
      _mm256_storeu_ps(out + i, r);
  }
  fence_streams(kStream);
#endif
  for (; i < n; ++i) one(i);
}

// the kernel for a call: reciprocal where exact; streaming where `s`
template <class Kernel>
Kernel pick(Kernel plain, Kernel reciprocal, Kernel stream, Kernel both, float divisor, bool s) {
  const bool r = exact_reciprocal(divisor);
  return s ? (r ? both : stream) : (r ? reciprocal : plain);
}
}  // namespace

API void grace_cpu_half_encode_many(int64_t count, const float* const* xs, const int64_t* numels, float divisor,
                                    uint16_t* const* outs, int64_t held) {
  const int64_t halves = bucket_bytes(count, numels) / 2;
  const auto encode = pick(half_encode<false, false>, half_encode<true, false>, half_encode<false, true>,
                           half_encode<true, true>, divisor, streams_payload(std::max(halves, held)));
  for_segment_chunks(count, numels, 64, [&](int64_t s, int64_t lo, int64_t hi) {
    encode(xs[s] + lo, hi - lo, divisor, outs[s] + lo);
  });
}

// ---- a bucket's sums divided, and its overflow check (PowerSGD's vectors: one call each, not ops
// per vector) -------------------------------------------------------------------------------------
API void grace_cpu_divide_many(int64_t count, const float* const* xs, const int64_t* numels, float divisor,
                               float* const* outs) {
  for_segment_chunks(count, numels, 64, [&](int64_t s, int64_t lo, int64_t hi) {
    const float* const x = xs[s];
    float* const out = outs[s];
    for (int64_t i = lo; i < hi; ++i) out[i] = x[i] / divisor;
  });
}

API void grace_cpu_flag_nonfinite_many(int64_t count, const float* const* xs, const int64_t* numels, float* flag) {
  std::atomic<bool> bad{false};
  for_segment_chunks(count, numels, 64, [&](int64_t s, int64_t lo, int64_t hi) {
    FiniteCheck check;
    check.range(xs[s], lo, hi);
    report(check, &bad);
  });
  if (bad.load()) *flag = 1.0f;
}

API void grace_cpu_half_decode_many(int64_t count, const uint16_t* const* halves, const int64_t* numels, float factor,
                                    float divisor, float* const* outs) {
  const auto decode = pick(half_decode<false, false>, half_decode<true, false>, half_decode<false, true>,
                           half_decode<true, true>, divisor, bucket_bytes(count, numels) >= kStreamBytes);
  for_segment_chunks(count, numels, 64, [&](int64_t s, int64_t lo, int64_t hi) {
    decode(halves[s] + lo, hi - lo, factor, divisor, outs[s] + lo);
  });
}
