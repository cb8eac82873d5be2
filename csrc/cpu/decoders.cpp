// grace CPU kernels: decoders, and decoded sums (every rank's payload of a gradient decoded and
// added in one pass) (see common.h)
#include "bitpack.h"
#include "lanes.h"
#include "signs.h"

// ---- decoders ------------------------------------------------------------------------------
namespace {
// out[0..8) = bit j of b ? hi : lo
inline void select8(uint8_t b, float lo, float hi, float* out, bool stream) {
#if defined(__SSE2__)
  const __m128i sel0 = _mm_setr_epi32(1, 2, 4, 8), sel1 = _mm_setr_epi32(16, 32, 64, 128);
  const __m128i bb = _mm_set1_epi32(b);
  const __m128 vlo = _mm_set1_ps(lo), vhi = _mm_set1_ps(hi);
  __m128 m0 = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bb, sel0), sel0));
  __m128 m1 = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bb, sel1), sel1));
  store4(out, _mm_or_ps(_mm_and_ps(m0, vhi), _mm_andnot_ps(m0, vlo)), stream);
  store4(out + 4, _mm_or_ps(_mm_and_ps(m1, vhi), _mm_andnot_ps(m1, vlo)), stream);
#else
  for (int j = 0; j < 8; ++j) out[j] = ((b >> j) & 1) ? hi : lo;
#endif
}

void decode_bits(const uint8_t* packed, int64_t n, float lo, float hi, float* out) {
  const int64_t full = n / 8;
  const bool stream = streams(out, 4 * n);
  for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) select8(packed[g], lo, hi, out + 8 * g, stream);
  });
  for (int64_t i = 8 * full; i < n; ++i) out[i] = ((packed[full] >> (i - 8 * full)) & 1) ? hi : lo;
  fence_streams(stream);
}
}  // namespace

API void grace_cpu_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  const float s = scale ? scale[0] : 1.0f;
  decode_bits(packed, n, -1.0f * s, 1.0f * s, out);
}

API void grace_cpu_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out) {
  const float mu0 = means[0], mu1 = means[1];
  const float d = mu1 - mu0;
  decode_bits(packed, n, mu0 + 0.0f * d, mu0 + 1.0f * d, out);
}

namespace {
// How an aggregate follows from the sum of the ranks' decoded payloads, element by element (the
// compressor's from_sum): its sign where `vote` (a majority vote), then divided by each divisor
// in turn; each step rounds as the tensor ops do.
struct Finish {
  bool vote = false;
  int count = 0;
  float div[4] = {};
  float recip[4] = {};  // 1 / div[i] where that is exact, else 0
  Finish() = default;
  Finish(int vote_, const float* divisors, int n) : vote(vote_ != 0), count(std::min(n, 4)) {
    for (int i = 0; i < count; ++i) {
      div[i] = divisors[i];
      recip[i] = exact_reciprocal(div[i]) ? 1.0f / div[i] : 0.0f;
    }
  }
  bool none() const { return !vote && !count; }
  float apply(float a) const {
    if (vote) a = a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : a;  // (0 and NaN stay)
    for (int i = 0; i < count; ++i) a = a / div[i];
    return a;
  }
#ifdef GRACE_SIMD
  F8 apply8(F8 a) const {
    if (vote) {
      const F8 zero = set8(0.0f);
      a = sel8(gt8(a, zero), set8(1.0f), sel8(lt8(a, zero), set8(-1.0f), a));
    }
    for (int i = 0; i < count; ++i) a = recip[i] != 0.0f ? a * set8(recip[i]) : a / set8(div[i]);
    return a;
  }
#endif
  void range(float* o, int64_t m) const {  // o[0, m) in place
    if (none()) return;
    int64_t i = 0;
#ifdef GRACE_SIMD
    for (; i + 8 <= m; i += 8) st8(o + i, apply8(ld8(o + i)));
#endif
    for (; i < m; ++i) o[i] = apply(o[i]);
  }
};

// Each rank's row of codes is read beside the output as a sparse stream (a 64-byte line of bits
// is 512 outputs), which the hardware prefetcher left cold on an AMD EPYC VM where the rows lie in
// an allgather's frames: each row's line kRowsAhead bytes on is asked for once per line of
// progress (ResNet-50's signSGD sums of 4 ranks, one thread: 4.9 -> 3.7 ms).
constexpr int64_t kRowsAhead = 1024;
inline void rows_ahead(const uint8_t* const* rows, int64_t count, int64_t at) {
  if (at % 64 == 0)
    for (int64_t j = 0; j < count; ++j) __builtin_prefetch(rows[j] + at + kRowsAhead);
}

#if defined(GRACE_SIMD) && defined(__AVX2__)
// 32 elements' bits of a row, the four bytes at `at`, one per byte lane: 0xFF where set, else 0
// (each byte spread over 8 lanes by one shuffle, each lane then tests its own bit)
inline __m256i bits_in_byte_lanes(const uint8_t* at) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  // lane: its byte
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  // lane: its bit
  uint32_t w;
  std::memcpy(&w, at, 4);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// The sums of a few rows (at most kTableRows) for every combination of their bits, each made row
// after row as bits_sum_rows adds them (then finished as `finish` says): 32 elements' sums are then
// one byte of pattern per element (bit j: row j's) and a lookup in two registers, not a value
// picked and added per row.
constexpr int64_t kTableRows = 4;
struct RowsTable {
  RowsTable(const float* lo, const float* hi, int64_t rows, const Finish& finish) : rows_(rows) {
    alignas(32) float sums[16] = {};
    for (int pattern = 0; pattern < (1 << rows); ++pattern) {
      float a = 0.0f;
      for (int64_t j = 0; j < rows; ++j) {
        const float v = (pattern >> j) & 1 ? hi[j] : lo[j];
        a = j ? a + v : v;
      }
      sums[pattern] = finish.apply(a);
    }
    low = _mm256_load_ps(sums);
    high = _mm256_load_ps(sums + 8);
    std::memcpy(sums_, sums, sizeof sums);
  }
  const float* sums() const { return sums_; }
  // acc[q] = the first rows' sums of elements 8q..8q+7 of the 32 whose bits start at byte `at`
  void lookup(const uint8_t* const* rows, int64_t at, F8* acc) const {
    __m256i pattern = _mm256_setzero_si256();
    for (int64_t j = 0; j < rows_; ++j)
      pattern = _mm256_or_si256(pattern, _mm256_and_si256(bits_in_byte_lanes(rows[j] + at),
                                                          _mm256_set1_epi8((char)(1 << j))));
    const __m128i half[2] = {_mm256_castsi256_si128(pattern), _mm256_extracti128_si256(pattern, 1)};
    for (int q = 0; q < 4; ++q) {
      const __m256i index = _mm256_cvtepu8_epi32(q & 1 ? _mm_srli_si128(half[q / 2], 8) : half[q / 2]);
      const __m256 a = _mm256_permutevar8x32_ps(low, index);  // (by the index's low 3 bits)
      acc[q] = {rows_ <= 3 ? a : _mm256_blendv_ps(a, _mm256_permutevar8x32_ps(high, index),
                                                  _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)))};
    }
  }

 private:
  int64_t rows_;
  __m256 low, high;  // the sums of patterns 0-7 and 8-15
  float sums_[16];
};

