// grace CPU kernels: bit packing of codes, sign bytes, QSGD's bucket (see common.h)
#pragma once
#include "common.h"

namespace {
// ---- bit packing ---------------------------------------------------------------------------
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// f(std::integral_constant<int, W>{}) for the code width W = bits in 1..8: one instantiation
// per width, chosen once per call instead of per element.
template <class F>
inline void with_width(int bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// 8 codes of B bits (one per byte of v) -> the low B bytes of a word, and back. Three steps of
// constant shifts and masks, each halving the number of fields: neighbouring codes meet in
// 16-bit lanes (c0 | c1 << B), then in 32-bit lanes (4 codes), then in the word (8 codes).
template <int B>
inline uint64_t pack_word(uint64_t v) {
  if constexpr (B == 8) {
    return v;
  } else {
    constexpr uint64_t m1 = (1ULL << B) - 1, m2 = (1ULL << 2 * B) - 1, m4 = (1ULL << 4 * B) - 1;
    constexpr uint64_t l16 = 0x0001000100010001ULL, l32 = 0x0000000100000001ULL;
    v &= m1 * 0x0101010101010101ULL;
    v = (v & l16 * 0xFF) | ((v >> (8 - B)) & l16 * (m1 << B));
    v = (v & l32 * 0xFFFF) | ((v >> (16 - 2 * B)) & l32 * (m2 << 2 * B));
    return (v & 0xFFFFFFFFULL) | ((v >> (32 - 4 * B)) & (m4 << 4 * B));
  }
}

// the low 8*B bits of w (the bits above are ignored) -> 8 codes, one per byte
template <int B>
inline uint64_t unpack_word(uint64_t w) {
  if constexpr (B == 8) {
    return w;
  } else {
    constexpr uint64_t m1 = (1ULL << B) - 1, m2 = (1ULL << 2 * B) - 1, m4 = (1ULL << 4 * B) - 1;
    constexpr uint64_t l16 = 0x0001000100010001ULL, l32 = 0x0000000100000001ULL;
    uint64_t v = (w & m4) | ((w << (32 - 4 * B)) & (m4 << 32));
    v = (v & l32 * m2) | ((v << (16 - 2 * B)) & l32 * (m2 << 16));
    return (v & l16 * m1) | ((v << (8 - B)) & l16 * (m1 << 8));
  }
}

// Group g (8 codes) of a range [.., g1) written in ascending order: its B bytes at out + g*B,
// as one 8-byte store where the range's later groups overwrite the bytes past B.
template <int B>
inline void put_group(uint8_t* out, int64_t g, int64_t g1, uint64_t w) {
  std::memcpy(out + g * B, &w, g < g1 - 7 / B ? 8 : B);
}

// Group g of a stream of `nbytes` bytes as a word: one 8-byte load where the stream goes on
// (no byte-wise copy through the stack, which stalls store forwarding); m < 8 codes at its end.
template <int B>
inline uint64_t get_group(const uint8_t* packed, int64_t g, int64_t nbytes, int m = 8) {
  if (g * B + 8 <= nbytes) return load_u64(packed + g * B);
  uint64_t w = 0;
  std::memcpy(&w, packed + g * B, (m * B + 7) / 8);
  return w;
}

#ifdef GRACE_SIMD
struct Bytes16 {  // a shuffle or multiplier constant made at compile time
  alignas(16) int8_t v[16];
  __m128i load() const { return _mm_load_si128((const __m128i*)v); }
};

// 16 codes (one per byte of c, groups g and g+1) -> their 2*B packed bytes, the low ones of the
// result. Neighbours meet by multiply-adds: c0 + c1 << B in 16-bit lanes, then 4 codes in
// 32-bit lanes, then 8 in each 64-bit lane, whose B low bytes a shuffle puts side by side.
template <int B>
inline __m128i pack16(__m128i c) {
  if constexpr (B == 8) {
    return c;
  } else if constexpr (B == 1) {
    return _mm_cvtsi32_si128(_mm_movemask_epi8(_mm_slli_epi16(c, 7)));
  } else if constexpr (B == 4) {
    __m128i p = _mm_maddubs_epi16(_mm_and_si128(c, _mm_set1_epi8(15)), _mm_set1_epi16(0x1001));  // c0 + 16 c1
    return _mm_packus_epi16(p, p);
  } else {
    constexpr int64_t m1 = (1 << B) - 1, m4 = (1LL << 4 * B) - 1;
    __m128i p;
    if constexpr (B <= 6) {  // maddubs' factors are signed bytes: 2^B <= 64
      p = _mm_maddubs_epi16(_mm_and_si128(c, _mm_set1_epi8(m1)), _mm_set1_epi16(1 | 1 << (B + 8)));
    } else {
      p = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi16(m1)),
                       _mm_srli_epi16(_mm_and_si128(c, _mm_set1_epi16(m1 << 8)), 8 - B));
    }
    const __m128i q = _mm_madd_epi16(p, _mm_set1_epi32(1 | 1 << (2 * B + 16)));  // p0 + p1 << 2B
    if constexpr (B == 2) {  // a byte per 32-bit lane
      const __m128i w = _mm_packs_epi32(q, q);
      return _mm_packus_epi16(w, w);
    } else {
      const __m128i w = _mm_or_si128(_mm_and_si128(q, _mm_set1_epi64x(m4)),
                                     _mm_and_si128(_mm_srli_epi64(q, 32 - 4 * B), _mm_set1_epi64x(m4 << 4 * B)));
      static constexpr Bytes16 idx = [] {  // bytes 0..B-1 of each 64-bit lane, side by side
        Bytes16 r{};
        for (int j = 0; j < 16; ++j) r.v[j] = (int8_t)(j < B ? j : j < 2 * B ? 8 + j - B : -1);
        return r;
      }();
      return _mm_shuffle_epi8(w, idx.load());
    }
  }
}

