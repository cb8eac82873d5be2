// grace CPU kernels: TernGrad, QSGD and natural compression, with the draws given or made where
// they are used (see common.h)
#include "bitpack.h"
#include "draws.h"
#include "signs.h"

// ---- terngrad --------------------------------------------------------------------------------
namespace {
// bit j of a byte -> bit 2j of a 16-bit word
struct Spread {
  uint16_t v[256];
  Spread() {
    for (int b = 0; b < 256; ++b) {
      uint16_t w = 0;
      for (int j = 0; j < 8; ++j) w |= (uint16_t)(((b >> j) & 1) << (2 * j));
      v[b] = w;
    }
  }
  uint16_t operator[](int b) const { return v[b]; }
};
const Spread kSpread;

// code 1 (+s) or 2 (-s) where u < |v| / s, else 0
inline uint32_t terngrad_code(float v, float u, float safe) {
  return u < std::fabs(v) / safe ? (v < 0.0f ? 2u : 1u) : 0u;
}
}  // namespace

namespace {
// the largest magnitude's bits in x[0, n): compared as unsigned integers, the magnitude bits
// order the floats, with inf above every number and NaN above inf
uint32_t max_magnitude_bits(const float* x, int64_t n) {
  int nt = threads_for(n);
  std::vector<uint32_t> part(nt, 0);
  for_chunks(n, 64, nt, [&](int c, int64_t lo, int64_t hi) {
    uint32_t m = 0;
    int64_t i = lo;
#if defined(GRACE_SIMD) && defined(__AVX2__)
    // four running maxima: no chain of dependent max operations per load
    const __m256i mag = _mm256_set1_epi32(0x7fffffff);
    __m256i v0 = _mm256_setzero_si256(), v1 = v0, v2 = v0, v3 = v0;
    auto at = [&](int64_t j) { return _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + j)), mag); };
    for (; i + 32 <= hi; i += 32) {
      v0 = _mm256_max_epu32(v0, at(i));
      v1 = _mm256_max_epu32(v1, at(i + 8));
      v2 = _mm256_max_epu32(v2, at(i + 16));
      v3 = _mm256_max_epu32(v3, at(i + 24));
    }
    for (; i + 8 <= hi; i += 8) v0 = _mm256_max_epu32(v0, at(i));
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256((__m256i*)lanes, _mm256_max_epu32(_mm256_max_epu32(v0, v1), _mm256_max_epu32(v2, v3)));
    for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
#elif defined(GRACE_SIMD)
    __m128i vm = _mm_setzero_si128(), vn = vm;
    const __m128i mag = _mm_set1_epi32(0x7fffffff);
    for (; i + 8 <= hi; i += 8) {
      vm = _mm_max_epu32(vm, _mm_and_si128(_mm_loadu_si128((const __m128i*)(x + i)), mag));
      vn = _mm_max_epu32(vn, _mm_and_si128(_mm_loadu_si128((const __m128i*)(x + i + 4)), mag));
    }
    uint32_t lanes[4];
    _mm_storeu_si128((__m128i*)lanes, _mm_max_epu32(vm, vn));
    for (int j = 0; j < 4; ++j) m = std::max(m, lanes[j]);
#endif
    for (; i < hi; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      m = std::max(m, u & 0x7fffffffu);
    }
    part[c] = m;
  });
  uint32_t m = 0;
  for (int c = 0; c < nt; ++c) m = std::max(m, part[c]);
  return m;
}
}  // namespace

// max |x| as np.max: NaN if any element is NaN, 0 for an empty tensor
API void grace_cpu_maxabs(const float* x, int64_t n, float* out) {
  uint32_t m = max_magnitude_bits(x, n);
  if (m > 0x7f800000u) m = 0x7fc00000u;  // NaN
  std::memcpy(out, &m, 4);
}

