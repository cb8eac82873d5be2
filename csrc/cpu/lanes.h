// grace CPU kernels: float helpers, 8 float lanes, the overflow check (see common.h)
#pragma once
#include "common.h"

namespace {
// x * x as float32 multiplication rounds it, computed in float64 and rounded once: the same
// float (the exact product of two 24-bit significands fits float64's 53 bits, with no
// underflow), but a product below float32's normal range costs a microcode assist on some CPUs
// (14x slower per instruction on the Intel VM of the benchmarks) where its conversion does not.
// Deep nets' vanishing gradients (1e-20 and below) square to such products.
inline float square(float x) { return (float)((double)x * (double)x); }

// Whether x / d is x * (1 / d) to the bit for every x: d a power of two (both then round the
// same exact value once), and a product costs a fraction of a quotient.
inline bool exact_reciprocal(float d) {
  int e;
  return std::isfinite(d) && d > 0 && std::frexp(d, &e) == 0.5f && std::fpclassify(1.0f / d) == FP_NORMAL;
}

// ---- 8 float lanes: one AVX register, or two SSE ones; each lane does exactly the scalar ----
// code's operations (the comparisons are false for NaN, as the scalar ones)
#ifdef GRACE_SIMD
#if defined(__AVX2__)
struct F8 {
  __m256 a;
};
inline F8 ld8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline F8 set8(float v) { return {_mm256_set1_ps(v)}; }
inline void st8(float* p, F8 x) { _mm256_storeu_ps(p, x.a); }
inline F8 operator+(F8 x, F8 y) { return {_mm256_add_ps(x.a, y.a)}; }
inline F8 operator-(F8 x, F8 y) { return {_mm256_sub_ps(x.a, y.a)}; }
inline F8 operator*(F8 x, F8 y) { return {_mm256_mul_ps(x.a, y.a)}; }
inline F8 operator/(F8 x, F8 y) { return {_mm256_div_ps(x.a, y.a)}; }
// x * x, as square() (in float64, rounded once)
inline F8 square8(F8 x) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x.a)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x.a, 1));
  return {_mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(hi, hi)), _mm256_cvtpd_ps(_mm256_mul_pd(lo, lo)))};
}
inline F8 abs8(F8 x) { return {_mm256_and_ps(x.a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)))}; }
inline F8 floor8(F8 x) { return {_mm256_floor_ps(x.a)}; }
inline F8 ge8(F8 x, F8 y) { return {_mm256_cmp_ps(x.a, y.a, _CMP_GE_OQ)}; }
inline F8 lt8(F8 x, F8 y) { return {_mm256_cmp_ps(x.a, y.a, _CMP_LT_OQ)}; }
inline F8 gt8(F8 x, F8 y) { return {_mm256_cmp_ps(x.a, y.a, _CMP_GT_OQ)}; }
inline F8 nlt8(F8 x, F8 y) { return {_mm256_cmp_ps(x.a, y.a, _CMP_NLT_UQ)}; }  // !(x < y): NaN too
inline F8 bits8(uint8_t b) {  // lane j: all ones where bit j of b is set
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(b), sel), sel))};
}
inline F8 and8(F8 m, F8 x) { return {_mm256_and_ps(m.a, x.a)}; }
inline F8 or8(F8 m, F8 x) { return {_mm256_or_ps(m.a, x.a)}; }
inline F8 sel8(F8 m, F8 x, F8 y) { return {_mm256_blendv_ps(y.a, x.a, m.a)}; }  // m ? x : y
inline int mask8(F8 m) { return _mm256_movemask_ps(m.a); }
// 8 float codes in [0, 255] (or NaN: 0) -> 8 bytes in a word, as (uint8_t)(int)c
inline uint64_t bytes8(F8 c) {
  const __m256i i = _mm256_cvttps_epi32(c.a);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  return (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(h, h));
}
// 16 float lanes as two F8 (for the 8-lane helpers: Finish, put8, FiniteCheck)
GRACE_AVX512 inline F8 low8(__m512 v) { return {_mm512_castps512_ps256(v)}; }
GRACE_AVX512 inline F8 high8(__m512 v) {
  return {_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))};
}
// |v| of 16 lanes (the sign bit cleared, as abs8)
GRACE_AVX512 inline __m512 abs16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}
// 16 floats stored at o, or added to the ones there where kAdd
template <bool kAdd>
GRACE_AVX512 inline void store_or_add16(float* o, __m512 v) {
  _mm512_storeu_ps(o, kAdd ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
}
#else
struct F8 {
  __m128 a, b;
};
inline F8 ld8(const float* p) { return {_mm_loadu_ps(p), _mm_loadu_ps(p + 4)}; }
inline F8 set8(float v) { return {_mm_set1_ps(v), _mm_set1_ps(v)}; }
inline void st8(float* p, F8 x) {
  _mm_storeu_ps(p, x.a);
  _mm_storeu_ps(p + 4, x.b);
}
inline F8 operator+(F8 x, F8 y) { return {_mm_add_ps(x.a, y.a), _mm_add_ps(x.b, y.b)}; }
inline F8 operator-(F8 x, F8 y) { return {_mm_sub_ps(x.a, y.a), _mm_sub_ps(x.b, y.b)}; }
inline F8 operator*(F8 x, F8 y) { return {_mm_mul_ps(x.a, y.a), _mm_mul_ps(x.b, y.b)}; }
inline F8 operator/(F8 x, F8 y) { return {_mm_div_ps(x.a, y.a), _mm_div_ps(x.b, y.b)}; }
inline __m128 square4(__m128 x) {
  const __m128d lo = _mm_cvtps_pd(x), hi = _mm_cvtps_pd(_mm_movehl_ps(x, x));
  return _mm_movelh_ps(_mm_cvtpd_ps(_mm_mul_pd(lo, lo)), _mm_cvtpd_ps(_mm_mul_pd(hi, hi)));
}
// x * x, as square() (in float64, rounded once)
inline F8 square8(F8 x) { return {square4(x.a), square4(x.b)}; }
inline F8 abs8(F8 x) {
  const __m128 m = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  return {_mm_and_ps(x.a, m), _mm_and_ps(x.b, m)};
}
inline F8 floor8(F8 x) { return {_mm_floor_ps(x.a), _mm_floor_ps(x.b)}; }
inline F8 ge8(F8 x, F8 y) { return {_mm_cmpge_ps(x.a, y.a), _mm_cmpge_ps(x.b, y.b)}; }
inline F8 lt8(F8 x, F8 y) { return {_mm_cmplt_ps(x.a, y.a), _mm_cmplt_ps(x.b, y.b)}; }
inline F8 gt8(F8 x, F8 y) { return {_mm_cmpgt_ps(x.a, y.a), _mm_cmpgt_ps(x.b, y.b)}; }
inline F8 nlt8(F8 x, F8 y) { return {_mm_cmpnlt_ps(x.a, y.a), _mm_cmpnlt_ps(x.b, y.b)}; }  // !(x < y): NaN too
inline F8 bits8(uint8_t b) {  // lane j: all ones where bit j of b is set
  const __m128i sel0 = _mm_setr_epi32(1, 2, 4, 8), sel1 = _mm_setr_epi32(16, 32, 64, 128);
  const __m128i bb = _mm_set1_epi32(b);
  return {_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bb, sel0), sel0)),
          _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bb, sel1), sel1))};
}
inline F8 and8(F8 m, F8 x) { return {_mm_and_ps(m.a, x.a), _mm_and_ps(m.b, x.b)}; }
inline F8 or8(F8 m, F8 x) { return {_mm_or_ps(m.a, x.a), _mm_or_ps(m.b, x.b)}; }
inline F8 sel8(F8 m, F8 x, F8 y) { return {_mm_blendv_ps(y.a, x.a, m.a), _mm_blendv_ps(y.b, x.b, m.b)}; }  // m ? x : y
inline int mask8(F8 m) { return _mm_movemask_ps(m.a) | _mm_movemask_ps(m.b) << 4; }
// 8 float codes in [0, 255] (or NaN: 0) -> 8 bytes in a word, as (uint8_t)(int)c
inline uint64_t bytes8(F8 c) {
  __m128i i = _mm_packus_epi32(_mm_cvttps_epi32(c.a), _mm_cvttps_epi32(c.b));
  return (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(i, i));
}
#endif
inline float combine8(F8 r) {  // ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), NumPy's order
  float v[8];
  st8(v, r);
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
inline F8 lane8(int64_t j) {  // all ones in lane j (0-7) only
  alignas(32) static const int32_t ones[16] = {0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return ld8((const float*)ones + 7 - j);
}
inline F8 f8(__m128 lo, __m128 hi) {  // lanes 0-3, then 4-7
#if defined(__AVX2__)
  return {_mm256_set_m128(hi, lo)};
#else
  return {lo, hi};
#endif
}
// 8 floats at p (16-byte aligned when stream), streamed or stored
inline void put8(float* p, F8 x, bool stream) {
  if (!stream) return st8(p, x);
#if defined(__AVX2__)
  _mm_stream_ps(p, _mm256_castps256_ps128(x.a));
  _mm_stream_ps(p + 4, _mm256_extractf128_ps(x.a, 1));
#else
  _mm_stream_ps(p, x.a);
  _mm_stream_ps(p + 4, x.b);
#endif
}
#endif

// ---- the overflow check, folded into a kernel's own pass over its input ------------------------
// x - x is +0 for every finite x and NaN for an inf or a NaN: OR-ed over the elements a kernel
// reads, in its own loop, it tells whether any was not finite at the cost of two instructions per
// 8 elements, where a pass of its own would read the gradient from memory once more (a check of
// each block just after the kernel had read it, from the L1 cache, still cost half the kernel).
class FiniteCheck {
 public:
#ifdef GRACE_SIMD
  void add8(F8 x) { lanes_ = or8(lanes_, x - x); }
#endif
  void add(float x) {
    const float d = x - x;
    uint32_t u;
    std::memcpy(&u, &d, 4);
    one_ |= u;
  }
  void range(const float* x, int64_t lo, int64_t hi) {
    int64_t i = lo;
#ifdef GRACE_SIMD
    F8 acc = lanes_;  // (in a register: a store to lanes_ might alias x, as far as the compiler knows)
    for (; i + 8 <= hi; i += 8) {
      const F8 v = ld8(x + i);
      acc = or8(acc, v - v);
    }
    lanes_ = acc;
#endif
    for (; i < hi; ++i) add(x[i]);
  }
  void merge(const FiniteCheck& other) {
#ifdef GRACE_SIMD
    lanes_ = or8(lanes_, other.lanes_);
#endif
    one_ |= other.one_;
  }
  bool bad() const {
#ifdef GRACE_SIMD
    if (mask8(ge8(lanes_, lanes_)) != 0xff) return true;  // (NaN lanes compare false)
#endif
    return one_ != 0;
  }

 private:
#ifdef GRACE_SIMD
  F8 lanes_ = set8(0.0f);
#endif
  uint32_t one_ = 0;
};
// a chunk's check, told to `bad` where the caller asks (any thread may tell it)
inline void report(const FiniteCheck& c, std::atomic<bool>* bad) {
  if (bad && c.bad()) bad->store(true, std::memory_order_relaxed);
}

// A bucket call's overflow flag (its `nonfinite` argument, may be NULL): 1.0f where any gradient
// holds an inf or a NaN, else 0.0f, written on every return. The kernels that fold the check into
// their pass report to `seen` (a chunk at a time, from any thread); `check` reads the payload
// field that carries every inf and NaN of a step (top-k's values, the sign family's scalars).
class NonfiniteFlag {
 public:
  explicit NonfiniteFlag(float* out) : out_(out) {}
  ~NonfiniteFlag() {
    if (out_) *out_ = seen.load(std::memory_order_relaxed) ? 1.0f : 0.0f;
  }
  std::atomic<bool>* wanted() { return out_ ? &seen : nullptr; }
  void check(const float* x, int64_t n) {
    if (!out_ || seen.load(std::memory_order_relaxed)) return;
    FiniteCheck c;
    c.range(x, 0, n);
    if (c.bad()) seen.store(true, std::memory_order_relaxed);
  }
  std::atomic<bool> seen{false};

 private:
  float* out_;
};
}  // namespace