GRACE_AVX512 inline void finish16(float* p, __m512 v, const Finish& finish, bool stream) {
  if (finish.none() && !stream) return _mm512_storeu_ps(p, v);
  put8(p, finish.none() ? low8(v) : finish.apply8(low8(v)), stream);
  put8(p + 8, finish.none() ? high8(v) : finish.apply8(high8(v)), stream);
}

// RowsTable's lookup of every row's bits (at most kTableRows rows) for groups [g, g1) 8 at a time
// (64 elements, eight bytes of each row) with AVX-512: a row's 64 bits the mask that sets its bit
// of the elements' byte patterns, and one permute reads 16 elements' sums from a register (the
// 8-lane lookup's spreading of bits and blends made the decode slower than its write: 4 rows of
// ResNet-50's 161 gradients, one thread, 7.4 -> 6.1 ms on an AMD EPYC). Returns where it stopped.
GRACE_AVX512 int64_t table_sum_rows64(const uint8_t* const* rows, int64_t count, const float* sums, int64_t g,
                                      int64_t g1, float* out, bool stream) {
  const __m512 table = _mm512_loadu_ps(sums);
  for (; g + 8 <= g1; g += 8) {
    rows_ahead(rows, count, g);
    __m512i pattern = _mm512_setzero_si512();
    for (int64_t j = 0; j < count; ++j) {
      uint64_t w;
      std::memcpy(&w, rows[j] + g, 8);
      pattern = _mm512_mask_add_epi8(pattern, _cvtu64_mask64(w), pattern, _mm512_set1_epi8((char)(1 << j)));
    }
    const __m128i quarters[4] = {_mm512_extracti32x4_epi32(pattern, 0), _mm512_extracti32x4_epi32(pattern, 1),
                                 _mm512_extracti32x4_epi32(pattern, 2), _mm512_extracti32x4_epi32(pattern, 3)};
    for (int q = 0; q < 4; ++q) {
      const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(quarters[q]), table);
      finish16(out + 8 * g + 16 * q, v, Finish(), stream);  // (the sums are finished already)
    }
  }
  return g;
}

// bits_sum_rows' groups [g, g1) 4 at a time (32 elements, four bytes of each row) with AVX-512:
// a row's 16 bits are the mask that picks hi or lo per lane. Returns where it stopped.
GRACE_AVX512 int64_t bits_sum_rows32(const uint8_t* const* rows, const float* lo, const float* hi, int64_t count,
                                     int64_t g, int64_t g1, float* out, const Finish& finish, bool stream) {
  for (; g + 4 <= g1; g += 4) {
    rows_ahead(rows, count, g);
    __m512 acc[2];
    for (int64_t j = 0; j < count; ++j) {
      uint32_t w;
      std::memcpy(&w, rows[j] + g, 4);
      const __m512 l = _mm512_set1_ps(lo[j]), h = _mm512_set1_ps(hi[j]);
      for (int q = 0; q < 2; ++q) {
        const __m512 v = _mm512_mask_blend_ps((__mmask16)(w >> (16 * q)), l, h);
        acc[q] = j ? _mm512_add_ps(acc[q], v) : v;
      }
    }
    for (int q = 0; q < 2; ++q) finish16(out + 8 * g + 16 * q, acc[q], finish, stream);
  }
  return g;
}
#endif

// A decoded sum's elements [lo, hi) of n, as one thread's share: lo a multiple of kSumAlign
// (a chunk's outputs 512 bytes apart), hi one too, or n (then the last few elements too).
constexpr int64_t kSumAlign = 128;

// out = the sum, row after row in float32, of the rows of n bits decoded to lo[j] / hi[j]
// (then finished), elements [e0, e1) (as kSumAlign says); streamed where `stream` (out 16-byte aligned).
void bits_sum_range(const uint8_t* const* rows, const float* lo, const float* hi, int64_t count, int64_t n,
                    int64_t e0, int64_t e1, float* out, const Finish& finish, bool stream) {
  const int64_t full = n / 8, g0 = e0 / 8, g1 = e1 / 8;
#ifdef GRACE_SIMD
  std::vector<F8> vlo(count), vhi(count);
  for (int64_t j = 0; j < count; ++j) vlo[j] = set8(lo[j]), vhi[j] = set8(hi[j]);
  const bool plain = finish.none();
  int64_t g = g0;
#if defined(__AVX2__)
  // 32 elements (four bytes of each row) at a time: each lane's bit shifted into place and its
  // value, lo or hi, picked by one permute (a row's word read once for four blocks of 8)
  std::vector<__m256> two(count);
  for (int64_t j = 0; j < count; ++j) two[j] = _mm256_setr_ps(lo[j], hi[j], 0, 0, 0, 0, 0, 0);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i shift[4] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                            _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
                            _mm256_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23),
                            _mm256_setr_epi32(24, 25, 26, 27, 28, 29, 30, 31)};
  // The first rows' sums (finished, where they are all the rows) looked up by their bits: a
  // table of the 2^head sums, made row after row as below, indexed by a byte of bits per element
  const int64_t head = kAvx512 && count > kTableRows ? 0 : std::min<int64_t>(count, kTableRows);
  const RowsTable table(lo, hi, head, count == head ? finish : Finish());
  const bool finished = plain || count == head;
  if (kAvx512 && head == 0) g = bits_sum_rows32(rows, lo, hi, count, g, g1, out, finish, stream);
  if (kAvx512 && head == count) g = table_sum_rows64(rows, count, table.sums(), g, g1, out, stream);
  for (; g + 4 <= g1; g += 4) {
    rows_ahead(rows, count, g);
    F8 acc[4];
    if (head) table.lookup(rows, g, acc);
    for (int64_t j = head; j < count; ++j) {
      uint32_t w;
      std::memcpy(&w, rows[j] + g, 4);
      const __m256i word = _mm256_set1_epi32((int)w);
      for (int q = 0; q < 4; ++q) {
        const F8 v{_mm256_permutevar8x32_ps(two[j], _mm256_and_si256(_mm256_srlv_epi32(word, shift[q]), one))};
        acc[q] = j ? acc[q] + v : v;
      }
    }
    for (int q = 0; q < 4; ++q) put8(out + 8 * (g + q), finished ? acc[q] : finish.apply8(acc[q]), stream);
  }