namespace {
#if defined(GRACE_SIMD) && defined(__AVX2__)
// terngrad_groups' groups [g, g1) two at a time (16 elements) with AVX-512: the same decision
// (the product where every lane is clear of it, else the division) on 16 lanes; the kept
// lanes' masks spread to the codes' bits by pdep. Returns where it stopped.
GRACE_AVX512 int64_t terngrad_groups16(const float* x, const float* u, int64_t ubase, float safe, int64_t g,
                                       int64_t g1, uint8_t* out) {
  const __m512 vsafe = _mm512_set1_ps(safe), vinv = _mm512_set1_ps(1.0f / safe), zero = _mm512_setzero_ps();
  const __m512 margin = _mm512_set1_ps(0x1p-21f), floor_eps = _mm512_set1_ps(0x1p-100f);
  const bool exact_only = !(safe >= 0x1p-100f && safe <= 0x1p100f);
  for (; g + 2 <= g1; g += 2) {
    const float* const ug = u + (8 * g - ubase);
    prefetch(x + 8 * g);
    prefetch(ug);
    const __m512 v = _mm512_loadu_ps(x + 8 * g), uu = _mm512_loadu_ps(ug), a = abs16(v);
    const __m512 q = _mm512_mul_ps(a, vinv), eps = _mm512_add_ps(_mm512_mul_ps(q, margin), floor_eps);
    __mmask16 keep = _mm512_cmp_ps_mask(uu, q, _CMP_LT_OQ);
    if (exact_only || _mm512_cmp_ps_mask(abs16(_mm512_sub_ps(uu, q)), eps, _CMP_GT_OQ) != 0xffff)
      keep = _mm512_cmp_ps_mask(uu, _mm512_div_ps(a, vsafe), _CMP_LT_OQ);
    const uint32_t k = keep, neg = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
    // code 1 (bit 2j) for kept non-negatives, 2 (bit 2j+1) for kept negatives
    const uint32_t w = _pdep_u32(k & ~neg, 0x55555555u) | _pdep_u32(k & neg, 0xAAAAAAAAu);
    std::memcpy(out + 2 * g, &w, 4);
  }
  return g;
}
#endif

// groups [g0, g1) (8 whole elements each) of terngrad_compress with the bound s > 0 (or s + 1);
// element i's draw is u[i - ubase]
void terngrad_groups(const float* x, const float* u, int64_t ubase, float safe, int64_t g0, int64_t g1,
                     uint8_t* out) {
#if defined(GRACE_SIMD) && defined(__AVX2__)
  if (kAvx512) g0 = terngrad_groups16(x, u, ubase, safe, g0, g1, out);
#endif
#ifdef GRACE_SIMD
  // u < |v| / s decided by the product q = |v| (1/s) where u is clearly away from it: 1/s
  // and q are each rounded once, so q lies within 2^-22 q of the quotient while 1/s is a
  // normal float; the margin is 2^-21 q + 2^-100 (the floor covers products that lost bits
  // to underflow). Close calls, NaN and inf take the division itself.
  const F8 vsafe = set8(safe), vinv = set8(1.0f / safe), zero = set8(0.0f);
  const F8 margin = set8(0x1p-21f), floor_eps = set8(0x1p-100f);
  const bool exact_only = !(safe >= 0x1p-100f && safe <= 0x1p100f);  // 1/s must be a normal float
  for (int64_t g = g0; g < g1; ++g) {
    const float* const ug = u + (8 * g - ubase);
    if (!(g & 1)) {  // two input streams: one line of each every 16 elements
      prefetch(x + 8 * g);
      prefetch(ug);
    }
    F8 v = ld8(x + 8 * g), uu = ld8(ug), a = abs8(v);
    F8 q = a * vinv, eps = q * margin + floor_eps;
    F8 keep = lt8(uu, q);
    if (exact_only || mask8(gt8(abs8(uu - q), eps)) != 0xff) keep = lt8(uu, a / vsafe);
    int k = mask8(keep), neg = mask8(lt8(v, zero));
    // code 1 (bit 2j) for kept non-negatives, 2 (bit 2j+1) for kept negatives
    uint16_t w16 = (uint16_t)(kSpread[k & ~neg] | kSpread[k & neg] << 1);
    std::memcpy(out + 2 * g, &w16, 2);
  }
#else
  for (int64_t g = g0; g < g1; ++g) {
    uint32_t w = 0;
    for (int j = 0; j < 8; ++j) w |= terngrad_code(x[8 * g + j], u[8 * g + j - ubase], safe) << (2 * j);
    uint16_t w16 = (uint16_t)w;
    std::memcpy(out + 2 * g, &w16, 2);
  }
#endif
}

// the last n % 8 elements' codes (after `full` whole groups); element i's draw is u[i - ubase]
void terngrad_tail(const float* x, const float* u, int64_t ubase, int64_t n, float safe, uint8_t* out) {
  const int64_t full = n / 8, rem = n % 8;
  if (!rem) return;
  uint32_t w = 0;
  for (int j = 0; j < rem; ++j) w |= terngrad_code(x[8 * full + j], u[8 * full + j - ubase], safe) << (2 * j);
  uint16_t w16 = (uint16_t)w;
  std::memcpy(out + 2 * full, &w16, (rem * 2 + 7) / 8);
}

inline float terngrad_bound(float s) { return s > 0.0f ? s : s + 1.0f; }
}  // namespace