// the inverse: 2*B packed bytes (the low ones of p) -> 16 codes. Code k lies in bits
// [s, s + B) of the 16-bit word at byte B*k/8 (s = B*k % 8): a shuffle puts each code's word
// in a 16-bit lane, a multiply shifts the code to the lane's top, a shift to its bottom.
template <int B>
inline __m128i unpack16(__m128i p) {
  if constexpr (B == 8) {
    return p;
  } else if constexpr (B == 1) {
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    __m128i b = _mm_shuffle_epi8(p, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, bit), bit), _mm_set1_epi8(1));
  } else if constexpr (B == 4) {
    const __m128i m4 = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(p, m4), _mm_and_si128(_mm_srli_epi16(p, 4), m4));
  } else {
    static constexpr Bytes16 idx = [] {  // codes 0..7: bytes B*k/8 and the next
      Bytes16 r{};
      for (int k = 0; k < 8; ++k) r.v[2 * k] = (int8_t)(B * k / 8), r.v[2 * k + 1] = (int8_t)(B * k / 8 + 1);
      return r;
    }();
    static constexpr Bytes16 mul = [] {  // 16-bit factors 2^(16 - B - s)
      Bytes16 r{};
      for (int k = 0; k < 8; ++k) {
        int f = 1 << (16 - B - B * k % 8);
        r.v[2 * k] = (int8_t)(f & 255), r.v[2 * k + 1] = (int8_t)(f >> 8);
      }
      return r;
    }();
    const __m128i lo = _mm_shuffle_epi8(p, idx.load());                       // codes 0..7
    const __m128i hi = _mm_shuffle_epi8(_mm_srli_si128(p, B), idx.load());    // codes 8..15
    return _mm_packus_epi16(_mm_srli_epi16(_mm_mullo_epi16(lo, mul.load()), 16 - B),
                            _mm_srli_epi16(_mm_mullo_epi16(hi, mul.load()), 16 - B));
  }
}

// the 2*B bytes of groups g, g+1 (the low bytes of v) at out + g*B, for groups written in
// ascending order up to gend: one 16-byte store where later groups overwrite the bytes past 2*B
template <int B>
inline void put16(uint8_t* out, int64_t g, int64_t gend, __m128i v) {
  if (g * B + 16 <= gend * B) {
    _mm_storeu_si128((__m128i*)(out + g * B), v);
  } else {
    alignas(16) uint8_t t[16];
    _mm_store_si128((__m128i*)t, v);
    std::memcpy(out + g * B, t, 2 * B);
  }
}
#endif

// sign bits of 8 floats: bit j = (x[j] >= 0), or (x[j] < 0) when negative
inline uint8_t sign_byte(const float* x, bool negative) {
#if defined(__AVX2__)
  const __m256 v = _mm256_loadu_ps(x), z = _mm256_setzero_ps();
  return (uint8_t)(negative ? _mm256_movemask_ps(_mm256_cmp_ps(v, z, _CMP_LT_OQ))
                            : _mm256_movemask_ps(_mm256_cmp_ps(v, z, _CMP_GE_OQ)));
#elif defined(__SSE2__)
  __m128 z = _mm_setzero_ps();
  __m128 a = _mm_loadu_ps(x), b = _mm_loadu_ps(x + 4);
  int m = negative ? (_mm_movemask_ps(_mm_cmplt_ps(a, z)) | _mm_movemask_ps(_mm_cmplt_ps(b, z)) << 4)
                   : (_mm_movemask_ps(_mm_cmpge_ps(a, z)) | _mm_movemask_ps(_mm_cmpge_ps(b, z)) << 4);
  return (uint8_t)m;
#else
  uint8_t m = 0;
  for (int j = 0; j < 8; ++j) m |= (uint8_t)((negative ? x[j] < 0.0f : x[j] >= 0.0f) << j);
  return m;
#endif
}
}  // namespace

// QSGD's bucket in a tensor of n elements: `bucket`, or the whole tensor (bucket 0, or one past its end)
inline int64_t qsgd_row(int64_t n, int64_t bucket) {
  return bucket > 0 && bucket < n ? bucket : std::max<int64_t>(n, 1);
}