#endif
  for (; g < g1; ++g) {
    F8 acc = sel8(bits8(rows[0][g]), vhi[0], vlo[0]);
    for (int64_t j = 1; j < count; ++j) acc = acc + sel8(bits8(rows[j][g]), vhi[j], vlo[j]);
    put8(out + 8 * g, plain ? acc : finish.apply8(acc), stream);
  }
  fence_streams(stream);
#else
  alignas(32) float acc[8], v[8];
  for (int64_t g = g0; g < g1; ++g) {
    select8(rows[0][g], lo[0], hi[0], acc, false);
    for (int64_t j = 1; j < count; ++j) {
      select8(rows[j][g], lo[j], hi[j], v, false);
      for (int e = 0; e < 8; ++e) acc[e] += v[e];
    }
    for (int e = 0; e < 8; ++e) acc[e] = finish.apply(acc[e]);
    std::memcpy(out + 8 * g, acc, sizeof acc);
  }
#endif
  for (int64_t i = std::max(8 * full, e0); i < e1; ++i) {
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      const float v = ((rows[j][full] >> (i - 8 * full)) & 1) ? hi[j] : lo[j];
      acc = j ? acc + v : v;
    }
    out[i] = finish.apply(acc);
  }
}
constexpr int kTernGrad = 3;  // the mode of 2-bit TernGrad codes: 0, +s, -s (and 3: -s)

#if defined(GRACE_SIMD) && defined(__AVX2__)
// signSGD's rows (a set bit +1, else -1; at most 127): an element's sum is 2c - count, c the rows
// whose bit is set, a small integer and so exact in float32 in any order of the additions: the
// sum row after row is this one. c is counted 32 elements at a time in byte lanes (a row's four
// bytes spread over them); the majority vote alone is (c > count / 2) - (c < count - count / 2)
// in the same lanes, +0 at a tie as the float sum gives it.
void sign_sum_range(const uint8_t* const* rows, int64_t count, int64_t n, int64_t e0, int64_t e1, float* out,
                    const Finish& finish, bool stream) {
  const int64_t full = n / 32, g0 = e0 / 32, g1 = e1 / 32;
  const bool vote_only = finish.vote && finish.count == 0;
  const __m256i below = _mm256_set1_epi8((char)(count / 2)), above = _mm256_set1_epi8((char)(count - count / 2));
  const __m256i vcount = _mm256_set1_epi32((int)count);
  for (int64_t g = g0; g < g1; ++g) {
    rows_ahead(rows, count, 4 * g);
    __m256i c = _mm256_setzero_si256();
    for (int64_t j = 0; j < count; ++j) c = _mm256_sub_epi8(c, bits_in_byte_lanes(rows[j] + 4 * g));
    const __m256i r = vote_only ? _mm256_sub_epi8(_mm256_cmpgt_epi8(above, c), _mm256_cmpgt_epi8(c, below)) : c;
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    const __m128i eighths[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k) {
      F8 a;
      if (vote_only) {
        a = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eighths[k]))};
      } else {
        const __m256i ck = _mm256_cvtepu8_epi32(eighths[k]);
        a = {_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(ck, ck), vcount))};
        if (!finish.none()) a = finish.apply8(a);
      }
      put8(out + 32 * g + 8 * k, a, stream);
    }
  }
  fence_streams(stream);
  for (int64_t i = std::max(32 * full, e0); i < e1; ++i) {  // row after row, as bits_sum_range
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      const float v = ((rows[j][i / 8] >> (i % 8)) & 1) ? 1.0f : -1.0f;
      acc = j ? acc + v : v;
    }
    out[i] = finish.apply(acc);
  }
}
#endif

#if defined(GRACE_SIMD) && defined(__AVX2__)
// terngrad_sum_rows' groups [g, g1) of 4 elements, four at a time (16 elements, four bytes of
// each row) with AVX-512: each lane's code shifted into place picks its value from the row's
// four (val[4 j ..]) by one permute. Returns where it stopped.
GRACE_AVX512 int64_t terngrad_sum_rows16(const uint8_t* const* rows, const float* val, int64_t count, int64_t g,
                                         int64_t g1, float* out, const Finish& finish, bool stream) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i three = _mm512_set1_epi32(3);
  for (; g + 4 <= g1; g += 4) {
    rows_ahead(rows, count, g);
    __m512 acc;
    for (int64_t j = 0; j < count; ++j) {
      uint32_t w;
      std::memcpy(&w, rows[j] + g, 4);
      const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w), shifts), three);
      const __m512 v = _mm512_permutexvar_ps(code, _mm512_broadcast_f32x4(_mm_loadu_ps(val + 4 * j)));
      acc = j ? _mm512_add_ps(acc, v) : v;
    }
    finish16(out + 4 * g, acc, finish, stream);
  }
  return g;
}
#endif

// out = the sum, row after row in float32, of rows of n TernGrad codes (4 to a byte), row j
// decoded with its scale scale[j] as grace_cpu_terngrad_decode does: by a table of each
// byte's four values per row; finished as it is stored (streamed where `stream`, out 16-byte
// aligned).
void terngrad_sum_range(const uint8_t* const* rows, const float* scale, int64_t count, int64_t n, int64_t e0,
                        int64_t e1, float* out, const Finish& finish, bool stream) {
  std::vector<float> val((size_t)count * 4);
  for (int64_t j = 0; j < count; ++j) {
    const float s = scale[j];
    float* v = val.data() + 4 * j;
    v[0] = 0.0f * s, v[1] = 1.0f * s, v[2] = -1.0f * s, v[3] = -1.0f * s;
  }
#if defined(GRACE_SIMD) && !defined(__AVX2__)
  std::vector<float> table((size_t)count * 256 * 4);  // a byte's four values, per row
  for (int64_t j = 0; j < count; ++j)
    for (int b = 0; b < 256; ++b)
      for (int e = 0; e < 4; ++e) table[((size_t)j * 256 + b) * 4 + e] = val[4 * j + ((b >> (2 * e)) & 3)];
  const float* const T = table.data();
#endif
  // element i: the rows' values added rank after rank, finished (where no vector step reaches)
  auto one = [&](int64_t i) {
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      const float v = val[4 * j + ((rows[j][i / 4] >> (2 * (i % 4))) & 3)];
      acc = j ? acc + v : v;
    }
    return finish.apply(acc);
  };
  const int64_t full = n / 4, g0 = e0 / 4, g1 = e1 / 4;
  int64_t g = g0;  // (chunks start at even groups: 8 elements at a time stay 32-byte apart)