API void grace_cpu_terngrad_compress(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out) {
  const float safe = terngrad_bound(scale[0]);
  for_chunks(n / 8, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    terngrad_groups(x, u, 0, safe, g0, g1, out);
  });
  terngrad_tail(x, u, 0, n, safe, out);
}

// ---- QSGD ------------------------------------------------------------------------------------
namespace {
// x^2 of a bucket's elements (x from its start); Padded: zeros from `valid` on, the padding of
// grace/compressors/qsgd.py (the tensor's last bucket)
template <bool Padded>
struct SquareTerms {
  const float* x;
  int64_t valid;
  void operator()(int64_t i, float* t) const {
    const float v = !Padded || i < valid ? x[i] : 0.0f;
    t[0] = square(v);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    if (!(i & 15)) prefetch(x + i);
    F8 v;
    if (!Padded || i + 8 <= valid) {
      v = ld8(x + i);
    } else {
      float p[8];
      for (int j = 0; j < 8; ++j) p[j] = i + j < valid ? x[i + j] : 0.0f;
      v = ld8(p);
    }
    t[0] = square8(v);
  }
#endif
};

// norm of bucket [start, start + b) of x[0, n): sqrt of NumPy's pairwise sum of squares over b
// elements, the ones past the tensor's end being the zero padding; nt threads
inline float bucket_norm(const float* x, int64_t n, int64_t start, int64_t b, int nt = 1) {
  const int64_t valid = std::min(b, n - start);
  return std::sqrt(valid == b ? pairwise_sums<1>(SquareTerms<false>{x + start, valid}, b, nt).v[0]
                              : pairwise_sums<1>(SquareTerms<true>{x + start, valid}, b, nt).v[0]);
}

// buckets of up to this many elements (in cache) get their norm in the pass that makes their codes
constexpr int64_t kFusedBucket = 1 << 15;

inline float safe_norm(float norm) { return norm > 0.0f ? norm : norm + 1.0f; }

// r = |x| * s / norm, l = floor(r), level = l + (u < r - l), minus one past s (a rounding
// error); code = level * 2 + (x < 0), 0 where r is NaN: grace/compressors/qsgd.py's operations
inline uint8_t qsgd_code(float v, float u, float safe, float flevels) {
  float r = std::fabs(v) * flevels / safe;
  float low = std::floor(r);
  float level = low + (u < r - low ? 1.0f : 0.0f);
  level = level - (level > flevels ? 1.0f : 0.0f);
  float c = level * 2.0f + (v < 0.0f ? 1.0f : 0.0f);
  return c == c ? (uint8_t)(int)c : (uint8_t)0;
}

#ifdef GRACE_SIMD
// qsgd_code of 8 elements at a time, as 16-bit lanes: the float operations as above, the rest
// exact in integers
struct QsgdLanes {
  __m128 safe, flevels;
  __m128i levels;
  QsgdLanes(float safe_, int levels_)
      : safe(_mm_set1_ps(safe_)), flevels(_mm_set1_ps((float)levels_)), levels(_mm_set1_epi16((short)levels_)) {}

  // l + (u < r - l), as int32: l = floor(r) by truncation (r >= 0), INT_MIN where r is NaN;
  // neg: -1 where x < 0
  __m128i level4(const float* x, const float* u, __m128i& neg) const {
    const __m128 v = _mm_loadu_ps(x);
    const __m128 r = _mm_div_ps(_mm_mul_ps(_mm_and_ps(v, _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff))), flevels), safe);
    const __m128i li = _mm_cvttps_epi32(r);
    const __m128 up = _mm_cmplt_ps(_mm_loadu_ps(u), _mm_sub_ps(r, _mm_cvtepi32_ps(li)));
    neg = _mm_castps_si128(_mm_cmplt_ps(v, _mm_setzero_ps()));
    return _mm_sub_epi32(li, _mm_castps_si128(up));  // up: -1 where true
  }

  // level minus one past s, times 2, plus (x < 0); NaN r: INT_MIN, which the saturating steps
  // keep negative and packus makes code 0
  __m128i codes8(const float* x, const float* u) const {
    __m128i n0, n1;
    const __m128i l0 = level4(x, u, n0), l1 = level4(x + 4, u + 4, n1);
    __m128i level = _mm_packs_epi32(l0, l1);
    level = _mm_add_epi16(level, _mm_cmpgt_epi16(level, levels));
    return _mm_sub_epi16(_mm_adds_epi16(level, level), _mm_packs_epi32(n0, n1));
  }
};
#endif

#if defined(GRACE_SIMD) && defined(__AVX2__)
// qsgd_pack_groups' groups [g, whole) of one bucket two at a time (16 codes) with AVX-512: the
// float operations of QsgdLanes in 16 lanes, narrowed to 16-bit lanes with the same signed
// saturation as its packs, then its 16-bit steps. Returns where it stopped.
template <int B>
GRACE_AVX512 int64_t qsgd_pack_groups16(const float* x, const float* u, int64_t ubase, float safe, int levels,
                                        uint8_t* out, int64_t g, int64_t whole, int64_t gw) {
  const __m512 vsafe = _mm512_set1_ps(safe), flevels = _mm512_set1_ps((float)levels), zero = _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(1);
  const __m256i levels16 = _mm256_set1_epi16((short)levels);
  for (; g + 2 <= whole; g += 2) {
    const int64_t i = 8 * g;
    prefetch(x + i);
    prefetch(u + (i - ubase));
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 r = _mm512_div_ps(_mm512_mul_ps(abs16(v), flevels), vsafe);
    const __m512i low = _mm512_cvttps_epi32(r);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_loadu_ps(u + (i - ubase)), _mm512_sub_ps(r, _mm512_cvtepi32_ps(low)),
                                            _CMP_LT_OQ);
    __m256i level = _mm512_cvtsepi32_epi16(_mm512_mask_add_epi32(low, up, low, one));
    level = _mm256_add_epi16(level, _mm256_cmpgt_epi16(level, levels16));
    const __m256i neg = _mm512_cvtsepi32_epi16(_mm512_maskz_set1_epi32(_mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), -1));
    const __m256i code = _mm256_sub_epi16(_mm256_adds_epi16(level, level), neg);
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    put16<B>(out, g, gw, pack16<B>(bytes));
  }
  return g;
}
#endif