#if defined(GRACE_SIMD) && defined(__AVX2__)
  // 8 elements (two bytes of each row) at a time: each lane's code shifted into place and its
  // value picked from the row's four by one permute (the same values as the table's)
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), three = _mm256_set1_epi32(3);
  std::vector<__m256> four(count);
  for (int64_t j = 0; j < count; ++j) four[j] = _mm256_castps128_ps256(_mm_loadu_ps(val.data() + 4 * j));
  auto row8 = [&](int64_t j, int64_t g) {
    uint16_t w;
    std::memcpy(&w, rows[j] + g, 2);
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), three);
    return F8{_mm256_permutevar8x32_ps(four[j], code)};
  };
  const bool plain = finish.none();
  if (kAvx512) g = terngrad_sum_rows16(rows, val.data(), count, g, g1, out, finish, stream);
  for (; g + 2 <= g1; g += 2) {
    rows_ahead(rows, count, g);
    F8 acc = row8(0, g);
    for (int64_t j = 1; j < count; ++j) acc = acc + row8(j, g);
    put8(out + 4 * g, plain ? acc : finish.apply8(acc), stream);
  }
  fence_streams(stream);
#elif defined(GRACE_SIMD)
  auto sum4 = [&](int64_t g) {
    __m128 acc = _mm_loadu_ps(T + 4 * rows[0][g]);
    for (int64_t j = 1; j < count; ++j) acc = _mm_add_ps(acc, _mm_loadu_ps(T + ((size_t)j * 256 + rows[j][g]) * 4));
    return acc;
  };
  const bool plain = finish.none();
  for (; g + 2 <= g1; g += 2) {
    const F8 acc = f8(sum4(g), sum4(g + 1));
    put8(out + 4 * g, plain ? acc : finish.apply8(acc), stream);
  }
  fence_streams(stream);
#endif
  for (int64_t i = 4 * g; i < 4 * g1; ++i) out[i] = one(i);
  for (int64_t i = std::max(4 * full, e0); i < e1; ++i) out[i] = one(i);
}

// The sum of `count` rows of one gradient's codes, its elements [e0, e1) (as kSumAlign says);
// row j at rows[j], its scalars at scalars[j] (mode as in grace_native.h).
void codes_sum_range(const uint8_t* const* rows, const float* const* scalars, int mode, int64_t count, int64_t n,
                     int64_t e0, int64_t e1, float* out, const Finish& finish, bool stream) {
  if (mode == kTernGrad) {
    std::vector<float> scale(count);
    for (int64_t j = 0; j < count; ++j) scale[j] = scalars[j][0];
    terngrad_sum_range(rows, scale.data(), count, n, e0, e1, out, finish, stream);
    return;
  }
#if defined(GRACE_SIMD) && defined(__AVX2__)
  // (a few rows with AVX-512: bits_sum_range's lookup of their finished sums, faster than counting)
  if (mode == 0 && count <= 127 && !(kAvx512 && count <= kTableRows))
    return sign_sum_range(rows, count, n, e0, e1, out, finish, stream);
#endif
  std::vector<float> lo(count), hi(count);
  for (int64_t j = 0; j < count; ++j) row_values(mode ? scalars[j] : nullptr, mode, lo[j], hi[j]);
  bits_sum_range(rows, lo.data(), hi.data(), count, n, e0, e1, out, finish, stream);
}
}  // namespace

// Every rank's row of codes decoded and added in one pass: the aggregate of the sign family
// and TernGrad without a decoded tensor per rank.
API void grace_cpu_bits_sum(const uint8_t* packed, int64_t count, int64_t n, const float* scalars, int mode,
                            float* out) {
  if (n <= 0 || count <= 0) return;
  const int per = mode == 2 ? 2 : 1, bits = mode == kTernGrad ? 2 : 1;
  std::vector<const uint8_t*> rows(count);
  std::vector<const float*> row_scalars(count);
  for (int64_t j = 0; j < count; ++j) {
    rows[j] = packed + j * ((n * bits + 7) / 8);
    row_scalars[j] = scalars ? scalars + per * j : nullptr;
  }
  const bool stream = streams(out, 4 * n);
  for_chunks(n, kSumAlign, threads_for(n), [&](int, int64_t e0, int64_t e1) {
    codes_sum_range(rows.data(), row_scalars.data(), mode, count, n, e0, e1, out, Finish(), stream);
  });
}

// grace_cpu_bits_sum of each segment s of a bucket: the ranks' rows packed[s * ranks + r] with
// their scalars scalars[s * ranks + r] (NULL for signSGD), summed and finished into out[s].
API void grace_cpu_bits_sum_segments(int64_t segments, int ranks, const uint8_t* const* packed,
                                     const float* const* scalars, int mode, const int64_t* numels, int vote,
                                     const float* divisors, int ndiv, float* const* out) {
  if (ranks <= 0) return;
  std::vector<const float*> none(ranks, nullptr);
  const Finish finish(vote, divisors, ndiv);
  const int64_t bytes = bucket_bytes(segments, numels);
  // every segment's chunks dealt to the threads at once
  for_segment_chunks(segments, numels, kSumAlign, [&](int64_t s, int64_t e0, int64_t e1) {
    if (numels[s] > 0)
      codes_sum_range(packed + s * ranks, mode ? scalars + s * ranks : none.data(), mode, ranks, numels[s], e0, e1,
                      out[s], finish, streams(out[s], bytes));
  });
}

// out = p - decode(bits): the new residual of a sign-family payload in one pass (out may be p).
API void grace_cpu_bits_residual(const float* p, const uint8_t* packed, int64_t n, const float* scalars, int mode,
                                 float* out) {
  if (n <= 0) return;
  float lo, hi;
  row_values(scalars, mode, lo, hi);
  const int64_t full = n / 8;
  for_chunks(full, 16, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    const float* const P = p;
    float* const O = out;
#ifdef GRACE_SIMD
    const F8 vlo = set8(lo), vhi = set8(hi);
    for (int64_t g = g0; g < g1; ++g) st8(O + 8 * g, ld8(P + 8 * g) - sel8(bits8(packed[g]), vhi, vlo));
#else
    for (int64_t i = 8 * g0; i < 8 * g1; ++i) O[i] = P[i] - (((packed[i >> 3] >> (i & 7)) & 1) ? hi : lo);
#endif
  });
  for (int64_t i = 8 * full; i < n; ++i) out[i] = p[i] - (((packed[full] >> (i - 8 * full)) & 1) ? hi : lo);
}

namespace {
// TernGrad's values at scale s, 0, +s and -s (code 3: -s), and a byte's four of them
struct TernValues {
  explicit TernValues(float s) : val{0.0f * s, 1.0f * s, -1.0f * s, -1.0f * s} {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 4; ++j) lut[b][j] = val[(b >> (2 * j)) & 3];
  }
  float at(const uint8_t* packed, int64_t i) const { return val[(packed[i / 4] >> (2 * (i % 4))) & 3]; }
  float val[4];
  alignas(16) float lut[256][4];
};

// elements [i0, i1) of TernGrad's codes decoded into out[0, i1 - i0): whole bytes by the table
// (streamed where `stream` and their place in out is 16-byte aligned), those before and after
// them one by one
void terngrad_decode_range(const uint8_t* packed, const TernValues& t, int64_t i0, int64_t i1, float* out,
                           bool stream) {
  int64_t i = i0;
  for (; i < i1 && i % 4; ++i) out[i - i0] = t.at(packed, i);
  const int64_t g1 = i1 / 4;
#if defined(__SSE2__)
  const bool nt = stream && (uintptr_t)(out + (i - i0)) % 16 == 0;
  for (int64_t g = i / 4; g < g1; ++g) store4(out + (4 * g - i0), _mm_load_ps(t.lut[packed[g]]), nt);
  fence_streams(nt);
#else
  for (int64_t g = i / 4; g < g1; ++g) std::memcpy(out + (4 * g - i0), t.lut[packed[g]], 16);
#endif
  for (i = std::max(i, 4 * g1); i < i1; ++i) out[i - i0] = t.at(packed, i);
}
}  // namespace

API void grace_cpu_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  const TernValues t(scale[0]);
  const bool stream = streams(out, 4 * n);
  for_chunks(n, 64, threads_for(n), [&](int, int64_t lo, int64_t hi) {
    terngrad_decode_range(packed, t, lo, hi, out + lo, stream);
  });
}

// Elements [starts[s], starts[s] + lengths[s]) of one payload's codes into outs[s], as
// grace_cpu_terngrad_decode decodes them: a shard's decoding written over the gradients it spans
API void grace_cpu_terngrad_decode_pieces(const uint8_t* packed, const float* scale, int64_t count,
                                          const int64_t* starts, const int64_t* lengths, float* const* outs) {
  const TernValues t(scale[0]);
  const bool stream = bucket_bytes(count, lengths) >= kStreamBytes;  // (the pieces' outputs together)
  for_segment_chunks(count, lengths, 64, [&](int64_t s, int64_t lo, int64_t hi) {
    terngrad_decode_range(packed, t, starts[s] + lo, starts[s] + hi, outs[s] + lo, stream);
  });
}

namespace {
// lut[code] of the 8 codes in the bytes of c, each times norm
// (a table lookup per code: faster than a float division per lane, and the same value)
inline void qsgd_values8(uint64_t c, const float* lut, float norm, float* out) {
#ifdef GRACE_SIMD
  auto at = [&](int j) { return lut[(c >> (8 * j)) & 255]; };
  const __m128 vn = _mm_set1_ps(norm);
  _mm_storeu_ps(out, _mm_mul_ps(_mm_setr_ps(at(0), at(1), at(2), at(3)), vn));
  _mm_storeu_ps(out + 4, _mm_mul_ps(_mm_setr_ps(at(4), at(5), at(6), at(7)), vn));
#else
  for (int j = 0; j < 8; ++j) out[j] = lut[(c >> (8 * j)) & 255] * norm;
#endif
}

#ifdef GRACE_SIMD
// Up to 15 levels (codes of up to 5 bits): the 16 values lut[2l] * norm of a bucket as four byte
// planes, which one byte shuffle each looks up for 16 codes at once (no division); the sign bit
// is the code's low bit. For finite norms, where -lut[2l] * norm is -(lut[2l] * norm) exactly.
struct PlaneLut {
  __m128i plane[4];
  PlaneLut(const float* lut, float norm) {
    const __m128i bytes = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i t[4];  // t[q]: byte k of values 4q..4q+3 in dword k
    for (int q = 0; q < 4; ++q) {
      const __m128 mag = _mm_setr_ps(lut[8 * q], lut[8 * q + 2], lut[8 * q + 4], lut[8 * q + 6]);
      t[q] = _mm_shuffle_epi8(_mm_castps_si128(_mm_mul_ps(mag, _mm_set1_ps(norm))), bytes);
    }
    const __m128i a = _mm_unpacklo_epi32(t[0], t[1]), b = _mm_unpackhi_epi32(t[0], t[1]);
    const __m128i c = _mm_unpacklo_epi32(t[2], t[3]), d = _mm_unpackhi_epi32(t[2], t[3]);
    plane[0] = _mm_unpacklo_epi64(a, c), plane[1] = _mm_unpackhi_epi64(a, c);
    plane[2] = _mm_unpacklo_epi64(b, d), plane[3] = _mm_unpackhi_epi64(b, d);
  }
  void values16(__m128i c, float* out, bool stream) const {
    const __m128i level = _mm_and_si128(_mm_srli_epi16(c, 1), _mm_set1_epi8(15));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi8(1)), 7);
    const __m128i b0 = _mm_shuffle_epi8(plane[0], level), b1 = _mm_shuffle_epi8(plane[1], level);
    const __m128i b2 = _mm_shuffle_epi8(plane[2], level);
    const __m128i b3 = _mm_xor_si128(_mm_shuffle_epi8(plane[3], level), sign);
    const __m128i lo01 = _mm_unpacklo_epi8(b0, b1), hi01 = _mm_unpackhi_epi8(b0, b1);
    const __m128i lo23 = _mm_unpacklo_epi8(b2, b3), hi23 = _mm_unpackhi_epi8(b2, b3);
    const __m128i v[4] = {_mm_unpacklo_epi16(lo01, lo23), _mm_unpackhi_epi16(lo01, lo23),
                          _mm_unpacklo_epi16(hi01, hi23), _mm_unpackhi_epi16(hi01, hi23)};
    for (int k = 0; k < 4; ++k) {
      if (stream) {
        _mm_stream_si128((__m128i*)(out + 4 * k), v[k]);
      } else {
        _mm_storeu_si128((__m128i*)(out + 4 * k), v[k]);
      }
    }
  }
};
#endif