// codes of elements [g0*8, g1*8) ∩ [0, n) packed at B bits (group-aligned), bucket by bucket;
// element i's draw is u[i - ubase]
template <int B>
void qsgd_pack_groups(const float* x, const float* u, int64_t ubase, int64_t n, int levels, int64_t b,
                      const float* norms, uint8_t* out, int64_t g0, int64_t g1) {
  const float flevels = (float)levels;
  const int64_t gw = std::min(g1, n / 8);  // whole groups (put_group stays within them)
  int64_t g = g0;
  while (g < g1) {
    const int64_t row = 8 * g / b, end = std::min(n, (row + 1) * b);  // the bucket of group g
    const float safe = safe_norm(norms[row]);
    const int64_t whole = std::min(g1, end / 8);  // groups [g, whole) lie in this bucket
#ifdef GRACE_SIMD
    const QsgdLanes q(safe, levels);
#if defined(__AVX2__)
    if (kAvx512) g = qsgd_pack_groups16<B>(x, u, ubase, safe, levels, out, g, whole, gw);
#endif
    for (; g + 2 <= whole; g += 2) {  // 16 codes at a time
      const int64_t i = 8 * g;
      prefetch(x + i);
      const float* const ui = u + (i - ubase);
      prefetch(ui);
      put16<B>(out, g, gw, pack16<B>(_mm_packus_epi16(q.codes8(x + i, ui), q.codes8(x + i + 8, ui + 8))));
    }
    if (g < whole) {
      const __m128i c = _mm_packus_epi16(q.codes8(x + 8 * g, u + (8 * g - ubase)), _mm_setzero_si128());
      put_group<B>(out, g, gw, (uint64_t)_mm_cvtsi128_si64(pack16<B>(c)));
      ++g;
    }
#else
    for (; g < whole; ++g) {
      uint8_t c[8];
      for (int j = 0; j < 8; ++j) c[j] = qsgd_code(x[8 * g + j], u[8 * g + j - ubase], safe, flevels);
      put_group<B>(out, g, gw, pack_word<B>(load_u64(c)));
    }
#endif
    if (g < g1 && 8 * g < end) {  // a group across a bucket's end or at the tensor's end
      const int64_t i0 = 8 * g;
      const int m = (int)std::min<int64_t>(8, n - i0);
      uint8_t c[8] = {0};
      for (int j = 0; j < m; ++j)
        c[j] = qsgd_code(x[i0 + j], u[i0 + j - ubase], safe_norm(norms[(i0 + j) / b]), flevels);
      uint64_t w = pack_word<B>(load_u64(c));
      std::memcpy(out + g * B, &w, (m * B + 7) / 8);
      ++g;
    }
  }
}
}  // namespace

API void grace_cpu_qsgd_norms(const float* x, int64_t n, int64_t bucket, float* norms) {
  int64_t b = qsgd_row(n, bucket);
  int64_t rows = (n + b - 1) / b;
  if (n == 0) rows = 1;
  int nt = threads_for(rows * b);
  if (rows >= 4 * nt || nt == 1) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r) norms[r] = bucket_norm(x, n, r * b, b);
  } else {
    for (int64_t r = 0; r < rows; ++r) norms[r] = bucket_norm(x, n, r * b, b, nt);
  }
}

namespace {
// grace_cpu_qsgd_compress with the draws of groups [g0, g1) handed over by
// draws(g0, g1, f): f(u, ubase, g, ge) on pieces [g, ge), element i's draw at u[i - ubase]
template <class Draws>
int qsgd_compress(const float* x, int64_t n, int levels, int64_t bucket, int bits, float* norms, int have_norms,
                  uint8_t* out, const Draws& draws) {
  if (bits < 1 || bits > 8 || levels < 1 || 2 * (levels + 1) > (1 << bits) + 1 || n < 0) return -1;
  if (n == 0) return 0;
  const int64_t b = qsgd_row(n, bucket);
  const int64_t rows = (n + b - 1) / b, groups = (n + 7) / 8;
  const int nt = threads_for(n);
  const bool fused = !have_norms && b % 8 == 0 && b <= kFusedBucket && (rows >= 4 * nt || nt == 1);
  if (!have_norms && !fused) grace_cpu_qsgd_norms(x, n, bucket, norms);
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    auto pack = [&](const float* u, int64_t ubase, int64_t g0, int64_t g1) {
      qsgd_pack_groups<B>(x, u, ubase, n, levels, b, norms, out, g0, g1);
    };
    if (fused) {
      for_chunks(rows, 1, nt, [&](int, int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          norms[r] = bucket_norm(x, n, r * b, b);
          draws(r * (b / 8), std::min(groups, (r + 1) * (b / 8)), pack);
        }
      });
    } else {
      for_chunks(groups, 1, nt, [&](int, int64_t g0, int64_t g1) { draws(g0, g1, pack); });
    }
  });
  return 0;
}
}  // namespace