// Codes of 6 to 8 bits: lut[c] * norm computed rather than looked up (the lookups, one per lane,
// were most of a decoded sum's time). |lut[c]| is level / levels rounded, which level times the
// rounded 1 / levels gives exactly for most `levels`, and one FMA step for the rest: checked
// against the table for every level, else the table is used (how == 0). The sign is the code's
// low bit: lut[c] * norm is symmetric in it for a finite norm.
struct QsgdLevels {
  int how = 0;  // 0: the table, 1: level * (1 / levels), 2: that corrected by one FMA step
  float rf = 0.0f, fl = 0.0f;  // 1 / levels rounded, levels
#if defined(GRACE_SIMD) && defined(__AVX2__)
  __m256 r, flevels;
#endif
  QsgdLevels(int levels, const float* lut) {
#if defined(GRACE_SIMD) && defined(__AVX2__)
    rf = 1.0f / (float)levels, fl = (float)levels;
    r = _mm256_set1_ps(rf), flevels = _mm256_set1_ps(fl);
    for (int way = 1; way <= 2 && how == 0; ++way) {
      bool all = true;
      for (int l = 0; l < 128 && all; ++l) {
        float q = (float)l * rf;
        if (way == 2) q = std::fma(std::fma(-q, fl, (float)l), rf, q);
        all = std::memcmp(&q, &lut[2 * l], 4) == 0;
      }
      how = all ? way : 0;
    }
#else
    (void)levels, (void)lut;
#endif
  }
#if defined(GRACE_SIMD) && defined(__AVX2__)
  // the 8 codes in the bytes of c, as lut[c] * norm
  __m256 values8(uint64_t c, __m256 norm) const {
    const __m256i code = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)c));
    const __m256 level = _mm256_cvtepi32_ps(_mm256_srli_epi32(code, 1));
    __m256 q = _mm256_mul_ps(level, r);
    if (how == 2) q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, flevels, level), r, q);
    return _mm256_xor_ps(_mm256_mul_ps(q, norm), _mm256_castsi256_ps(_mm256_slli_epi32(code, 31)));
  }
#endif
};

#if defined(GRACE_SIMD) && defined(__AVX2__)
// QsgdLevels::values8 of 8-bit codes, groups [g, g1) two at a time (16 codes) with AVX-512,
// written to out[8 g ..] or added there where kAdd. Returns where it stopped.
template <bool kAdd>
GRACE_AVX512 int64_t qsgd_values16(const uint8_t* packed, const QsgdLevels& levels, float norm, float* out, int64_t g,
                                   int64_t g1) {
  const __m512 r = _mm512_set1_ps(levels.rf), fl = _mm512_set1_ps(levels.fl), vn = _mm512_set1_ps(norm);
  for (; g + 2 <= g1; g += 2) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(packed + 8 * g)));
    const __m512 level = _mm512_cvtepi32_ps(_mm512_srli_epi32(code, 1));
    __m512 q = _mm512_mul_ps(level, r);
    if (levels.how == 2) q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, fl, level), r, q);
    const __m512i magnitude = _mm512_castps_si512(_mm512_mul_ps(q, vn));  // the sign: the code's low bit
    store_or_add16<kAdd>(out + 8 * g, _mm512_castsi512_ps(_mm512_xor_si512(magnitude, _mm512_slli_epi32(code, 31))));
  }
  return g;
}
#endif

// values of elements [g0*8, g1*8) ∩ [0, n): lut[code] * the norm of its bucket, bucket by bucket,
// element i written to out[i - base] (streamed where allowed and the output is large), or added
// to it where kAdd; computed by `levels` where it can (B > 5)
template <int B, bool kAdd = false>
void qsgd_decode_groups(const uint8_t* packed, int64_t n, int64_t b, const float* lut, const float* norms, float* out,
                        int64_t g0, int64_t g1, int64_t base = 0, bool may_stream = true,
                        const QsgdLevels* levels = nullptr) {
  const int64_t nbytes = (n * B + 7) / 8;
  out -= base;  // (out + i is element i's place; out[i] is only ever written for i >= base)
#ifdef GRACE_SIMD
  const bool stream = may_stream && streams(out + base, 4 * n);
#endif
  int64_t g = g0;
  while (g < g1) {
    const int64_t row = 8 * g / b, end = std::min(n, (row + 1) * b);  // the bucket of group g
    const float norm = norms[row];
    const int64_t whole = std::min(g1, end / 8);  // groups [g, whole) lie in this bucket
#if defined(GRACE_SIMD) && defined(__AVX2__)
    if (B > 5 && levels != nullptr && levels->how != 0 && std::isfinite(norm)) {
      const __m256 vn = _mm256_set1_ps(norm);
      if (B == 8 && kAvx512 && (kAdd || !stream)) g = qsgd_values16<kAdd>(packed, *levels, norm, out, g, whole);
      for (; g < whole; ++g) {
        const F8 v{levels->values8(unpack_word<B>(get_group<B>(packed, g, nbytes)), vn)};
        float* const o = out + 8 * g;
        if (kAdd) {
          st8(o, ld8(o) + v);
        } else {
          put8(o, v, stream);
        }
      }
    }
#endif
#ifdef GRACE_SIMD
    auto codes16 = [&](int64_t g) { return unpack16<B>(_mm_loadu_si128((const __m128i*)(packed + g * B))); };
    if (!kAdd && B <= 5 && std::isfinite(norm)) {
      const PlaneLut planes(lut, norm);
      for (; g + 2 <= whole && g * B + 16 <= nbytes; g += 2) planes.values16(codes16(g), out + 8 * g, stream);
    }
#endif
    for (; g < whole; ++g) {
      const uint64_t c = unpack_word<B>(get_group<B>(packed, g, nbytes));
      if (kAdd) {
        float v[8];
        qsgd_values8(c, lut, norm, v);
        for (int j = 0; j < 8; ++j) out[8 * g + j] += v[j];
      } else {
        qsgd_values8(c, lut, norm, out + 8 * g);
      }
    }
    if (g < g1 && 8 * g < end) {  // a group across a bucket's end or at the tensor's end
      const int64_t i0 = 8 * g;
      const int m = (int)std::min<int64_t>(8, n - i0);
      const uint64_t c = unpack_word<B>(get_group<B>(packed, g, nbytes, m));
      for (int j = 0; j < m; ++j) {
        const float v = lut[(c >> (8 * j)) & 255] * norms[(i0 + j) / b];
        out[i0 + j] = kAdd ? out[i0 + j] + v : v;
      }
      ++g;
    }
  }
#ifdef GRACE_SIMD
  fence_streams(stream);
#endif
}

// the value of each code c before the norm: (sign * level) / levels, as qsgd.py's decompress
void qsgd_code_values(int levels, float* lut) {
  for (int c = 0; c < 256; ++c) {
    float fc = (float)c;
    float level = std::floor(fc / 2.0f);
    float sign = 1.0f - 2.0f * (fc - 2.0f * level);
    lut[c] = sign * level / (float)levels;
  }
}
}  // namespace

API int grace_cpu_qsgd_decode(const uint8_t* packed, int64_t n, int levels, int64_t bucket, int bits,
                              const float* norms, float* out) {
  if (bits < 1 || bits > 8 || levels < 1) return -1;
  float lut[256];
  qsgd_code_values(levels, lut);
  const QsgdLevels computed(levels, lut);
  const int64_t b = qsgd_row(n, bucket);
  const int64_t groups = (n + 7) / 8;
  with_width(bits, [&](auto w) {
    for_chunks(groups, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
      qsgd_decode_groups<decltype(w)::value>(packed, n, b, lut, norms, out, g0, g1, 0, true, &computed);
    });
  });
  return 0;
}

namespace {
inline float natural_one(uint32_t c, bool neg) {
  float mag;
  uint32_t b = c << 23;  // 2**(c - 127) for c >= 1 (255: inf, as exp2(128) in float32)
  std::memcpy(&mag, &b, 4);
  return (neg ? -1.0f : 1.0f) * mag;
}

#if defined(GRACE_SIMD) && defined(__AVX2__)
// natural_decode_groups' groups [g0, g1) two at a time (16 elements) with AVX-512, not streamed:
// the codes as exponent bits, the sign byte pair the mask of the lanes that get the sign bit.
// Returns where it stopped.
template <bool kAdd>
GRACE_AVX512 int64_t natural_decode_groups16(const uint8_t* signs, const uint8_t* codes, int64_t g0, int64_t g1,
                                             float* dst) {
  const __m512i top = _mm512_set1_epi32(INT32_MIN);
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) {
    uint16_t neg;
    std::memcpy(&neg, signs + g, 2);
    const __m512i mag = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + 8 * g))), 23);
    const __m512 v = _mm512_castsi512_ps(_mm512_mask_or_epi32(mag, (__mmask16)neg, mag, top));
    store_or_add16<kAdd>(dst + 8 * (g - g0), v);
  }
  return g;
}
#endif

// groups [g0, g1) of 8 elements of a natural-compression payload, decoded into dst (dst[0]:
// element 8 g0); added to dst where kAdd (AVX2 builds)
template <bool kAdd = false>
void natural_decode_groups(const uint8_t* signs, const uint8_t* codes, int64_t g0, int64_t g1, float* dst,
                           bool stream) {
#if defined(GRACE_SIMD) && defined(__AVX2__)
  // sign * magnitude, exactly: the code as exponent bits, the sign bit on top; 8 at a time
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const int64_t g16 = kAvx512 && !stream ? natural_decode_groups16<kAdd>(signs, codes, g0, g1, dst) : g0;
  for (int64_t g = g16; g < g1; ++g) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 8 * g)));
    const __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(signs[g]), sel), sel);
    const __m256 v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(c, 23), _mm256_slli_epi32(neg, 31)));
    float* const o = dst + 8 * (g - g0);
    if (kAdd) {
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
    } else {
      store4(o, _mm256_castps256_ps128(v), stream);
      store4(o + 4, _mm256_extractf128_ps(v, 1), stream);
    }
  }
#else
  static_assert(!kAdd, "adding as it decodes: AVX2 builds only");
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t s = signs[g];
    const int64_t i0 = 8 * g;
    float* const o = dst + 8 * (g - g0);
#ifdef GRACE_SIMD
    __m128i c = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)(uint32_t)load_u64(codes + i0)));
    __m128i c1 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)(uint32_t)(load_u64(codes + i0) >> 32)));
    const __m128i sel0 = _mm_setr_epi32(1, 2, 4, 8), sel1 = _mm_setr_epi32(16, 32, 64, 128);
    const __m128i bb = _mm_set1_epi32(s), sign = _mm_set1_epi32((int)0x80000000u);
    __m128i s0 = _mm_and_si128(_mm_cmpeq_epi32(_mm_and_si128(bb, sel0), sel0), sign);
    __m128i s1 = _mm_and_si128(_mm_cmpeq_epi32(_mm_and_si128(bb, sel1), sel1), sign);
    store4(o, _mm_castsi128_ps(_mm_or_si128(_mm_slli_epi32(c, 23), s0)), stream);
    store4(o + 4, _mm_castsi128_ps(_mm_or_si128(_mm_slli_epi32(c1, 23), s1)), stream);
#else
    (void)stream;
    for (int j = 0; j < 8; ++j) {
      uint32_t b = (uint32_t)codes[i0 + j] << 23 | (uint32_t)((s >> j) & 1) << 31;
      float v;
      std::memcpy(&v, &b, 4);  // sign * magnitude: exact, the sign bit set on +-2**e and 0
      o[j] = v;
    }
#endif
  }
#endif
}

// elements [lo, hi) of a natural-compression payload of n elements into dst (lo a multiple of 8)
void natural_decode_range(const uint8_t* signs, const uint8_t* codes, int64_t lo, int64_t hi, float* dst, bool stream) {
  const int64_t full = hi / 8;
  natural_decode_groups(signs, codes, lo / 8, full, dst, stream);
  for (int64_t i = std::max(lo, 8 * full); i < hi; ++i)
    dst[i - lo] = natural_one(codes[i], (signs[i / 8] >> (i % 8)) & 1);
}
}  // namespace

API void grace_cpu_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out) {
  const bool stream = streams(out, 4 * n);
  for_chunks(n / 8, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    natural_decode_groups(signs, codes, g0, g1, out + 8 * g0, stream);
  });
  natural_decode_range(signs, codes, 8 * (n / 8), n, out + 8 * (n / 8), false);
  fence_streams(stream);
}