// u: one draw per element; norms: one per bucket, given (have_norms) or written here: bucket by
// bucket in the same pass as its codes (the bucket still in cache) where buckets are short
// and hold whole groups, else grace_cpu_qsgd_norms first
API int grace_cpu_qsgd_compress(const float* x, const float* u, int64_t n, int levels, int64_t bucket, int bits,
                                float* norms, int have_norms, uint8_t* out) {
  return qsgd_compress(x, n, levels, bucket, bits, norms, have_norms, out,
                       [&](int64_t g0, int64_t g1, const auto& f) { f(u, 0, g0, g1); });
}

// ---- natural compression ---------------------------------------------------------------------
// code = biased exponent of |x| (0 below 2**-126), plus one with probability equal to the
// mantissa fraction (never past 254); exactly grace/compressors/natural.py for finite x.
namespace {
inline uint8_t natural_code(float v, float u) {
  uint32_t bits_;
  std::memcpy(&bits_, &v, 4);
  uint32_t e = (bits_ >> 23) & 0xff;
  uint32_t mant = bits_ & 0x7fffff;
  if (e >= 254) return 254;  // 2**127 and up (the numerator's 2**128 is not a float32); inf
  float frac = (float)mant * 0x1p-23f;
  return (uint8_t)(e + (u < frac ? 1 : 0));
}
}  // namespace

namespace {
#if defined(GRACE_SIMD) && defined(__AVX2__)
// natural_groups' whole groups [g, g1) two at a time (16 elements) with AVX-512: the same
// integer and float steps; the sign byte pair is the mask of the lanes below 0. Returns where
// it stopped.
GRACE_AVX512 int64_t natural_groups16(const float* x, const float* u, int64_t ubase, int64_t g, int64_t g1,
                                      uint8_t* signs, uint8_t* codes, FiniteCheck& check) {
  const __m512i ff = _mm512_set1_epi32(0xff), mm = _mm512_set1_epi32(0x7fffff), top = _mm512_set1_epi32(254);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 scale = _mm512_set1_ps(0x1p-23f), zero = _mm512_setzero_ps();
  __m512i seen = _mm512_setzero_si512();  // x - x of every element, or-ed: FiniteCheck's lanes
  for (; g + 2 <= g1; g += 2) {
    const int64_t i0 = 8 * g;
    const float* const ug = u + (i0 - ubase);
    prefetch(x + i0);
    prefetch(ug);
    const __m512 v = _mm512_loadu_ps(x + i0);
    seen = _mm512_or_si512(seen, _mm512_castps_si512(_mm512_sub_ps(v, v)));
    const __m512i b = _mm512_castps_si512(v);
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, 23), ff);
    const __m512 frac = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, mm)), scale);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_loadu_ps(ug), frac, _CMP_LT_OQ);
    const __m512i c = _mm512_min_epi32(_mm512_mask_add_epi32(e, up, e, one), top);  // e >= 254: 254
    _mm_storeu_si128((__m128i*)(codes + i0), _mm512_cvtepi32_epi8(c));               // (c in [0, 254])
    const uint16_t neg = (uint16_t)_mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
    std::memcpy(signs + g, &neg, 2);
  }
  const __m512 s = _mm512_castsi512_ps(seen);
  check.add8(low8(s));
  check.add8(high8(s));
  return g;
}
#endif