// ---- decoded sums: every rank's payload of a gradient decoded and added in one pass ----------
namespace {
// Every line of bytes [from, to) of p asked into the cache ahead of its use.
inline void prefetch_bytes(const uint8_t* p, int64_t from, int64_t to) {
  for (int64_t q = from; q < to; q += 64) __builtin_prefetch(p + q);
}

// out = the sum, row after row in float32, of `count` rows decoded by decode(j, lo, hi, dst)
// (row j's elements [lo, hi) into dst[0, hi - lo)): block by block, row 0 decoded into out and
// every further row into a buffer in L1, then added; or added by add(j, lo, hi, dst) itself
// where it can (it returns false where it cannot). Where `stream` (out 16-byte aligned), each
// block is summed and finished in L1 and then streamed to out. ahead(j, lo, hi) may ask for
// row j's inputs of elements [lo, hi) (its next block) as a block of it is decoded: the rows
// are read a short run at a time each, which the hardware prefetcher may not follow far enough.
struct NoAdd {
  bool operator()(int64_t, int64_t, int64_t, float*) const { return false; }
};
struct NoAhead {
  void operator()(int64_t, int64_t, int64_t) const {}
};

// decoded_sum's elements [lo, hi): lo a multiple of kDecodedBlock, hi one too, or n
constexpr int64_t kDecodedBlock = 2048;
template <class Decode, class Add = NoAdd, class Ahead = NoAhead>
void decoded_sum_range(int64_t count, int64_t lo, int64_t hi, float* out, const Finish& finish, bool stream,
                       const Decode& decode, const Add& add = Add(), const Ahead& ahead = Ahead()) {
  alignas(32) float buf[kDecodedBlock], sum[kDecodedBlock];
  for (int64_t b = lo; b < hi; b += kDecodedBlock) {
    const int64_t e = std::min(hi, b + kDecodedBlock), m = e - b, next = std::min(hi, e + kDecodedBlock);
    float* const o = stream ? sum : out + b;
    ahead(0, e, next);
    decode(0, b, e, o);
    for (int64_t j = 1; j < count; ++j) {
      ahead(j, e, next);
      if (add(j, b, e, o)) continue;
      decode(j, b, e, buf);
      int64_t i = 0;
#ifdef GRACE_SIMD
      for (; i + 8 <= m; i += 8) st8(o + i, ld8(o + i) + ld8(buf + i));
#endif
      for (; i < m; ++i) o[i] += buf[i];
    }
    finish.range(o, m);
    if (stream) {
      int64_t i = 0;
#ifdef GRACE_SIMD
      for (; i + 8 <= m; i += 8) put8(out + b + i, ld8(o + i), true);
#endif
      std::memcpy(out + b + i, o + i, 4 * (m - i));
    }
  }
  fence_streams(stream);
}
}  // namespace

// Segment s of a bucket: the ranks' payloads (signs[s * ranks + r], codes[...]) decoded and added
// into out[s] (numels[s] elements). With AVX2 each further row is added as it is decoded (the
// same sums, in the same order, without the row in a buffer).
API void grace_cpu_natural_sum_segments(int64_t segments, int ranks, const uint8_t* const* signs,
                                        const uint8_t* const* codes, const int64_t* numels, int vote,
                                        const float* divisors, int ndiv, float* const* out) {
  const Finish finish(vote, divisors, ndiv);
  const int64_t bytes = bucket_bytes(segments, numels);
  // every segment's chunks dealt to the threads at once
  for_segment_chunks(segments, numels, kDecodedBlock, [&](int64_t s, int64_t e0, int64_t e1) {
    const uint8_t* const* S = signs + s * ranks;
    const uint8_t* const* C = codes + s * ranks;
    decoded_sum_range(ranks, e0, e1, out[s], finish, streams(out[s], bytes),
                      [&](int64_t j, int64_t lo, int64_t hi, float* dst) {
      natural_decode_range(S[j], C[j], lo, hi, dst, false);
    }, [&](int64_t j, int64_t lo, int64_t hi, float* dst) {
#if defined(GRACE_SIMD) && defined(__AVX2__)
      natural_decode_groups<true>(S[j], C[j], lo / 8, hi / 8, dst, false);
      for (int64_t i = std::max(lo, 8 * (hi / 8)); i < hi; ++i)
        dst[i - lo] += natural_one(C[j][i], (S[j][i / 8] >> (i % 8)) & 1);
      return true;
#else
      (void)j, (void)lo, (void)hi, (void)dst;
      return false;
#endif
    });
  });
}

// Segment s of a bucket: the ranks' QSGD payloads (packed[s * ranks + r], norms[...]) decoded and
// added into out[s] (numels[s] elements). Returns < 0 on bad parameters.
API int grace_cpu_qsgd_sum_segments(int64_t segments, int ranks, const uint8_t* const* packed,
                                    const float* const* norms, const int64_t* numels, int levels, int64_t bucket,
                                    int bits, int vote, const float* divisors, int ndiv, float* const* out) {
  if (bits < 1 || bits > 8 || levels < 1) return -1;
  float lut[256];
  qsgd_code_values(levels, lut);
  const QsgdLevels computed(levels, lut);
  const Finish finish(vote, divisors, ndiv);
  const int64_t bytes = bucket_bytes(segments, numels);
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    // every segment's chunks dealt to the threads at once
    for_segment_chunks(segments, numels, kDecodedBlock, [&](int64_t s, int64_t e0, int64_t e1) {
      const int64_t n = numels[s], b = qsgd_row(n, bucket);
      const uint8_t* const* P = packed + s * ranks;
      const float* const* N = norms + s * ranks;
      decoded_sum_range(ranks, e0, e1, out[s], finish, streams(out[s], bytes),
                        [&](int64_t j, int64_t lo, int64_t hi, float* dst) {
        qsgd_decode_groups<B>(P[j], n, b, lut, N[j], dst, lo / 8, (hi + 7) / 8, lo, false, &computed);
      }, [&](int64_t j, int64_t lo, int64_t hi, float* dst) {  // further rows added as computed
        if (B <= 5 || computed.how == 0) return false;
        qsgd_decode_groups<B, true>(P[j], n, b, lut, N[j], dst, lo / 8, (hi + 7) / 8, lo, false, &computed);
        return true;
      }, [&](int64_t j, int64_t lo, int64_t hi) {  // (the sum of four ranks' 8-bit codes: a quarter faster)
        prefetch_bytes(P[j], lo * B / 8, (hi * B + 7) / 8);
      });
    });
  });
  return 0;
}