// groups [g0, g1) (8 elements each) of natural_compress; element i's draw is u[i - ubase]; the
// elements into `check`
void natural_groups(const float* x, const float* u, int64_t ubase, int64_t n, int64_t g0, int64_t g1,
                    uint8_t* signs, uint8_t* codes, FiniteCheck& check) {
  FiniteCheck local;  // (in registers: the stores below may alias `check`, as far as the compiler knows)
  int64_t g16 = g0;
#if defined(GRACE_SIMD) && defined(__AVX2__)
  if (kAvx512) g16 = natural_groups16(x, u, ubase, g0, std::min(g1, n / 8), signs, codes, local);
#endif
  for (int64_t g = g16; g < g1; ++g) {
    const int64_t i0 = 8 * g;
    const float* const ug = u + (i0 - ubase);  // element i0's draw and the next ones
    if (i0 + 8 <= n) {
#ifdef GRACE_SIMD
      local.add8(ld8(x + i0));
      if (!(g & 1)) {  // two input streams: one line of each every 16 elements
        prefetch(x + i0);
        prefetch(ug);
      }
      // e = biased exponent; + (u < mantissa fraction), except e >= 254: 254
      const __m128i ff = _mm_set1_epi32(0xff), mm = _mm_set1_epi32(0x7fffff), top = _mm_set1_epi32(254);
      const __m128 scale = _mm_set1_ps(0x1p-23f);
      __m128i c2[2];
      int neg = 0;
      for (int h = 0; h < 2; ++h) {
        __m128 v = _mm_loadu_ps(x + i0 + 4 * h);
        __m128i b = _mm_castps_si128(v);
        __m128i e = _mm_and_si128(_mm_srli_epi32(b, 23), ff);
        __m128 frac = _mm_mul_ps(_mm_cvtepi32_ps(_mm_and_si128(b, mm)), scale);
        __m128i up = _mm_castps_si128(_mm_cmplt_ps(_mm_loadu_ps(ug + 4 * h), frac));
        __m128i c = _mm_sub_epi32(e, up);  // up is -1 where true
        c2[h] = _mm_min_epi32(c, top);     // e >= 254: 254 (e = 254 never rounds up)
        neg |= _mm_movemask_ps(_mm_cmplt_ps(v, _mm_setzero_ps())) << (4 * h);
      }
      __m128i p16 = _mm_packus_epi32(c2[0], c2[1]);
      uint64_t w = (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(p16, p16));
      std::memcpy(codes + i0, &w, 8);
      signs[g] = (uint8_t)neg;
#else
      local.range(x, i0, i0 + 8);
      signs[g] = sign_byte(x + i0, true);
      for (int j = 0; j < 8; ++j) codes[i0 + j] = natural_code(x[i0 + j], ug[j]);
#endif
    } else {
      local.range(x, i0, n);
      uint8_t m = 0;
      for (int64_t j = 0; i0 + j < n; ++j) {
        m |= (uint8_t)((x[i0 + j] < 0.0f) << j);
        codes[i0 + j] = natural_code(x[i0 + j], ug[j]);
      }
      signs[g] = m;
    }
  }
  check.merge(local);
}
}  // namespace

API void grace_cpu_natural_compress(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes) {
  for_chunks((n + 7) / 8, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    FiniteCheck unused;
    natural_groups(x, u, 0, n, g0, g1, signs, codes, unused);
  });
}

// ---- draws made where they are used ----------------------------------------------------------
// natural_compress with the counter-based draws of seed words (s0, s1) (grace_cpu_uniform_segments'
// draw i for element i), made block by block in L1 instead of read from a tensor of n draws
namespace {
// grace_cpu_natural_compress_drawn, telling `bad` (where given) whether x holds an inf or a NaN
void natural_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, uint8_t* signs, uint8_t* codes,
                            std::atomic<bool>* bad) {
  for_chunks((n + 7) / 8, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    FiniteCheck check;
    with_draws(n, g0, g1, s0, s1, [&](const float* u, int64_t ubase, int64_t g, int64_t ge) {
      natural_groups(x, u, ubase, n, g, ge, signs, codes, check);
    });
    report(check, bad);
  });
}
}  // namespace

API void grace_cpu_natural_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, uint8_t* signs,
                                          uint8_t* codes) {
  natural_compress_drawn(x, n, s0, s1, signs, codes, nullptr);
}

// terngrad_compress with its scale (max |x|) found here and the draws of seed words (s0, s1)
API void grace_cpu_terngrad_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, float* scale,
                                           uint8_t* out) {
  grace_cpu_maxabs(x, n, scale);
  const float safe = terngrad_bound(scale[0]);
  const int64_t full = n / 8;
  for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    with_draws(n, g0, g1, s0, s1, [&](const float* u, int64_t ubase, int64_t g, int64_t ge) {
      terngrad_groups(x, u, ubase, safe, g, ge, out);
    });
  });
  float u[8];
  uniform_range(8 * full, n, s0, s1, u);
  terngrad_tail(x, u, 8 * full, n, safe, out);
}

// qsgd_compress with the draws of seed words (s0, s1): draw i for element i
API int grace_cpu_qsgd_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, int levels, int64_t bucket,
                                      int bits, float* norms, uint8_t* out) {
  return qsgd_compress(x, n, levels, bucket, bits, norms, 0, out, [&](int64_t g0, int64_t g1, const auto& f) {
    with_draws(n, g0, g1, s0, s1, f);
  });
}

// The payload of every gradient s of a bucket (x[s], n[s] elements) in one call, by the per-tensor
// kernel of `method`: 0 signSGD (sign_pack: bits into out0), 1 TernGrad (codes into out0, scale
// into out1), 2 QSGD (codes into out0, norms into out1; levels, bucket (0: the whole gradient) and
// bits), 3 natural compression (signs into out0, codes into out1); the random ones with the draws
// of seed words (s0[s], s1[s]); the overflow flag into *nonfinite where given. -1 on an unknown
// method or bad QSGD parameters.
API int grace_cpu_compress_many(int method, int64_t count, const float* const* x, const int64_t* n, const uint32_t* s0,
                                const uint32_t* s1, void* const* out0, void* const* out1, int levels, int64_t bucket,
                                int bits, float* nonfinite) {
  if (method < 0 || method > 3 || (method == 2 && (bits < 1 || bits > 8 || levels < 1))) return -1;
  NonfiniteFlag flag(nonfinite);
  // (TernGrad's scale and QSGD's norms are not finite where x is not: no check of their own)
  auto scalars_tell = [&](const float* v, int64_t count) {
    for (int64_t j = 0; j < count && flag.wanted(); ++j)
      if (!std::isfinite(v[j])) flag.seen.store(true, std::memory_order_relaxed);
  };
  if (method == 0) {  // every gradient's chunks dealt to the threads at once
    for_segment_chunks(count, n, 8, [&](int64_t s, int64_t lo, int64_t hi) {
      sign_pack_range(x[s], n[s], lo, hi, false, (uint8_t*)out0[s], flag.wanted());
    });
    return 0;
  }
  std::atomic<bool> failed{false};
  for_segments(count, n, [&](int64_t s) {
    uint8_t* const a = (uint8_t*)out0[s];
    float* const scalars = out1 ? (float*)out1[s] : nullptr;
    switch (method) {
      case 1:
        grace_cpu_terngrad_compress_drawn(x[s], n[s], s0[s], s1[s], scalars, a);
        scalars_tell(scalars, 1);
        break;
      case 2: {
        const int64_t b = qsgd_row(n[s], bucket);
        if (grace_cpu_qsgd_compress_drawn(x[s], n[s], s0[s], s1[s], levels, b, bits, scalars, a) != 0) failed = true;
        scalars_tell(scalars, (n[s] + b - 1) / b);
        break;
      }
      default: natural_compress_drawn(x[s], n[s], s0[s], s1[s], a, (uint8_t*)scalars, flag.wanted());
    }
  });
  return failed ? -1 : 0;
}
