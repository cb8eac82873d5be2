// grace CPU kernels: bit packing, fused quantize+pack, selection, error feedback, scatter-add.
//
// Compiled with -O3 -ffp-contract=off (no fused multiply-adds: every float operation rounds
// exactly as in the NumPy reference) and OpenMP; on x86-64 twice, for x86-64-v2 (SSE4.2: 8
// float lanes in two registers) and x86-64-v3 (AVX2: one register), the same results. Each
// kernel is a pass or two over memory; float32 sums reproduce NumPy's pairwise summation, so
// payload bytes equal the reference.
#include "grace_native.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <pthread.h>
#include <strings.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__SSE4_1__)
#include <smmintrin.h>
#define GRACE_SIMD 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define API extern "C" __attribute__((visibility("default")))

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed format is little-endian");

namespace {

// ---- threads -------------------------------------------------------------------------------
// libgomp is not fork-safe: a child of a process that ran a parallel region would hang in its
// first one. After fork every kernel runs on the calling thread only.
std::atomic<bool> g_forked{false};
std::atomic<int> g_threads{0};
void on_fork_child() { g_forked.store(true); }
struct AtFork {
  AtFork() { pthread_atfork(nullptr, nullptr, on_fork_child); }
} at_fork_;

// elements per thread below which waking another thread costs more than it saves (thread
// wake-ups take tens of microseconds on shared virtual machines)
constexpr int64_t kGrain = 1 << 17;

int max_threads() {
  if (g_forked.load()) return 1;
  int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
}

int threads_for(int64_t work, int64_t grain = kGrain) {
  int t = max_threads();
  int64_t by_work = work / grain;
  return (int)std::max<int64_t>(1, std::min<int64_t>(t, by_work));
}

// ---- AVX-512 -------------------------------------------------------------------------------
#if defined(__AVX2__)
// A few kernels of the x86-64-v3 build have a 16-lane body compiled for AVX-512 (GRACE_AVX512 on
// the function; the same operations as their 8-lane loop, so the same results), taken where the
// CPU has it, asked when the library loads (__builtin_cpu_init first: a static initializer may
// run before libgcc's own). GRACE_NATIVE_AVX512=0 in the environment keeps the 8-lane loops.
#define GRACE_AVX512 __attribute__((target("avx512f")))
// (read as the loader reads GRACE_NATIVE: "0", "false", "no" or "off", any case, around spaces)
bool avx512_wanted() {
  const char* v = std::getenv("GRACE_NATIVE_AVX512");
  if (!v) return true;
  while (*v == ' ') ++v;
  const size_t n = std::strcspn(v, " ");
  for (const char* off : {"0", "false", "no", "off"})
    if (std::strlen(off) == n && strncasecmp(v, off, n) == 0) return false;
  return true;
}
const bool kAvx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f")) && avx512_wanted();
#else
constexpr bool kAvx512 = false;
#endif

// ---- memory streams ------------------------------------------------------------------------
// The hardware prefetcher of one core does not keep two or three input streams busy enough:
// the passes over large inputs prefetch this many bytes ahead, one line at a time.
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch(const void* p) {
#if defined(__SSE2__)
  _mm_prefetch((const char*)p + kPrefetchBytes, _MM_HINT_T0);
#else
  __builtin_prefetch((const char*)p + kPrefetchBytes);
#endif
}

// Outputs of at least this many bytes (beyond the caches) are written with streaming stores,
// as memcpy does: no read of each line before it is overwritten, half the memory traffic.
constexpr int64_t kStreamBytes = 8 << 20;
inline bool streams(const void* out, int64_t bytes) { return bytes >= kStreamBytes && (uintptr_t)out % 16 == 0; }
#if defined(__SSE2__)
// 4 floats at out (16-byte aligned when stream), streamed or stored
inline void store4(float* out, __m128 v, bool stream) {
  if (stream)
    _mm_stream_ps(out, v);
  else
    _mm_storeu_ps(out, v);
}
#endif
// after a kernel's streamed stores: they land before the caller's next reads
inline void fence_streams(bool stream) {
#if defined(__SSE2__)
  if (stream) _mm_sfence();
#endif
}

// [lo, hi) of chunk c of nc over n items, boundaries multiples of align.
inline void chunk_bounds(int64_t n, int64_t align, int nc, int c, int64_t& lo, int64_t& hi) {
  int64_t units = (n + align - 1) / align;
  int64_t per = (units + nc - 1) / nc;
  lo = std::min(n, c * per * align);
  hi = std::min(n, (c + 1) * per * align);
}

// f(chunk, lo, hi) for nc contiguous chunks, in parallel; chunk c always covers the same range.
template <class F>
void for_chunks(int64_t n, int64_t align, int nc, F&& f) {
  if (nc <= 1) {
    f(0, (int64_t)0, n);
    return;
  }
#pragma omp parallel num_threads(nc)
  {
    int T = omp_get_num_threads();
    for (int c = omp_get_thread_num(); c < nc; c += T) {
      int64_t lo, hi;
      chunk_bounds(n, align, nc, c, lo, hi);
      f(c, lo, hi);
    }
  }
}

// ---- NumPy's pairwise summation ------------------------------------------------------------
// numpy/_core/src/umath/loops_utils.h.src: n < 8: a plain loop; n <= 128: 8 accumulators
// combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)) then the rest; else split at
// n2 = n/2 - (n/2)%8. The reduction starts from 0, so the result is 0.0f + pairwise(a).
// A Leaf computes the S sums of one block (n <= 128), leaf(lo, n), and may do more work on the
// way (packing the block's codes): one pass over memory. Block starts are multiples of 8.
constexpr int64_t kBlock = 128;

template <int S>
struct Sums {
  float v[S];
};

inline int64_t pw_half(int64_t n) {
  int64_t n2 = n / 2;
  return n2 - n2 % 8;
}

template <int S, class Leaf>
Sums<S> pairwise_seq(const Leaf& leaf, int64_t lo, int64_t n) {
  if (n <= kBlock) return leaf(lo, n);
  const int64_t n2 = pw_half(n);
  Sums<S> a = pairwise_seq<S>(leaf, lo, n2);
  Sums<S> b = pairwise_seq<S>(leaf, lo + n2, n - n2);
  for (int s = 0; s < S; ++s) a.v[s] = a.v[s] + b.v[s];
  return a;
}

struct Node {
  int64_t lo, n;
};

void pw_collect(int64_t lo, int64_t n, int64_t cutoff, std::vector<Node>& out) {
  if (n <= kBlock || n <= cutoff) {
    out.push_back({lo, n});
    return;
  }
  const int64_t n2 = pw_half(n);
  pw_collect(lo, n2, cutoff, out);
  pw_collect(lo + n2, n - n2, cutoff, out);
}

template <int S>
Sums<S> pw_combine(int64_t n, int64_t cutoff, const std::vector<Sums<S>>& vals, size_t& pos) {
  if (n <= kBlock || n <= cutoff) return vals[pos++];
  const int64_t n2 = pw_half(n);
  Sums<S> a = pw_combine<S>(n2, cutoff, vals, pos);
  Sums<S> b = pw_combine<S>(n - n2, cutoff, vals, pos);
  for (int s = 0; s < S; ++s) a.v[s] = a.v[s] + b.v[s];
  return a;
}

// The same tree, its top levels cut into subtrees evaluated in parallel: the result does not
// depend on the number of threads.
template <int S, class Leaf>
Sums<S> pairwise(const Leaf& leaf, int64_t n, int nt) {
  Sums<S> root;
  if (nt <= 1) {
    root = pairwise_seq<S>(leaf, 0, n);
  } else {
    std::vector<Node> nodes;
    pw_collect(0, n, std::max<int64_t>(kBlock, n / (8 * nt)), nodes);
    std::vector<Sums<S>> vals(nodes.size());
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)nodes.size(); ++i) vals[i] = pairwise_seq<S>(leaf, nodes[i].lo, nodes[i].n);
    size_t pos = 0;
    root = pw_combine<S>(n, std::max<int64_t>(kBlock, n / (8 * nt)), vals, pos);
  }
  for (int s = 0; s < S; ++s) root.v[s] = 0.0f + root.v[s];
  return root;
}

// A leaf over terms t(i, sums[S]) for i in [lo, lo+n): NumPy's block and small-n loops.
template <int S, class Term>
inline Sums<S> leaf_sums(const Term& term, int64_t lo, int64_t n) {
  Sums<S> res;
  if (n < 8) {
    for (int s = 0; s < S; ++s) res.v[s] = -0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float t[S];
      term(lo + i, t);
      for (int s = 0; s < S; ++s) res.v[s] += t[s];
    }
    return res;
  }
  float r[S][8];
  for (int j = 0; j < 8; ++j) {
    float t[S];
    term(lo + j, t);
    for (int s = 0; s < S; ++s) r[s][j] = t[s];
  }
  int64_t i = 8;
  for (; i < n - (n % 8); i += 8)
    for (int j = 0; j < 8; ++j) {
      float t[S];
      term(lo + i + j, t);
      for (int s = 0; s < S; ++s) r[s][j] += t[s];
    }
  for (int s = 0; s < S; ++s)
    res.v[s] = ((r[s][0] + r[s][1]) + (r[s][2] + r[s][3])) + ((r[s][4] + r[s][5]) + (r[s][6] + r[s][7]));
  for (; i < n; ++i) {
    float t[S];
    term(lo + i, t);
    for (int s = 0; s < S; ++s) res.v[s] += t[s];
  }
  return res;
}

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
      p = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi16(m1)), _mm_srli_epi16(_mm_and_si128(c, _mm_set1_epi16(m1 << 8)), 8 - B));
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

template <int B>
void pack_groups(const uint8_t* codes, uint8_t* out, int64_t g0, int64_t g1) {
  int64_t g = g0;
#ifdef GRACE_SIMD
  for (; g + 2 <= g1; g += 2) put16<B>(out, g, g1, pack16<B>(_mm_loadu_si128((const __m128i*)(codes + 8 * g))));
#endif
  for (; g < g1; ++g) put_group<B>(out, g, g1, pack_word<B>(load_u64(codes + 8 * g)));
}

template <int B>
void unpack_groups(const uint8_t* packed, uint8_t* codes, int64_t g0, int64_t g1, int64_t nbytes) {
  int64_t g = g0;
#ifdef GRACE_SIMD
  for (; g + 2 <= g1 && g * B + 16 <= nbytes; g += 2)
    _mm_storeu_si128((__m128i*)(codes + 8 * g), unpack16<B>(_mm_loadu_si128((const __m128i*)(packed + g * B))));
#endif
  for (; g < g1; ++g) {
    uint64_t w = unpack_word<B>(get_group<B>(packed, g, nbytes));
    std::memcpy(codes + 8 * g, &w, 8);
  }
}

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


// x * x as float32 multiplication rounds it, computed in float64 and rounded once: the same
// float (the exact product of two 24-bit significands fits float64's 53 bits, with no
// underflow), but a product below float32's normal range costs a microcode assist on some CPUs
// (14x slower per instruction on the Intel VM of the benchmarks) where its conversion does not.
// Deep nets' vanishing gradients (1e-20 and below) square to such products.
inline float square(float x) { return (float)((double)x * (double)x); }

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

// ---- the blocks of a pairwise sum -----------------------------------------------------------
// Terms give a kernel's S summands: terms(i, float t[S]) of element i and, with SIMD,
// terms.group(i, F8 t[S]) of the 8 elements from i (i a multiple of 8); both may do the
// kernel's other work for those elements on the way, visited in ascending order.
// Blocks<S, Terms> is the Leaf of pairwise() for them: NumPy's block loop, 8 lanes at a time.
template <int S, class Terms>
struct Blocks {
  Terms terms;
  Sums<S> operator()(int64_t lo, int64_t n) const {
    // a local copy, kept in registers: the kernels' byte stores may alias anything in memory,
    // this object's pointers included, which would be read again after every store
    const Terms terms = this->terms;
#ifdef GRACE_SIMD
    if (n >= 8) {
      F8 r[S], t[S];
      terms.group(lo, r);
      int64_t i = 8;
      for (; i + 8 <= n; i += 8) {
        terms.group(lo + i, t);
        for (int s = 0; s < S; ++s) r[s] = r[s] + t[s];
      }
      Sums<S> res;
      for (int s = 0; s < S; ++s) res.v[s] = combine8(r[s]);
      for (; i < n; ++i) {
        float t1[S];
        terms(lo + i, t1);
        for (int s = 0; s < S; ++s) res.v[s] += t1[s];
      }
      return res;
    }
#endif
    return leaf_sums<S>(terms, lo, n);
  }
};

// NumPy's pairwise sums of terms over [0, n), the top of the tree on nt threads
template <int S, class Terms>
Sums<S> pairwise_sums(const Terms& terms, int64_t n, int nt) {
  return pairwise<S>(Blocks<S, Terms>{terms}, n, nt);
}

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

// ---- float keys for selection --------------------------------------------------------------
template <class T>
struct KeyOf;
template <>
struct KeyOf<float> {
  using K = uint32_t;
  static constexpr int kBits = 32;
  static K key(float x, bool by_abs) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if (by_abs) return u & 0x7fffffffu;
    return (u >> 31) ? ~u : (u | 0x80000000u);
  }
};
template <>
struct KeyOf<double> {
  using K = uint64_t;
  static constexpr int kBits = 64;
  static K key(double x, bool by_abs) {
    uint64_t u;
    std::memcpy(&u, &x, 8);
    if (by_abs) return u & 0x7fffffffffffffffULL;
    return (u >> 63) ? ~u : (u | 0x8000000000000000ULL);
  }
};

template <class I>
inline void put_idx(void* idx, int64_t pos, int64_t i) {
  static_cast<I*>(idx)[pos] = (I)i;
}

inline void write_index(void* idx, int idx_type, int64_t pos, int64_t i) {
  switch (idx_type) {
    case GRACE_U8: put_idx<uint8_t>(idx, pos, i); break;
    case GRACE_I16: put_idx<int16_t>(idx, pos, i); break;
    case GRACE_I32: put_idx<int32_t>(idx, pos, i); break;
    default: put_idx<int64_t>(idx, pos, i); break;
  }
}

bool idx_type_ok(int t) { return t >= GRACE_U8 && t <= GRACE_I64; }

}  // namespace

// =============================================================================================
API int grace_cpu_abi(void) { return GRACE_NATIVE_ABI; }
API const char* grace_cpu_isa(void) {
#if defined(__AVX2__)
  return "x86-64-v3";
#elif defined(__SSE4_2__)
  return "x86-64-v2";
#else
  return "generic";
#endif
}
API int grace_cpu_uses_avx512(void) { return kAvx512 ? 1 : 0; }
API int grace_cpu_runs_x86_64_v3(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v3") ? 1 : 0;
#elif defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
         __builtin_cpu_supports("bmi2");
#else
  return 0;
#endif
}
API void grace_cpu_set_num_threads(int n) { g_threads.store(n > 0 ? n : 0); }
API int grace_cpu_get_num_threads(void) { return max_threads(); }

// ---- packing ---------------------------------------------------------------------------------
API int grace_cpu_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  const int64_t full = n / 8, rem = n % 8;
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) { pack_groups<B>(codes, out, g0, g1); });
    if (rem) {
      uint64_t c = 0;
      std::memcpy(&c, codes + 8 * full, rem);
      uint64_t p = pack_word<B>(c);
      std::memcpy(out + full * B, &p, (rem * B + 7) / 8);
    }
  });
  return 0;
}

API int grace_cpu_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  const int64_t full = n / 8, rem = n % 8, nbytes = (n * bits + 7) / 8;
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) { unpack_groups<B>(packed, codes, g0, g1, nbytes); });
    if (rem) {
      uint64_t c = unpack_word<B>(get_group<B>(packed, full, nbytes, (int)rem));
      std::memcpy(codes + 8 * full, &c, rem);
    }
  });
  return 0;
}

// ---- sign family -----------------------------------------------------------------------------
namespace {
// grace_cpu_sign_pack, telling `bad` (where given) whether x holds an inf or a NaN
void sign_pack(const float* x, int64_t n, int negative, uint8_t* out, std::atomic<bool>* bad) {
  int64_t full = n / 8, rem = n % 8;
  // (x, out and the sign taken by value: a byte store may alias whatever is captured by reference,
  // which would then be read again for every byte)
  for_chunks(full, 1, threads_for(n), [x, out, neg = negative != 0, bad](int, int64_t g0, int64_t g1) {
    FiniteCheck check;
    int64_t g = g0;
#ifdef GRACE_SIMD
    // 32 elements, four bytes, a step: a line read ahead and more loads in flight per instruction
    const F8 zero = set8(0.0f);
    F8 nonfinite = zero;  // x - x or-ed: 0, or a NaN's bits
    for (; g + 4 <= g1; g += 4) {
      prefetch(x + 8 * g);
      prefetch(x + 8 * g + 16);
      uint32_t word = 0;
      for (int q = 0; q < 4; ++q) {
        const F8 v = ld8(x + 8 * (g + q));
        nonfinite = or8(nonfinite, v - v);
        word |= (uint32_t)mask8(neg ? lt8(v, zero) : ge8(v, zero)) << (8 * q);
      }
      std::memcpy(out + g, &word, 4);
    }
    check.add8(nonfinite);
#endif
    for (; g < g1; ++g) {
      check.range(x, 8 * g, 8 * g + 8);
      out[g] = sign_byte(x + 8 * g, neg);
    }
    report(check, bad);
  });
  if (rem) {
    FiniteCheck check;
    check.range(x, 8 * full, n);
    report(check, bad);
    uint8_t m = 0;
    for (int64_t j = 0; j < rem; ++j) {
      float v = x[8 * full + j];
      m |= (uint8_t)((negative ? v < 0.0f : v >= 0.0f) << j);
    }
    out[full] = m;
  }
}
}  // namespace

API void grace_cpu_sign_pack(const float* x, int64_t n, int negative, uint8_t* out) {
  sign_pack(x, n, negative, out, nullptr);
}

namespace {
// bit i % 8 of out[i / 8]: the first element of a byte clears the others
inline void put_bit(uint8_t* out, int64_t i, bool bit) {
  const uint8_t b = (uint8_t)(bit << (i % 8));
  out[i / 8] = i % 8 ? (uint8_t)(out[i / 8] | b) : b;
}

// |x| for the scale; the sign bits (x >= 0) on the way
struct EfsignTerms {
  const float* x;
  uint8_t* out;
  void operator()(int64_t i, float* t) const {
    t[0] = std::fabs(x[i]);
    put_bit(out, i, x[i] >= 0.0f);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    const F8 v = ld8(x + i);
    out[i / 8] = (uint8_t)mask8(ge8(v, set8(0.0f)));
    t[0] = abs8(v);
  }
#endif
};

// (x >= 0), x where x >= 0 (else x * 0: NaN stays NaN) and x; the sign bits on the way
struct OnebitTerms {
  const float* x;
  uint8_t* out;
  void operator()(int64_t i, float* t) const {
    const float v = x[i];
    const bool pos = v >= 0.0f;
    t[0] = pos ? 1.0f : 0.0f;
    t[1] = pos ? v : v * 0.0f;
    t[2] = v;
    put_bit(out, i, pos);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    const F8 v = ld8(x + i), zero = set8(0.0f), m = ge8(v, zero);
    out[i / 8] = (uint8_t)mask8(m);
    t[0] = and8(m, set8(1.0f));
    t[1] = sel8(m, v, v * zero);
    t[2] = v;
  }
#endif
};
}  // namespace

namespace {
// EF-signSGD's scale from its sums: sum|x| / max(1, n)
void efsign_scale(const Sums<1>& s, int64_t n, float* scale) { scale[0] = s.v[0] / (float)std::max<int64_t>(1, n); }

// 1-bit SGD's means [mu0, mu1] from its sums, as grace/compressors/onebit.py computes them
void onebit_means(const Sums<3>& s, int64_t n, float* means) {
  float n_pos = s.v[0], sum_pos = s.v[1], total = s.v[2];
  float d1 = n_pos < 1.0f ? 1.0f : n_pos;
  float rest = (float)n - n_pos;
  float d0 = rest < 1.0f ? 1.0f : rest;
  means[1] = sum_pos / d1;
  means[0] = (total - sum_pos) / d0;
}
}  // namespace

// EF-signSGD: bits (x >= 0) and scale = sum|x| / max(1, n), in one pass
API void grace_cpu_efsign_compress(const float* x, int64_t n, uint8_t* out, float* scale) {
  efsign_scale(pairwise_sums<1>(EfsignTerms{x, out}, n, threads_for(n)), n, scale);
}

// 1-bit SGD: bits (x >= 0), means [mu0, mu1]
API void grace_cpu_onebit_compress(const float* x, int64_t n, uint8_t* out, float* means) {
  onebit_means(pairwise_sums<3>(OnebitTerms{x, out}, n, threads_for(n)), n, means);
}

// ---- counter-based uniform draws --------------------------------------------------------------
namespace {
// grace/core/draws.py's hash32 of a value below 2**64: the first xor-shift sees all 64 bits,
// every later step only the low 32 (its products are taken mod 2**32)
inline uint32_t hash32(uint64_t h) {
  h ^= h >> 16;
  uint32_t x = (uint32_t)h * 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

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

// f(u, ubase, g, ge) on groups [g0, g1) of 8 elements, a block at a time, u holding the draws of
// seed words (s0, s1) for elements [8 g, min(n, 8 ge)): element i's draw (draw i) is u[i - ubase].
// Made in L1 where they are used: no tensor of n draws written and read back.
template <class F>
void with_draws(int64_t n, int64_t g0, int64_t g1, uint32_t s0, uint32_t s1, const F& f) {
  constexpr int64_t kGroups = 256;  // draws of 2048 elements at a time
  alignas(32) float u[8 * kGroups];
  for (int64_t g = g0; g < g1; g += kGroups) {
    const int64_t ge = std::min(g1, g + kGroups);
    uniform_range(8 * g, std::min(n, 8 * ge), s0, s1, u);
    f(u, 8 * g, g, ge);
  }
}
}  // namespace

// ---- terngrad --------------------------------------------------------------------------------
namespace {
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

// QSGD's bucket in a tensor of n elements: `bucket`, or the whole tensor (bucket 0, or one past its end)
inline int64_t qsgd_row(int64_t n, int64_t bucket) {
  return bucket > 0 && bucket < n ? bucket : std::max<int64_t>(n, 1);
}

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
// A row's two decoded values, as its decoder computes them from its scalars (mode 0 signSGD:
// none; 1 scaled sign: the scale; 2 1-bit SGD: the two means).
inline void row_values(const float* scalars, int mode, float& lo, float& hi) {
  if (mode == 2) {
    const float mu0 = scalars[0], d = scalars[1] - mu0;
    lo = mu0 + 0.0f * d;
    hi = mu0 + 1.0f * d;
  } else {
    const float s = mode == 1 ? scalars[0] : 1.0f;
    lo = -1.0f * s;
    hi = 1.0f * s;
  }
}

// How an aggregate follows from the sum of the ranks' decoded payloads, element by element (the
// compressor's from_sum): its sign where `vote` (a majority vote), then divided by each divisor
// in turn; each step rounds as the tensor ops do.
// Whether x / d is x * (1 / d) to the bit for every x: d a power of two (both then round the
// same exact value once), and a product costs a fraction of a quotient.
inline bool exact_reciprocal(float d) {
  int e;
  return std::isfinite(d) && d > 0 && std::frexp(d, &e) == 0.5f && std::fpclassify(1.0f / d) == FP_NORMAL;
}

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

#if defined(GRACE_SIMD) && defined(__AVX2__)
GRACE_AVX512 inline void finish16(float* p, __m512 v, const Finish& finish, bool stream) {
  if (finish.none() && !stream) return _mm512_storeu_ps(p, v);
  put8(p, finish.none() ? low8(v) : finish.apply8(low8(v)), stream);
  put8(p + 8, finish.none() ? high8(v) : finish.apply8(high8(v)), stream);
}

// bits_sum_rows' groups [g, g1) 4 at a time (32 elements, four bytes of each row) with AVX-512:
// a row's 16 bits are the mask that picks hi or lo per lane. Returns where it stopped.
GRACE_AVX512 int64_t bits_sum_rows32(const uint8_t* const* rows, const float* lo, const float* hi, int64_t count,
                                     int64_t g, int64_t g1, float* out, const Finish& finish, bool stream) {
  for (; g + 4 <= g1; g += 4) {
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

// out = the sum, row after row in float32, of the rows of n bits decoded to lo[j] / hi[j]
// (then finished); streamed where `stream` (out 16-byte aligned).
void bits_sum_rows(const uint8_t* const* rows, const float* lo, const float* hi, int64_t count, int64_t n, float* out,
                   const Finish& finish = Finish(), bool stream = false) {
  const int64_t full = n / 8;
  for_chunks(full, 16, threads_for(n), [&](int, int64_t g0, int64_t g1) {
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
    const __m256i shift[4] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
                              _mm256_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23),
                              _mm256_setr_epi32(24, 25, 26, 27, 28, 29, 30, 31)};
    if (kAvx512) g = bits_sum_rows32(rows, lo, hi, count, g, g1, out, finish, stream);
    for (; g + 4 <= g1; g += 4) {
      F8 acc[4];
      for (int64_t j = 0; j < count; ++j) {
        uint32_t w;
        std::memcpy(&w, rows[j] + g, 4);
        const __m256i word = _mm256_set1_epi32((int)w);
        for (int q = 0; q < 4; ++q) {
          const F8 v{_mm256_permutevar8x32_ps(two[j], _mm256_and_si256(_mm256_srlv_epi32(word, shift[q]), one))};
          acc[q] = j ? acc[q] + v : v;
        }
      }
      for (int q = 0; q < 4; ++q) put8(out + 8 * (g + q), plain ? acc[q] : finish.apply8(acc[q]), stream);
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
  });
  for (int64_t i = 8 * full; i < n; ++i) {
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
void sign_sum_rows(const uint8_t* const* rows, int64_t count, int64_t n, float* out, const Finish& finish,
                   bool stream) {
  const int64_t full = n / 32;
  const bool vote_only = finish.vote && finish.count == 0;
  for_chunks(full, 4, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  // lane: its byte
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  // lane: its bit
    const __m256i below = _mm256_set1_epi8((char)(count / 2)), above = _mm256_set1_epi8((char)(count - count / 2));
    const __m256i vcount = _mm256_set1_epi32((int)count);
    for (int64_t g = g0; g < g1; ++g) {
      __m256i c = _mm256_setzero_si256();
      for (int64_t j = 0; j < count; ++j) {
        uint32_t w;
        std::memcpy(&w, rows[j] + 4 * g, 4);
        const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w), spread);
        c = _mm256_sub_epi8(c, _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit));
      }
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
  });
  for (int64_t i = 32 * full; i < n; ++i) {  // row after row, as bits_sum_rows
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
void terngrad_sum_rows(const uint8_t* const* rows, const float* scale, int64_t count, int64_t n, float* out,
                       const Finish& finish = Finish(), bool stream = false) {
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
  const int64_t full = n / 4;
  for_chunks(full, 16, threads_for(n), [&](int, int64_t g0, int64_t g1) {
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
  });
  for (int64_t i = 4 * full; i < n; ++i) out[i] = one(i);
}

// The sum of `count` rows of one gradient's codes; row j at rows[j], its scalars at scalars[j]
// (mode as in grace_native.h).
void codes_sum_rows(const uint8_t* const* rows, const float* const* scalars, int mode, int64_t count, int64_t n,
                    float* out, const Finish& finish = Finish(), bool stream = false) {
  if (mode == kTernGrad) {
    std::vector<float> scale(count);
    for (int64_t j = 0; j < count; ++j) scale[j] = scalars[j][0];
    terngrad_sum_rows(rows, scale.data(), count, n, out, finish, stream);
    return;
  }
#if defined(GRACE_SIMD) && defined(__AVX2__)
  if (mode == 0 && count <= 127) return sign_sum_rows(rows, count, n, out, finish, stream);
#endif
  std::vector<float> lo(count), hi(count);
  for (int64_t j = 0; j < count; ++j) row_values(mode ? scalars[j] : nullptr, mode, lo[j], hi[j]);
  bits_sum_rows(rows, lo.data(), hi.data(), count, n, out, finish, stream);
}

// The bytes of a bucket's float32 outputs: a bucket call streams every segment's output where
// they are beyond the caches together (each gradient's alone may not be), as `streams` says.
int64_t bucket_bytes(int64_t segments, const int64_t* numels) {
  int64_t n = 0;
  for (int64_t s = 0; s < segments; ++s) n += std::max<int64_t>(0, numels[s]);
  return 4 * n;
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
  codes_sum_rows(rows.data(), row_scalars.data(), mode, count, n, out, Finish(), streams(out, 4 * n));
}

// grace_cpu_bits_sum of each segment s of a bucket: the ranks' rows packed[s * ranks + r] with
// their scalars scalars[s * ranks + r] (NULL for signSGD), summed and finished into out[s].
API void grace_cpu_bits_sum_segments(int64_t segments, int ranks, const uint8_t* const* packed,
                                     const float* const* scalars, int mode, const int64_t* numels, int vote,
                                     const float* divisors, int ndiv, float* const* out) {
  std::vector<const float*> none(ranks, nullptr);
  const Finish finish(vote, divisors, ndiv);
  const int64_t bytes = bucket_bytes(segments, numels);
  for (int64_t s = 0; s < segments; ++s) {
    if (numels[s] <= 0 || ranks <= 0) continue;
    codes_sum_rows(packed + s * ranks, mode ? scalars + s * ranks : none.data(), mode, ranks, numels[s], out[s],
                   finish, streams(out[s], bytes));
  }
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

API void grace_cpu_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out) {
  const float s = scale[0];
  const float val[4] = {0.0f * s, 1.0f * s, -1.0f * s, -1.0f * s};
  float lut[256][4];  // a byte's four values
  for (int b = 0; b < 256; ++b)
    for (int j = 0; j < 4; ++j) lut[b][j] = val[(b >> (2 * j)) & 3];
  const int64_t full = n / 4;
#if defined(__SSE2__)
  const bool stream = streams(out, 4 * n);
  for_chunks(full, 16, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) store4(out + 4 * g, _mm_loadu_ps(lut[packed[g]]), stream);
  });
  fence_streams(stream);
#else
  for_chunks(full, 16, threads_for(n), [&](int, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) std::memcpy(out + 4 * g, lut[packed[g]], 16);
  });
#endif
  for (int64_t i = 4 * full; i < n; ++i) out[i] = val[(packed[full] >> (2 * (i - 4 * full))) & 3];
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

template <class Decode, class Add = NoAdd, class Ahead = NoAhead>
void decoded_sum(int64_t count, int64_t n, float* out, const Finish& finish, bool stream, const Decode& decode,
                 const Add& add = Add(), const Ahead& ahead = Ahead()) {
  constexpr int64_t kBlock = 2048;
  for_chunks(n, kBlock, threads_for(n), [&](int, int64_t lo, int64_t hi) {
    alignas(32) float buf[kBlock], sum[kBlock];
    for (int64_t b = lo; b < hi; b += kBlock) {
      const int64_t e = std::min(hi, b + kBlock), m = e - b, next = std::min(hi, e + kBlock);
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
  });
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
  for (int64_t s = 0; s < segments; ++s) {
    const uint8_t* const* S = signs + s * ranks;
    const uint8_t* const* C = codes + s * ranks;
    decoded_sum(ranks, numels[s], out[s], finish, streams(out[s], bytes), [&](int64_t j, int64_t lo, int64_t hi, float* dst) {
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
  }
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
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t n = numels[s], b = qsgd_row(n, bucket);
    const uint8_t* const* P = packed + s * ranks;
    const float* const* N = norms + s * ranks;
    with_width(bits, [&](auto w) {
      constexpr int B = decltype(w)::value;
      decoded_sum(ranks, n, out[s], finish, streams(out[s], bytes), [&](int64_t j, int64_t lo, int64_t hi, float* dst) {
        qsgd_decode_groups<B>(P[j], n, b, lut, N[j], dst, lo / 8, (hi + 7) / 8, lo, false, &computed);
      }, [&](int64_t j, int64_t lo, int64_t hi, float* dst) {  // further rows added as computed
        if (B <= 5 || computed.how == 0) return false;
        qsgd_decode_groups<B, true>(P[j], n, b, lut, N[j], dst, lo / 8, (hi + 7) / 8, lo, false, &computed);
        return true;
      }, [&](int64_t j, int64_t lo, int64_t hi) {  // (the sum of four ranks' 8-bit codes: a quarter faster)
        prefetch_bytes(P[j], lo * B / 8, (hi * B + 7) / 8);
      });
    });
  }
  return 0;
}

// ---- selection -------------------------------------------------------------------------------
namespace {
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;

size_t idx_size(int t) { return t == GRACE_U8 ? 1 : t == GRACE_I16 ? 2 : t == GRACE_I32 ? 4 : 8; }

// The need-th largest of the keys (1 <= need <= their number), by most-significant-digit radix
// selection: a histogram of the 11 bits below the keys' common prefix finds the bin it lies in,
// then the same on that bin's keys only (branch-free passes, where nth_element mispredicts).
template <class K>
K kth_largest(const std::vector<K>& keys, int64_t need) {
  std::vector<K> live;
  const K* cur = keys.data();
  int64_t m = (int64_t)keys.size();
  K lo = cur[0], hi = cur[0];
  for (int64_t j = 1; j < m; ++j) {
    lo = std::min(lo, cur[j]);
    hi = std::max(hi, cur[j]);
  }
  int64_t hist[kBins];
  while (lo != hi) {
    const int top = 64 - __builtin_clzll((unsigned long long)(lo ^ hi));  // bits below the common prefix
    const int shift = std::max(0, top - kRadixBits);
    const K base = lo >> shift;
    int b = (int)((hi >> shift) - base);  // < 2^(top - shift) <= kBins
    std::fill(hist, hist + b + 1, 0);
    for (int64_t j = 0; j < m; ++j) hist[(cur[j] >> shift) - base]++;
    int64_t above = 0;
    while (above + hist[b] < need) above += hist[b--];
    need -= above;
    const K bin = base + (K)b;
    if (shift == 0) return bin;
    std::vector<K> next;
    next.reserve(hist[b]);
    for (int64_t j = 0; j < m; ++j)
      if ((cur[j] >> shift) == bin) next.push_back(cur[j]);
    live.swap(next);
    cur = live.data();
    m = (int64_t)live.size();
    lo = hi = cur[0];
    for (int64_t j = 1; j < m; ++j) {
      lo = std::min(lo, cur[j]);
      hi = std::max(hi, cur[j]);
    }
  }
  return lo;
}

// The `need` largest of the candidates (indices ascending, with their keys), ties to the
// lowest index; indices ascending into `chosen`.
template <class K>
void choose_largest(const std::vector<int64_t>& cand, const std::vector<K>& cand_key, int64_t need,
                    std::vector<int64_t>& chosen) {
  const int64_t n_cand = (int64_t)cand.size();
  chosen.clear();
  chosen.reserve(need);
  if (need == n_cand) {
    chosen = cand;
    return;
  }
  const K T = kth_largest(cand_key, need);
  int64_t greater = 0;
  for (int64_t j = 0; j < n_cand; ++j) greater += cand_key[j] > T;
  int64_t ties = need - greater;
  for (int64_t j = 0; j < n_cand; ++j) {
    if (cand_key[j] > T || (cand_key[j] == T && ties-- > 0)) chosen.push_back(cand[j]);
  }
}

// The k largest keys (1 <= k < n), ties to the lowest index; indices ascending into `out`.
// hist1(c, lo, hi, hist): chunk c's histogram of key >> shift (the first pass, which may do
// more: topk_ef computes and stores p there). key(i): element i's order-preserving key.
// Pass 2 sends each chunk's elements above the boundary bin to their final place and the
// bin's own elements to a candidate list, resolved by choose_largest and merged in order.
template <class K, class Hist1, class KeyAt>
void topk_select(int64_t n, int64_t k, int key_bits, const Hist1& hist1, const KeyAt& key, std::vector<int64_t>& out) {
  const int shift = key_bits - kRadixBits;
  const int nc = threads_for(n);
  std::vector<int64_t> hist((size_t)nc * kBins, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) { hist1(c, lo, hi, hist.data() + (size_t)c * kBins, shift); });
  std::vector<int64_t> total(kBins, 0);
  for (int c = 0; c < nc; ++c)
    for (int b = 0; b < kBins; ++b) total[b] += hist[(size_t)c * kBins + b];
  int B = kBins - 1;
  int64_t above = 0;
  for (; B > 0; --B) {
    if (above + total[B] >= k) break;
    above += total[B];
  }
  // per-chunk offsets of the sure ones and of the candidates
  std::vector<int64_t> sure_off(nc + 1, 0), cand_off(nc + 1, 0);
  for (int c = 0; c < nc; ++c) {
    int64_t a = 0;
    for (int b = B + 1; b < kBins; ++b) a += hist[(size_t)c * kBins + b];
    sure_off[c + 1] = sure_off[c] + a;
    cand_off[c + 1] = cand_off[c] + hist[(size_t)c * kBins + B];
  }
  const int64_t n_cand = cand_off[nc];
  std::vector<int64_t> sure(above), cand(n_cand);
  std::vector<K> cand_key(n_cand);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t s = sure_off[c], q = cand_off[c];
    const K lim = (K)B;
    for (int64_t i = lo; i < hi; ++i) {
      K kk = key(i);
      K bin = kk >> shift;
      if (bin > lim) {
        sure[s++] = i;
      } else if (bin == lim) {
        cand[q] = i;
        cand_key[q++] = kk;
      }
    }
  });
  std::vector<int64_t> chosen;
  choose_largest(cand, cand_key, k - above, chosen);
  out.resize(k);
  std::merge(sure.begin(), sure.end(), chosen.begin(), chosen.end(), out.begin());
}

template <class T, bool by_abs>
int64_t topk_typed(const T* x, int64_t n, int64_t k, void* idx, int idx_type, T* values) {
  using KO = KeyOf<T>;
  using K = typename KO::K;
  if (k <= 0) return 0;
  std::vector<int64_t> sel;
  if (k >= n) {
    sel.resize(n);
    for (int64_t i = 0; i < n; ++i) sel[i] = i;
  } else {
    auto key = [&](int64_t i) { return KO::key(x[i], by_abs); };
    auto hist1 = [&](int, int64_t lo, int64_t hi, int64_t* h, int shift) {
      std::vector<uint32_t> sub(2 * kBins, 0);  // two copies: no chain of increments to one bin
      int64_t i = lo;
      for (; i + 2 <= hi; i += 2) {
        sub[key(i) >> shift]++;
        sub[kBins + (key(i + 1) >> shift)]++;
      }
      for (; i < hi; ++i) sub[key(i) >> shift]++;
      for (int b = 0; b < kBins; ++b) h[b] += (int64_t)sub[b] + sub[kBins + b];
    };
    topk_select<K>(n, k, KO::kBits, hist1, key, sel);
  }
  int64_t m = (int64_t)sel.size();
  for (int64_t j = 0; j < m; ++j) {
    write_index(idx, idx_type, j, sel[j]);
    if (values) values[j] = x[sel[j]];
  }
  return m;
}

template <class T>
int64_t topk_any(const T* x, int64_t n, int64_t k, bool by_abs, void* idx, int idx_type, T* values) {
  return by_abs ? topk_typed<T, true>(x, n, k, idx, idx_type, values) : topk_typed<T, false>(x, n, k, idx, idx_type, values);
}

// Write the kept elements of each chunk at the start of the chunk's own range of idx/values
// (room for n), then close the gaps: one pass over the input.
template <class Keep, class Visit>
int64_t compact_select(int64_t n, void* idx, int idx_type, void* values, size_t vsize, const Keep& keep,
                       const Visit& visit) {
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t q = lo;
    for (int64_t i = lo; i < hi; ++i) {
      if (keep(i)) {
        write_index(idx, idx_type, q, i);
        if (values) visit(q, i);
        ++q;
      } else if (!values) {
        visit(-1, i);
      }
    }
    count[c] = q - lo;
    lo_of[c] = lo;
  });
  const size_t isz = idx_size(idx_type);
  int64_t pos = 0;
  for (int c = 0; c < nc; ++c) {
    if (count[c] && pos != lo_of[c]) {
      std::memmove((char*)idx + pos * isz, (char*)idx + lo_of[c] * isz, count[c] * isz);
      if (values) std::memmove((char*)values + pos * vsize, (char*)values + lo_of[c] * vsize, count[c] * vsize);
    }
    pos += count[c];
  }
  return pos;
}

// float32: 8 elements at a time, only the ones with a kept element looked at one by one
int64_t threshold_f32(const float* x, int64_t n, float thr, bool by_abs, void* idx, int idx_type, float* values) {
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t q = lo, i = lo;
#ifdef GRACE_SIMD
    const F8 t = set8(thr);
    for (; i + 8 <= hi; i += 8) {
      F8 v = ld8(x + i);
      int m = mask8(ge8(by_abs ? abs8(v) : v, t));
      while (m) {
        int j = __builtin_ctz(m);
        m &= m - 1;
        write_index(idx, idx_type, q, i + j);
        if (values) values[q] = x[i + j];
        ++q;
      }
    }
#endif
    for (; i < hi; ++i) {
      if ((by_abs ? std::fabs(x[i]) : x[i]) >= thr) {
        write_index(idx, idx_type, q, i);
        if (values) values[q] = x[i];
        ++q;
      }
    }
    count[c] = q - lo;
    lo_of[c] = lo;
  });
  const size_t isz = idx_size(idx_type);
  int64_t pos = 0;
  for (int c = 0; c < nc; ++c) {
    if (count[c] && pos != lo_of[c]) {
      std::memmove((char*)idx + pos * isz, (char*)idx + lo_of[c] * isz, count[c] * isz);
      if (values) std::memmove(values + pos, values + lo_of[c], count[c] * sizeof(float));
    }
    pos += count[c];
  }
  return pos;
}

template <class T>
int64_t threshold_typed(const T* x, int64_t n, T thr, bool by_abs, void* idx, int idx_type, T* values) {
  auto keep = [&](int64_t i) { return (by_abs ? std::fabs(x[i]) : x[i]) >= thr; };
  auto visit = [&](int64_t q, int64_t i) {
    if (q >= 0) values[q] = x[i];
  };
  return compact_select(n, idx, idx_type, values, sizeof(T), keep, visit);
}

inline float compensate(float g, float r, float beta, float gamma, int flags) {
  float p = (flags & 1) ? g * gamma : g;
  return p + ((flags & 2) ? r * beta : r);
}

// p = compensate(g, r) of n elements into p (may be r), in parallel chunks; whether g holds an
// inf or a NaN told to `bad` where given
void compensate_into(const float* g, const float* r, int64_t n, float beta, float gamma, int flags, float* p,
                     std::atomic<bool>* bad = nullptr) {
  for_chunks(n, 64, threads_for(n), [&](int, int64_t lo, int64_t hi) {
    FiniteCheck check;
    int64_t i = lo;
#ifdef GRACE_SIMD
    const F8 vb = set8(beta), vg = set8(gamma);
    for (; i + 8 <= hi; i += 8) {
      const F8 a = ld8(g + i), b = ld8(r + i);
      check.add8(a);
      st8(p + i, ((flags & 1) ? a * vg : a) + ((flags & 2) ? b * vb : b));
    }
#endif
    for (; i < hi; ++i) {
      check.add(g[i]);
      p[i] = compensate(g[i], r[i], beta, gamma, flags);
    }
    report(check, bad);
  });
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

API int64_t grace_cpu_topk(const void* x, int val_type, int64_t n, int64_t k, int by_abs, void* idx, int idx_type,
                           void* values) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  if (val_type == GRACE_F32)
    return topk_any((const float*)x, n, k, by_abs != 0, idx, idx_type, (float*)values);
  if (val_type == GRACE_F64)
    return topk_any((const double*)x, n, k, by_abs != 0, idx, idx_type, (double*)values);
  return -1;
}

API int64_t grace_cpu_threshold(const void* x, int val_type, int64_t n, double thr, int by_abs, void* idx,
                                int idx_type, void* values) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  if (val_type == GRACE_F32)
    return threshold_f32((const float*)x, n, (float)thr, by_abs != 0, idx, idx_type, (float*)values);
  if (val_type == GRACE_F64)
    return threshold_typed((const double*)x, n, thr, by_abs != 0, idx, idx_type, (double*)values);
  return -1;
}

API int64_t grace_cpu_nonzero(const uint8_t* mask, int64_t n, void* idx, int idx_type) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t q = lo, i = lo;
    for (; i + 8 <= hi; i += 8) {
      uint64_t w = load_u64(mask + i);
      if (!w) continue;
      for (int j = 0; j < 8; ++j)
        if ((w >> (8 * j)) & 0xff) write_index(idx, idx_type, q++, i + j);
    }
    for (; i < hi; ++i)
      if (mask[i]) write_index(idx, idx_type, q++, i);
    count[c] = q - lo;
    lo_of[c] = lo;
  });
  const size_t isz = idx_size(idx_type);
  int64_t pos = 0;
  for (int c = 0; c < nc; ++c) {
    if (count[c] && pos != lo_of[c])
      std::memmove((char*)idx + pos * isz, (char*)idx + lo_of[c] * isz, count[c] * isz);
    pos += count[c];
  }
  return pos;
}

// p = g*gamma + r*beta into new_r (first pass, with the histogram of |p|), select from it,
// then values = p[idx] and new_r[idx] = p - (0 + p): exactly p - decompress(compress(p)).
namespace {
constexpr int64_t kLine = 16;         // floats per sampled cache line
constexpr int64_t kSampleEvery = 17;  // one line in this many
constexpr int64_t kSampledFrom = kLine * kSampleEvery * 64;

// Top-k of p = compensate(g, r) with p stored in new_r, in one pass over memory for most
// tensors: a sample of whole cache lines (1 in 16) gives a bound t that the k-th largest |p| is
// above with near certainty (k's share of the sample, plus four standard deviations, rounded
// down to a 1/64 octave); the pass computes and stores p and collects the elements with
// |p| >= t (and their p), of which the k largest are chosen. Where the sample misled (fewer
// than k collected, or far more than expected) the exact histogram path runs on the stored p.
// (new_r may be r itself: each element is read before it is written, and never read again
// once written.)
enum class Sampled { kNotTried, kStored, kChosen };

#if defined(GRACE_SIMD) && defined(__AVX2__)
// kLanes[m]: the lanes set in the 8-bit mask m, packed to the front, one byte each: a
// compress-store of 8 lanes without a branch (most masks are empty, at random).
struct Lanes {
  uint64_t v[256];
  constexpr Lanes() : v() {
    for (int m = 0; m < 256; ++m) {
      uint64_t packed = 0;
      int q = 0;
      for (int j = 0; j < 8; ++j)
        if (m >> j & 1) packed |= (uint64_t)j << (8 * q++);
      v[m] = packed;
    }
  }
};
constexpr Lanes kLanes;
#endif

// Elements [lo, hi) of the candidate pass: p stored, those with !(|p| < t) appended to
// at/val from position 0; stops early (returning false) once more than `limit` are found,
// with p still stored everywhere. GAMMA/BETA: whether g and r are scaled (x * 1 is exact,
// but the loop without the multiply is the common one).
template <bool GAMMA, bool BETA>
bool collect_candidates(const float* g, const float* r, float* p_out, int64_t lo, int64_t hi, float beta,
                        float gamma, float t, int64_t limit, std::vector<int64_t>& at, std::vector<float>& val) {
  constexpr int64_t kBlock = 1024;  // elements between checks of the count
  at.resize(limit + kBlock + 8);
  val.resize(limit + kBlock + 8);
  int64_t* const A = at.data();
  float* const V = val.data();
  int64_t q = 0, i = lo;
  auto scalar = [&](int64_t j) {
    float p = (GAMMA ? g[j] * gamma : g[j]) + (BETA ? r[j] * beta : r[j]);
    p_out[j] = p;
    A[q] = j;
    V[q] = p;
    q += !(std::fabs(p) < t);
  };
  while (i < hi && q <= limit) {
    const int64_t end = std::min(hi, i + kBlock);
#if defined(GRACE_SIMD) && defined(__AVX2__)
    const __m256 vt = _mm256_set1_ps(t), vb = _mm256_set1_ps(beta), vg = _mm256_set1_ps(gamma);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= end; i += 8) {
      prefetch(g + i);
      prefetch(r + i);
      __m256 a = _mm256_loadu_ps(g + i), b = _mm256_loadu_ps(r + i);
      if (GAMMA) a = _mm256_mul_ps(a, vg);
      if (BETA) b = _mm256_mul_ps(b, vb);
      const __m256 p = _mm256_add_ps(a, b);
      _mm256_storeu_ps(p_out + i, p);
      const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(p, sign), vt, _CMP_NLT_UQ));
      const __m128i lanes = _mm_cvtsi64_si128((long long)kLanes.v[bits]);
      const __m256i base = _mm256_set1_epi64x(i);
      _mm256_storeu_si256((__m256i*)(A + q), _mm256_add_epi64(base, _mm256_cvtepu8_epi64(lanes)));
      _mm256_storeu_si256((__m256i*)(A + q + 4),
                          _mm256_add_epi64(base, _mm256_cvtepu8_epi64(_mm_srli_si128(lanes, 4))));
      _mm256_storeu_ps(V + q, _mm256_permutevar8x32_ps(p, _mm256_cvtepu8_epi32(lanes)));
      q += __builtin_popcount(bits);
    }
#endif
    for (; i < end; ++i) scalar(i);
  }
  for (int64_t j = i; j < hi; ++j)  // (too many: the rest of p only)
    p_out[j] = (GAMMA ? g[j] * gamma : g[j]) + (BETA ? r[j] * beta : r[j]);
  at.resize(q);
  val.resize(q);
  return q <= limit;
}

Sampled topk_ef_sampled(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                        float* new_r, std::vector<int64_t>& sel) {
  if (n < kSampledFrom) return Sampled::kNotTried;
  // the sample's histogram of |p|'s top bits: 8 of the exponent, 6 of the mantissa
  constexpr int kFineBits = 14, kFineShift = 31 - kFineBits;
  std::vector<uint32_t> hist(1 << kFineBits, 0);
  // Every kSampleEvery-th line: a prime stride, so that the sample sees every column of a
  // matrix (a stride that divides the rows would see the same few columns of every row).
  const int64_t lines = (n - kLine) / (kLine * kSampleEvery) + 1;
  constexpr int64_t kAhead = 8 * kLine * kSampleEvery;  // (the hardware may not see the stride)
  for (int64_t line = 0; line + kLine <= n; line += kLine * kSampleEvery) {
    if (line + kAhead < n) {
      __builtin_prefetch(g + line + kAhead);
      __builtin_prefetch(r + line + kAhead);
    }
    for (int64_t i = line; i < line + kLine; ++i)
      hist[KeyOf<float>::key(compensate(g[i], r[i], beta, gamma, flags), true) >> kFineShift]++;
  }
  const int64_t m = lines * kLine;
  const double expected = (double)k * m / n;
  const int64_t rank = std::min<int64_t>(m, (int64_t)std::ceil(expected + 4.0 * std::sqrt(expected) + 16.0));
  int B = (1 << kFineBits) - 1;
  for (int64_t above = 0; B > 0 && (above += hist[B]) < rank;) --B;
  const uint32_t bound = (uint32_t)B << kFineShift;  // the lower edge of the bin the rank falls in
  if (bound == 0) return Sampled::kNotTried;  // (zeros would all be candidates)
  float t;
  std::memcpy(&t, &bound, 4);
  const int64_t cap = std::min<int64_t>(n, 4 * (int64_t)((double)rank * n / m) + 1024);
  const int nc = threads_for(n);
  std::vector<std::vector<int64_t>> at(nc);
  std::vector<std::vector<float>> val(nc);
  std::atomic<bool> over{false};
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    const int64_t limit = cap / nc + 64;
    bool ok;
    switch (flags & 3) {
      case 0: ok = collect_candidates<false, false>(g, r, new_r, lo, hi, beta, gamma, t, limit, at[c], val[c]); break;
      case 1: ok = collect_candidates<true, false>(g, r, new_r, lo, hi, beta, gamma, t, limit, at[c], val[c]); break;
      case 2: ok = collect_candidates<false, true>(g, r, new_r, lo, hi, beta, gamma, t, limit, at[c], val[c]); break;
      default: ok = collect_candidates<true, true>(g, r, new_r, lo, hi, beta, gamma, t, limit, at[c], val[c]);
    }
    if (!ok) over = true;
  });
  if (over) return Sampled::kStored;
  std::vector<int64_t> cand;
  std::vector<uint32_t> cand_key;
  for (int c = 0; c < nc; ++c) {
    cand.insert(cand.end(), at[c].begin(), at[c].end());
    for (float v : val[c]) cand_key.push_back(KeyOf<float>::key(v, true));
  }
  if ((int64_t)cand.size() < k) return Sampled::kStored;
  choose_largest(cand, cand_key, k, sel);
  return Sampled::kChosen;
}
}  // namespace

API int64_t grace_cpu_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma,
                              int flags, float* values, void* idx, int idx_type, float* new_r) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  std::vector<int64_t> sel;
  auto key = [&](int64_t i) { return KeyOf<float>::key(new_r[i], true); };
  const Sampled sampled = k > 0 && k < n ? topk_ef_sampled(g, r, n, k, beta, gamma, flags, new_r, sel)
                                          : Sampled::kNotTried;
  if (sampled == Sampled::kChosen) {
    // chosen in one pass
  } else if (sampled == Sampled::kStored) {  // p is in new_r: the exact path on it
    auto hist1 = [&](int, int64_t lo, int64_t hi, int64_t* h, int shift) {
      for (int64_t i = lo; i < hi; ++i) h[key(i) >> shift]++;
    };
    topk_select<uint32_t>(n, k, 32, hist1, key, sel);
  } else if (k >= n || k <= 0) {
    compensate_into(g, r, n, beta, gamma, flags, new_r);
    if (k > 0) {
      sel.resize(n);
      for (int64_t i = 0; i < n; ++i) sel[i] = i;
    }
  } else {
    auto hist1 = [&](int, int64_t lo, int64_t hi, int64_t* h, int shift) {
      for (int64_t i = lo; i < hi; ++i) {
        float p = compensate(g[i], r[i], beta, gamma, flags);
        new_r[i] = p;
        uint32_t u;
        std::memcpy(&u, &p, 4);
        h[(u & 0x7fffffffu) >> shift]++;
      }
    };
    topk_select<uint32_t>(n, k, 32, hist1, key, sel);
  }
  int64_t m = (int64_t)sel.size();
  for (int64_t j = 0; j < m; ++j) {
    int64_t i = sel[j];
    float p = new_r[i];
    write_index(idx, idx_type, j, i);
    values[j] = p;
    new_r[i] = p - (0.0f + p);
  }
  return m;
}

namespace {
// grace_cpu_threshold_ef, telling `bad` (where given) whether g holds an inf or a NaN; new_r
// streamed where `stream` (16-byte aligned): the sent elements' p - (0 + p) made before the store
int64_t threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma, int flags,
                     float* values, void* idx, int idx_type, float* new_r, std::atomic<bool>* bad, bool stream) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t q = lo, i = lo;
    FiniteCheck check;
#ifdef GRACE_SIMD
    const F8 t = set8(thr), vb = set8(beta), vg = set8(gamma), zero = set8(0.0f);
    for (; i + 8 <= hi; i += 8) {
      prefetch(g + i);
      prefetch(r + i);
      F8 a = ld8(g + i), b = ld8(r + i);
      check.add8(a);
      F8 p = ((flags & 1) ? a * vg : a) + ((flags & 2) ? b * vb : b);
      const F8 sent = ge8(abs8(p), t);
      if (int m = mask8(sent)) {
        alignas(32) float pv[8];
        st8(pv, p);
        for (; m; m &= m - 1) {
          const int j = __builtin_ctz(m);
          write_index(idx, idx_type, q, i + j);
          values[q++] = pv[j];
        }
        p = sel8(sent, p - (zero + p), p);
      }
      put8(new_r + i, p, stream);
    }
    fence_streams(stream);
#endif
    for (; i < hi; ++i) {
      check.add(g[i]);
      float p = compensate(g[i], r[i], beta, gamma, flags);
      if (std::fabs(p) >= thr) {
        write_index(idx, idx_type, q, i);
        values[q++] = p;
        new_r[i] = p - (0.0f + p);
      } else {
        new_r[i] = p;
      }
    }
    report(check, bad);
    count[c] = q - lo;
    lo_of[c] = lo;
  });
  const size_t isz = idx_size(idx_type);
  int64_t pos = 0;
  for (int c = 0; c < nc; ++c) {
    if (count[c] && pos != lo_of[c]) {
      std::memmove((char*)idx + pos * isz, (char*)idx + lo_of[c] * isz, count[c] * isz);
      std::memmove(values + pos, values + lo_of[c], count[c] * sizeof(float));
    }
    pos += count[c];
  }
  return pos;
}
}  // namespace

API int64_t grace_cpu_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                                   int flags, float* values, void* idx, int idx_type, float* new_r) {
  return threshold_ef(g, r, n, thr, beta, gamma, flags, values, idx, idx_type, new_r, nullptr, streams(new_r, 4 * n));
}

// ---- scatter-add -----------------------------------------------------------------------------
namespace {
inline int64_t read_index(const void* idx, int t, int64_t j) {
  switch (t) {
    case GRACE_U8: return ((const uint8_t*)idx)[j];
    case GRACE_I16: return ((const int16_t*)idx)[j];
    case GRACE_I32: return ((const int32_t*)idx)[j];
    default: return ((const int64_t*)idx)[j];
  }
}

// Whether every index of the payloads is in [0, numel) (checked before anything is written, so
// that a bad index leaves no partial sums behind).
bool scatter_in_bounds(int count, const void* const* idx, const int* types, const int64_t* lengths, int64_t numel) {
  for (int p = 0; p < count; ++p)
    if (!idx_type_ok(types[p]) || lengths[p] < 0) return false;
  std::atomic<int> bad{0};
  for (int p = 0; p < count; ++p) {
    const int64_t len = lengths[p];
    const void* ip = idx[p];
    const int t = types[p];
#pragma omp parallel for num_threads(threads_for(len)) if (len > 2 * kGrain)
    for (int64_t j = 0; j < len; ++j) {
      int64_t i = read_index(ip, t, j);
      if (i < 0 || i >= numel) bad.store(1, std::memory_order_relaxed);
    }
  }
  return !bad.load();
}

// dense = zeros, then each payload's values (each divided by `divisor` where it is not 1) added
// at its indices, payload after payload. The indices are in bounds.
template <class T>
void scatter_add_apply(int count, const void* const* idx, const int* types, const void* const* values,
                       const int64_t* lengths, int64_t numel, T divisor, T* dense) {
  int64_t m = 0;
  for (int p = 0; p < count; ++p) m += lengths[p];
  const bool divide = divisor != T(1);
  auto value = [&](const T* v, int64_t j) { return divide ? v[j] / divisor : v[j]; };
  const int nc = threads_for(numel + m);
  if (nc > 1 && m >= kGrain) {
    // each thread owns a range of the output and applies, in order, the updates that fall in it
    for_chunks(numel, 16, nc, [&](int, int64_t lo, int64_t hi) {
      std::fill(dense + lo, dense + hi, T(0));
      for (int p = 0; p < count; ++p) {
        const T* v = (const T*)values[p];
        for (int64_t j = 0; j < lengths[p]; ++j) {
          int64_t i = read_index(idx[p], types[p], j);
          if (i >= lo && i < hi) dense[i] += value(v, j);
        }
      }
    });
  } else {
    for_chunks(numel, 16, threads_for(numel), [&](int, int64_t lo, int64_t hi) { std::fill(dense + lo, dense + hi, T(0)); });
    for (int p = 0; p < count; ++p) {
      const T* v = (const T*)values[p];
      const int t = types[p];
      for (int64_t j = 0; j < lengths[p]; ++j) dense[read_index(idx[p], t, j)] += value(v, j);
    }
  }
}

template <class T>
int scatter_add_typed(int count, const void* const* idx, const int* types, const void* const* values,
                      const int64_t* lengths, int64_t numel, T* dense) {
  if (!scatter_in_bounds(count, idx, types, lengths, numel)) return -1;
  scatter_add_apply(count, idx, types, values, lengths, numel, T(1), dense);
  return 0;
}
}  // namespace

API int grace_cpu_scatter_add(int count, const void* const* idx, const int* idx_types, const void* const* values,
                              const int64_t* lengths, int val_type, int64_t numel, void* dense) {
  if (count < 0 || numel < 0) return -1;
  if (val_type == GRACE_F32) return scatter_add_typed(count, idx, idx_types, values, lengths, numel, (float*)dense);
  if (val_type == GRACE_F64) return scatter_add_typed(count, idx, idx_types, values, lengths, numel, (double*)dense);
  return -1;
}

// ---- a bucket of gradients in one call: segment s at its own pointers --------------------------
// The per-tensor kernels on every segment, for the CPU's bucketed exchange: one call per bucket
// instead of several per gradient (the gradients stay where they are; no flat copy).

// grace_cpu_topk_ef on each segment s: g[s], r[s], new_r[s] of n[s] elements, k[s] selected
// into values[s] and idx[s] (type idx_types[s]). 0, or -1 on bad arguments.
API int grace_cpu_topk_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                               const int64_t* n, const int64_t* k, float beta, float gamma, int flags,
                               float* const* values, void* const* idx, const int* idx_types, float* nonfinite) {
  NonfiniteFlag flag(nonfinite);
  for (int64_t s = 0; s < count; ++s) {
    const int64_t ks = std::max<int64_t>(0, std::min(k[s], n[s]));
    if (grace_cpu_topk_ef(g[s], r[s], n[s], ks, beta, gamma, flags, values[s], idx[s], idx_types[s], new_r[s]) != ks)
      return -1;
    flag.check(values[s], ks);  // (an inf or a NaN of p ranks above every number: it is sent)
  }
  return 0;
}

namespace {
// The Terms of p = compensate(g, r) (see Blocks), which store p into `p` on the way for the
// compression's own terms (`inner`, reading p there): compensation and compression in one pass.
template <class Inner>
struct CompensatedTerms {
  const float *g, *r;
  float* p;
  float beta, gamma;
  int flags;
  Inner inner;
  void operator()(int64_t i, float* t) const {
    p[i] = compensate(g[i], r[i], beta, gamma, flags);
    inner(i, t);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    prefetch(g + i);
    prefetch(r + i);
    const F8 a = ld8(g + i), b = ld8(r + i);
    st8(p + i, ((flags & 1) ? a * set8(gamma) : a) + ((flags & 2) ? b * set8(beta) : b));
    inner.group(i, t);
  }
#endif
};
}  // namespace

// The residual step of EF-signSGD (mode 1) or 1-bit SGD (mode 2) for every segment s: p =
// compensate(g, r) into new_r[s] (may be r[s]) with its bits and scalars (grace_cpu_efsign_compress
// or grace_cpu_onebit_compress of p) into packed[s] and scalars[s] in the same pass, then
// new_r[s] = p - decode(bits), each gradient in turn (it stays in the cache between the passes);
// -1 for another mode
API int grace_cpu_bits_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                               const int64_t* n, float beta, float gamma, int flags, int mode, uint8_t* const* packed,
                               float* const* scalars, float* nonfinite) {
  if (mode != 1 && mode != 2) return -1;
  NonfiniteFlag flag(nonfinite);
  for (int64_t s = 0; s < count; ++s) {
    float* const ps = new_r[s];
    const int nt = threads_for(n[s]);
    if (mode == 1) {
      const Sums<1> sums = pairwise_sums<1>(
          CompensatedTerms<EfsignTerms>{g[s], r[s], ps, beta, gamma, flags, {ps, packed[s]}}, n[s], nt);
      efsign_scale(sums, n[s], scalars[s]);
    } else {
      const Sums<3> sums = pairwise_sums<3>(
          CompensatedTerms<OnebitTerms>{g[s], r[s], ps, beta, gamma, flags, {ps, packed[s]}}, n[s], nt);
      onebit_means(sums, n[s], scalars[s]);
    }
    grace_cpu_bits_residual(ps, packed[s], n[s], scalars[s], mode, ps);
    flag.check(scalars[s], mode == 1 ? 1 : 2);  // (not finite where p is not)
  }
  return 0;
}

// grace_cpu_threshold_ef on each segment s, the counts into counts[s] (values[s] and idx[s] hold
// room for n[s]); -1 where one fails
API int grace_cpu_threshold_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                                    const int64_t* n, float thr, float beta, float gamma, int flags,
                                    float* const* values, void* const* idx, const int* idx_types, int64_t* counts,
                                    float* nonfinite) {
  NonfiniteFlag flag(nonfinite);
  const int64_t bytes = bucket_bytes(count, n);
  for (int64_t s = 0; s < count; ++s) {
    counts[s] = threshold_ef(g[s], r[s], n[s], thr, beta, gamma, flags, values[s], idx[s], idx_types[s], new_r[s],
                             flag.wanted(), streams(new_r[s], bytes));
    if (counts[s] < 0) return -1;
  }
  return 0;
}

// For each segment s: dense[s] (numels[s] elements) = zeros, then each rank's payload of it
// (values and indices [s * ranks + r], lengths[s * ranks + r]) divided by `divisor` and added,
// rank after rank: every gradient's sparse aggregate. 0, or -1 (nothing written) on an index
// out of range.
API int grace_cpu_scatter_add_segments(int64_t segments, int ranks, const void* const* idx, const int* idx_types,
                                       const void* const* values, const int64_t* lengths, float divisor,
                                       const int64_t* numels, float* const* dense) {
  if (segments < 0 || ranks < 0) return -1;
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 0 || !scatter_in_bounds(ranks, idx + s * ranks, idx_types + s * ranks, lengths + s * ranks, numels[s]))
      return -1;
  for (int64_t s = 0; s < segments; ++s)
    scatter_add_apply(ranks, idx + s * ranks, idx_types + s * ranks, values + s * ranks, lengths + s * ranks,
                      numels[s], divisor, dense[s]);
  return 0;
}


// Segment s: the first ks[s] distinct of the index draws floor(hash_j * n / 2^32), j = 0, 1, ...,
// ascending, into out (the segments one after another): a bitmap of the n indices marks those
// drawn, and a scan of it writes them in order. Returns -1 where k > n or n > 2^32.
API int grace_cpu_random_indices_segments(int64_t segments, const int64_t* numels, const int64_t* ks,
                                          const uint32_t* s0, const uint32_t* s1, int64_t* out) {
  for (int64_t s = 0; s < segments; ++s)
    if (ks[s] < 0 || ks[s] > numels[s] || numels[s] > ((int64_t)1 << 32)) return -1;
  std::vector<uint64_t> taken;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t n = numels[s], k = ks[s];
    if (k == n) {
      for (int64_t i = 0; i < n; ++i) out[i] = i;
    } else if (k > 0) {
      taken.assign((n + 63) / 64, 0);
      for (int64_t j = 0, got = 0; got < k; ++j) {
        const uint64_t i = ((uint64_t)hash32(hash32((uint64_t)j ^ s0[s]) ^ s1[s]) * (uint64_t)n) >> 32;
        const uint64_t bit = (uint64_t)1 << (i & 63);
        got += !(taken[i >> 6] & bit);
        taken[i >> 6] |= bit;
      }
      int64_t q = 0;
      for (int64_t w = 0; w < (int64_t)taken.size(); ++w)
        for (uint64_t word = taken[w]; word; word &= word - 1) out[q++] = 64 * w + __builtin_ctzll(word);
    }
    out += k;
  }
  return 0;
}

// Random-k's residual step for every gradient s of a bucket: p = compensate(g, r) written into
// new_r[s] (may be r[s]); the values at its k[s] distinct indices idx[s] (drawn by the caller), p
// (times scale[s] where scale is given), into values[s]; and new_r there p - (0 + value). -1 (and
// nothing written) where an index is out of range.
namespace {
// Random-k's residual step of one gradient whose k indices ascend: p = compensate(g, r) into p_out
// (streamed where `stream`, 16-byte aligned), the values at the indices (times *scale where
// given) and p - (0 + value) there, made before the store; whether g holds an inf or a NaN told
// to `bad` where given.
void randomk_ef(const float* g, const float* r, int64_t n, const int64_t* idx, int64_t k, float beta, float gamma,
                int flags, const float* scale, float* values, float* p_out, std::atomic<bool>* bad, bool stream) {
  auto sent = [&](float p, int64_t j) {  // the value sent for p, at the j-th index; its new memory
    const float v = scale ? p * scale[0] : p;
    values[j] = v;
    return p - (0.0f + v);
  };
  for_chunks(n, 64, threads_for(n), [&](int, int64_t lo, int64_t hi) {
    FiniteCheck check;
    int64_t j = std::lower_bound(idx, idx + k, lo) - idx, i = lo;  // the chunk's first index
#ifdef GRACE_SIMD
    const F8 vb = set8(beta), vg = set8(gamma);
    for (; i + 8 <= hi; i += 8) {
      prefetch(g + i);
      prefetch(r + i);
      const F8 a = ld8(g + i), b = ld8(r + i);
      check.add8(a);
      F8 p = ((flags & 1) ? a * vg : a) + ((flags & 2) ? b * vb : b);
      if (j < k && idx[j] < i + 8) {  // (blended in: a vector load of scalar stores would stall)
        alignas(32) float pv[8];
        st8(pv, p);
        for (; j < k && idx[j] < i + 8; ++j) p = sel8(lane8(idx[j] - i), set8(sent(pv[idx[j] - i], j)), p);
      }
      put8(p_out + i, p, stream);
    }
    fence_streams(stream);
#endif
    for (; i < hi; ++i) {
      check.add(g[i]);
      const float p = compensate(g[i], r[i], beta, gamma, flags);
      p_out[i] = j < k && idx[j] == i ? sent(p, j++) : p;
    }
    report(check, bad);
  });
}
}  // namespace

API int grace_cpu_randomk_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                                  const int64_t* n, const int64_t* k, const int64_t* const* idx, float beta,
                                  float gamma, int flags, const float* scale, float* const* values,
                                  float* nonfinite) {
  std::vector<char> ascend(count, 1);
  for (int64_t s = 0; s < count; ++s)
    for (int64_t j = 0; j < k[s]; ++j) {
      if (idx[s][j] < 0 || idx[s][j] >= n[s]) return -1;
      if (j && idx[s][j] <= idx[s][j - 1]) ascend[s] = 0;
    }
  NonfiniteFlag flag(nonfinite);
  const int64_t bytes = bucket_bytes(count, n);
  for (int64_t s = 0; s < count; ++s) {
    float* const ps = new_r[s];
    if (ascend[s]) {  // (as the draws make them)
      randomk_ef(g[s], r[s], n[s], idx[s], k[s], beta, gamma, flags, scale ? scale + s : nullptr, values[s], ps,
                 flag.wanted(), streams(ps, bytes));
      continue;
    }
    compensate_into(g[s], r[s], n[s], beta, gamma, flags, ps, flag.wanted());
    for (int64_t j = 0; j < k[s]; ++j) {
      const int64_t i = idx[s][j];
      const float p = ps[i], v = scale ? p * scale[s] : p;
      values[s][j] = v;
      ps[i] = p - (0.0f + v);
    }
  }
  return 0;
}

API void grace_cpu_uniform_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                    float* out) {
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t n = numels[s];
    for_chunks(n, 64, threads_for(n),
               [&](int, int64_t lo, int64_t hi) { uniform_range(lo, hi, s0[s], s1[s], out + lo); });
    out += n;
  }
}

// ---- DGC's momentum correction -----------------------------------------------------------------
namespace {
// DGC's momentum correction of elements [lo, hi): p = v + (m u + g) into v_out and p - v into
// u_out (each rounding as the tensor ops make it: a product, then two sums; outputs may be their
// inputs), g being g * scale where kScaled (clipping: one product first, as the tensor op);
// where kSelect, the indices of those with |p| >= thr written from sel[q] on: the new q; g's
// elements (before the scale) into `check`.
// Selecting, the outputs are streamed where aligned (AVX2): later only the few elements sent are
// read again, and streaming saves reading each output line before it is written (1.5 of 11 ms
// for 48 steps of 1 MB).
template <bool kSelect, bool kScaled>
int64_t dgc_range(const float* u, const float* v, const float* g, float m, float scale, float* u_out, float* v_out,
                  int64_t lo, int64_t hi, FiniteCheck& check, float thr = 0.0f, int64_t* sel = nullptr,
                  int64_t q = 0) {
  int64_t i = lo;
#if defined(GRACE_SIMD) && defined(__AVX2__)
  const bool nt = kSelect && (uintptr_t)(u_out + lo) % 32 == 0 && (uintptr_t)(v_out + lo) % 32 == 0;
#endif
#ifdef GRACE_SIMD
  const F8 vm = set8(m), t = set8(thr), vs = set8(scale);
  for (; i + 8 <= hi; i += 8) {
    prefetch(u + i);
    prefetch(v + i);
    prefetch(g + i);
    const F8 vv = ld8(v + i), raw = ld8(g + i), p = vv + (vm * ld8(u + i) + (kScaled ? raw * vs : raw));
    check.add8(raw);
#if defined(__AVX2__)
    if (nt) {
      _mm256_stream_ps(u_out + i, (p - vv).a);
      _mm256_stream_ps(v_out + i, p.a);
    } else
#endif
    {
      st8(u_out + i, p - vv);
      st8(v_out + i, p);
    }
    if (kSelect)
      for (int k = mask8(ge8(abs8(p), t)); k; k &= k - 1) sel[q++] = i + __builtin_ctz(k);
  }
#endif
  for (; i < hi; ++i) {
    const float vv = v[i], p = vv + (m * u[i] + (kScaled ? g[i] * scale : g[i]));
    check.add(g[i]);
    u_out[i] = p - vv;
    v_out[i] = p;
    if (kSelect && std::fabs(p) >= thr) sel[q++] = i;
  }
  return q;
}

// The momentum correction of n elements and, in the same pass, the indices (ascending) of those
// with |p| >= thr into sel (room for n; each chunk's at the start of its own range, then moved
// together): their count. Whether g holds an inf or a NaN told to `bad` where given.
int64_t dgc_compensate_select(const float* u, const float* v, const float* g, int64_t n, float m, float scale,
                              float thr, float* u_out, float* v_out, int64_t* sel, std::atomic<bool>* bad) {
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    FiniteCheck check;
    count[c] = (scale != 1.0f ? dgc_range<true, true>(u, v, g, m, scale, u_out, v_out, lo, hi, check, thr, sel, lo)
                              : dgc_range<true, false>(u, v, g, m, scale, u_out, v_out, lo, hi, check, thr, sel, lo)) -
               lo;
    lo_of[c] = lo;
    report(check, bad);
  });
  fence_streams(true);
  int64_t pos = 0;
  for (int c = 0; c < nc; ++c) {
    if (count[c] && pos != lo_of[c]) std::memmove(sel + pos, sel + lo_of[c], count[c] * sizeof(int64_t));
    pos += count[c];
  }
  return pos;
}

// the momentum correction alone (grace_cpu_dgc_compensate), telling `bad` as above
void dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float scale, float* u_out,
                    float* v_out, std::atomic<bool>* bad) {
  for_chunks(n, 64, threads_for(n), [&](int, int64_t lo, int64_t hi) {
    FiniteCheck check;
    if (scale != 1.0f)
      dgc_range<false, true>(u, v, g, m, scale, u_out, v_out, lo, hi, check);
    else
      dgc_range<false, false>(u, v, g, m, scale, u_out, v_out, lo, hi, check);
    report(check, bad);
  });
}
}  // namespace

// p = v + (m u + g) into v_out and p - v into u_out, in one pass (outputs may be their inputs)
API void grace_cpu_dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float* u_out,
                                  float* v_out) {
  dgc_compensate(u, v, g, n, m, 1.0f, u_out, v_out, nullptr);
}

// DGC's whole step for every gradient s of a bucket, as DGCMemory.fused_step and DGC.select make
// it tensor by tensor: the momentum correction (grace_cpu_dgc_compensate: p into v_out[s], p - v
// into u_out[s]); the threshold, the need-th largest |p| of S elements drawn at floor(u_j * d)
// (u_j: the uniform draws of the seed words (s0[s], s1[s]); every element where S = d); the
// elements with |p| >= threshold, ascending, cut to the k largest |p| of them (ties to the lowest
// index) where there are more; their p into values[s] and indices into idx[s] (room for k), how
// many into counts[s]; and momentum factor masking there: u = u * 0 where p + 0 != 0, v = p - (p + 0).
// Where scales is not NULL, g[s] is taken as g[s] * scales[s] (DGC's clipping, the factor
// computed by the caller).
// k = max(1, ceil(ratio d)), S = min(d, max(1, ceil(sample_ratio d))), need = max(1, ceil(ratio S)),
// all at most d. Returns -1 (nothing written) on bad arguments.
API int grace_cpu_dgc_step_many(int64_t count, const float* const* g, const float* const* u, const float* const* v,
                                float* const* u_out, float* const* v_out, const int64_t* n, float m, double ratio,
                                double sample_ratio, const uint32_t* s0, const uint32_t* s1, float* const* values,
                                void* const* idx, const int* idx_types, int64_t* counts, const float* scales,
                                float* nonfinite) {
  if (count < 0 || !(ratio > 0 && ratio <= 1) || !(sample_ratio > 0 && sample_ratio <= 1)) return -1;
  int64_t most = 0;
  for (int64_t s = 0; s < count; ++s) {
    if (n[s] < 0 || !idx_type_ok(idx_types[s])) return -1;
    most = std::max(most, n[s]);
  }
  auto at_most = [](double x, int64_t d) { return std::min(d, std::max<int64_t>(1, (int64_t)std::ceil(x))); };
  std::unique_ptr<int64_t[]> sel(new int64_t[std::max<int64_t>(most, 1)]);  // (only the pages written are touched)
  std::vector<float> drawn, cand;
  std::vector<uint32_t> keys;
  std::vector<int64_t> pick;
  NonfiniteFlag flag(nonfinite);
  for (int64_t s = 0; s < count; ++s) {
    const int64_t d = n[s];
    counts[s] = 0;
    float* const p = v_out[s];
    float* const un = u_out[s];
    const int64_t k = at_most(ratio * (double)d, d), S = at_most(sample_ratio * (double)d, d);
    const float scale = scales ? scales[s] : 1.0f;
    if (d == 0) continue;
    // the threshold: the need-th largest of the sample's |p| as bits (NaN above inf, as sorts put it)
    const int64_t need = at_most(ratio * (double)S, S);
    auto threshold = [&]() {
      const uint32_t t = kth_largest(keys, need);
      float thr;
      std::memcpy(&thr, &t, 4);
      return thr;
    };
    keys.resize(S);
    int64_t c;
    if (S == d) {  // every element: compensate, then select
      dgc_compensate(u[s], v[s], g[s], d, m, scale, un, p, flag.wanted());
      for (int64_t j = 0; j < d; ++j) keys[j] = KeyOf<float>::key(p[j], true);
      c = threshold_f32(p, d, threshold(), true, sel.get(), GRACE_I64, nullptr);
    } else {  // the sample's p first (the same sums as the pass makes), then compensate and select in one pass
      drawn.resize(S);
      uniform_range(0, S, s0[s], s1[s], drawn.data());
      const float df = (float)d;  // (floor(u d) < d: u <= 1 - 2^-24, and the product never rounds up to d)
      for (int64_t j = 0; j < S; ++j) {
        const int64_t i = (int64_t)std::floor(drawn[j] * df);
        keys[j] = KeyOf<float>::key(v[s][i] + (m * u[s][i] + (scale != 1.0f ? g[s][i] * scale : g[s][i])), true);
      }
      c = dgc_compensate_select(u[s], v[s], g[s], d, m, scale, threshold(), un, p, sel.get(), flag.wanted());
    }
    const int64_t* chosen = sel.get();
    if (c > k) {  // the sample underestimated the threshold: the k largest of those selected
      cand.resize(c);
      for (int64_t j = 0; j < c; ++j) cand[j] = std::fabs(p[sel[j]]);
      pick.resize(k);
      topk_typed<float, false>(cand.data(), c, k, pick.data(), GRACE_I64, nullptr);
      for (int64_t j = 0; j < k; ++j) pick[j] = sel[pick[j]];
      chosen = pick.data();
      c = k;
    }
    for (int64_t j = 0; j < c; ++j) {
      const int64_t i = chosen[j];
      const float value = p[i], sent = value + 0.0f;  // the decompressed payload there
      values[s][j] = value;
      write_index(idx[s], idx_types[s], j, i);
      un[i] = sent != 0.0f ? un[i] * 0.0f : un[i];
      p[i] = value - sent;
    }
    counts[s] = c;
  }
  return 0;
}

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

template <bool kReciprocal>
void half_encode(const float* x, int64_t n, float divisor, uint16_t* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m256 d = _mm256_set1_ps(kReciprocal ? 1.0f / divisor : divisor);
  for (; i + 8 <= n; i += 8) {
    prefetch(x + i);
    const __m256 xi = _mm256_loadu_ps(x + i), v = kReciprocal ? _mm256_mul_ps(xi, d) : _mm256_div_ps(xi, d);
    _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i) out[i] = to_half(x[i] / divisor);
}

template <bool kReciprocal>
void half_decode(const uint16_t* h, int64_t n, float factor, float divisor, float* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m256 f = _mm256_set1_ps(factor), d = _mm256_set1_ps(kReciprocal ? 1.0f / divisor : divisor);
  for (; i + 8 <= n; i += 8) {
    prefetch(h + i);
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))), f);
    _mm256_storeu_ps(out + i, kReciprocal ? _mm256_mul_ps(v, d) : _mm256_div_ps(v, d));
  }
#endif
  for (; i < n; ++i) out[i] = from_half(h[i]) * factor / divisor;
}
}  // namespace

API void grace_cpu_half_encode_many(int64_t count, const float* const* xs, const int64_t* numels, float divisor,
                                    uint16_t* const* outs) {
  const bool reciprocal = exact_reciprocal(divisor);
  for (int64_t s = 0; s < count; ++s)
    for_chunks(numels[s], 64, threads_for(numels[s]), [&](int, int64_t lo, int64_t hi) {
      (reciprocal ? half_encode<true> : half_encode<false>)(xs[s] + lo, hi - lo, divisor, outs[s] + lo);
    });
}

API void grace_cpu_half_decode_many(int64_t count, const uint16_t* const* halves, const int64_t* numels, float factor,
                                    float divisor, float* const* outs) {
  const bool reciprocal = exact_reciprocal(divisor);
  for (int64_t s = 0; s < count; ++s)
    for_chunks(numels[s], 64, threads_for(numels[s]), [&](int, int64_t lo, int64_t hi) {
      (reciprocal ? half_decode<true> : half_decode<false>)(halves[s] + lo, hi - lo, factor, divisor, outs[s] + lo);
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
  for (int64_t s = 0; s < count; ++s) {
    uint8_t* const a = (uint8_t*)out0[s];
    float* const scalars = out1 ? (float*)out1[s] : nullptr;
    switch (method) {
      case 0: sign_pack(x[s], n[s], 0, a, flag.wanted()); break;
      case 1:
        grace_cpu_terngrad_compress_drawn(x[s], n[s], s0[s], s1[s], scalars, a);
        scalars_tell(scalars, 1);
        break;
      case 2: {
        const int64_t b = qsgd_row(n[s], bucket);
        if (grace_cpu_qsgd_compress_drawn(x[s], n[s], s0[s], s1[s], levels, b, bits, scalars, a) != 0) return -1;
        scalars_tell(scalars, (n[s] + b - 1) / b);
        break;
      }
      default: natural_compress_drawn(x[s], n[s], s0[s], s1[s], a, (uint8_t*)scalars, flag.wanted());
    }
  }
  return 0;
}

// ---- PowerSGD's products with a thin rank-r factor -------------------------------------------
// M is rows x cols, Q cols x r, P rows x r (all row-major). Each element of a product is summed in
// one fixed order, whatever the build and the threads: M Q's (i, k) as row_products says, M^T P's
// (j, k) over i ascending from 0, P Q^T's (i, j) over k ascending from the first term; products
// with subnormals flushed (FlushDenormals).
namespace {
// Q's columns as rows (r x cols): Q itself where r = 1
class Columns {
 public:
  Columns(const float* q, int64_t cols, int64_t r) : rows_(q) {
    if (r == 1) return;
    buf_.resize((size_t)(cols * r));
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = 0; k < r; ++k) buf_[k * cols + j] = q[j * r + k];
    rows_ = buf_.data();
  }
  const float* row(int64_t k, int64_t cols) const { return rows_ + k * cols; }

 private:
  const float* rows_;
  std::vector<float> buf_;
};

constexpr int kDots = 2;  // products of a row computed in one sweep over it

// Subnormal floats read as zero and subnormal results written as zero while it lives (this
// thread): the products of tiny gradients (a deep net's vanishing ones, 1e-20 and below, times
// Q) fall below 1e-38 and take a microcode assist each otherwise, several times the pass's
// memory time. The sums and differences the memory keeps (M = g + e, e = M - P Q^T) run
// without it, exact.
class FlushDenormals {
 public:
#if defined(__SSE2__)
  FlushDenormals() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
#endif
};

// p[k] = x . qt.row(k) for k < r, x a row of cols floats: 32 lanes (lane l: the terms j = l mod 32
// below the last multiple of 32, in order; four chains of additions, not one), lanes l, l + 8,
// l + 16 and l + 24 added as (a + b) + (c + d), those 8 combined as combine8, then the other terms
void row_products(const float* x, int64_t cols, const Columns& qt, int64_t r, float* p) {
  const int64_t c32 = cols - cols % 32;
  for (int64_t k0 = 0; k0 < r; k0 += kDots) {
    const int kn = (int)std::min<int64_t>(kDots, r - k0);
    const float* q[kDots];
    for (int d = 0; d < kn; ++d) q[d] = qt.row(k0 + d, cols);
    float sum[kDots];
#ifdef GRACE_SIMD
    F8 acc[kDots][4];
    for (int d = 0; d < kn; ++d)
      for (int c = 0; c < 4; ++c) acc[d][c] = set8(0.0f);
    for (int64_t j = 0; j < c32; j += 32) {
      if (k0 == 0) {
        prefetch(x + j);
        prefetch(x + j + 16);
      }
      for (int c = 0; c < 4; ++c) {
        const F8 v = ld8(x + j + 8 * c);
        for (int d = 0; d < kn; ++d) acc[d][c] = acc[d][c] + v * ld8(q[d] + j + 8 * c);
      }
    }
    for (int d = 0; d < kn; ++d) sum[d] = combine8((acc[d][0] + acc[d][1]) + (acc[d][2] + acc[d][3]));
#else
    for (int d = 0; d < kn; ++d) {
      float acc[32] = {};
      for (int64_t j = 0; j < c32; j += 32)
        for (int l = 0; l < 32; ++l) acc[l] = acc[l] + x[j + l] * q[d][j + l];
      float v[8];
      for (int l = 0; l < 8; ++l) v[l] = (acc[l] + acc[l + 8]) + (acc[l + 16] + acc[l + 24]);
      sum[d] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
#endif
    for (int d = 0; d < kn; ++d) {
      for (int64_t j = c32; j < cols; ++j) sum[d] = sum[d] + x[j] * q[d][j];
      p[k0 + d] = sum[d];
    }
  }
}

// m = a + b, a row of cols floats (m may be a or b); a's infs and NaNs told to check
void row_sum(const float* a, const float* b, int64_t cols, float* m, FiniteCheck& check) {
  int64_t j = 0;
#ifdef GRACE_SIMD
  for (; j + 8 <= cols; j += 8) {
    if (!(j & 15)) {  // two input streams: one line of each every 16 elements
      prefetch(a + j);
      prefetch(b + j);
    }
    const F8 v = ld8(a + j);
    check.add8(v);
    st8(m + j, v + ld8(b + j));
  }
#endif
  for (; j < cols; ++j) {
    check.add(a[j]);
    m[j] = a[j] + b[j];
  }
}

// one matrix's products (the _many entry points below run them matrix after matrix)
void lowrank_project(const float* a, const float* b, int64_t rows, int64_t cols, const float* q, int64_t r, float* m,
                     float* p, float* nonfinite) {
  const Columns qt(q, cols, r);
  std::atomic<bool> bad{false};
  for_chunks(rows, 1, threads_for(rows * cols), [&](int, int64_t lo, int64_t hi) {
    FiniteCheck check;
    for (int64_t i = lo; i < hi; ++i) {
      const float* x = a + i * cols;
      if (b) {  // the row's sum, stored, then read back from the cache for its products
        row_sum(x, b + i * cols, cols, m + i * cols, check);
        x = m + i * cols;
      } else if (nonfinite) {
        check.range(x, 0, cols);
      }
      FlushDenormals flush;
      row_products(x, cols, qt, r, p + i * r);
    }
    report(check, &bad);
  });
  if (nonfinite && bad.load()) *nonfinite = 1.0f;
}

void lowrank_back(const float* m, int64_t rows, int64_t cols, const float* p, int64_t r, float* q) {
  std::vector<float> acc((size_t)(cols * r), 0.0f);  // Q^T (r x cols): a row per column of Q
  // each thread sums its own columns over every row
  for_chunks(cols, 8, threads_for(rows * cols), [&](int, int64_t lo, int64_t hi) {
    FlushDenormals flush;
    for (int64_t i = 0; i < rows; ++i) {
      const float* x = m + i * cols;
      for (int64_t k = 0; k < r; ++k) {
        float* o = acc.data() + k * cols;
        const float pk = p[i * r + k];
        int64_t j = lo;
#ifdef GRACE_SIMD
        const F8 pv = set8(pk);
        for (; j + 8 <= hi; j += 8) {
          if (!(j & 15) && k == 0) prefetch(x + j);
          st8(o + j, ld8(o + j) + ld8(x + j) * pv);
        }
#endif
        for (; j < hi; ++j) o[j] = o[j] + x[j] * pk;
      }
    }
  });
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t k = 0; k < r; ++k) q[j * r + k] = acc[k * cols + j];
}

void lowrank_expand(const float* p, const float* q, int64_t rows, int64_t cols, int64_t r, float* out, const float* m,
                    float* e) {
  const Columns qt(q, cols, r);
  for_chunks(rows, 1, threads_for(rows * cols), [&](int, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* pi = p + i * r;
      float* o = out + i * cols;
      {
        FlushDenormals flush;
        int64_t j = 0;
#ifdef GRACE_SIMD
        for (; j + 8 <= cols; j += 8) {
          F8 v = set8(pi[0]) * ld8(qt.row(0, cols) + j);
          for (int64_t k = 1; k < r; ++k) v = v + set8(pi[k]) * ld8(qt.row(k, cols) + j);
          st8(o + j, v);
        }
#endif
        for (; j < cols; ++j) {
          float v = pi[0] * qt.row(0, cols)[j];
          for (int64_t k = 1; k < r; ++k) v = v + pi[k] * qt.row(k, cols)[j];
          o[j] = v;
        }
      }
      if (e) {  // the row's residual, its approximation read back from the cache
        const float* mi = m + i * cols;
        float* ei = e + i * cols;
        int64_t j = 0;
#ifdef GRACE_SIMD
        for (; j + 8 <= cols; j += 8) {
          if (!(j & 15)) prefetch(mi + j);
          st8(ei + j, ld8(mi + j) - ld8(o + j));
        }
#endif
        for (; j < cols; ++j) ei[j] = mi[j] - o[j];
      }
    }
  });
}

// p / |p| for one column of n floats, the squares summed in float64 in index order (no
// underflow where p is tiny), the quotients rounded to float32; the first unit vector where p is
// zero: reduced QR's Q with a non-negative diagonal, as the backends' orthonormalize gives it
void unit_column(float* p, int64_t n) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += (double)p[i] * (double)p[i];
  const double norm = std::sqrt(squares);
  for (int64_t i = 0; i < n; ++i) p[i] = norm == 0.0 ? (i == 0 ? 1.0f : 0.0f) : (float)((double)p[i] / norm);
}
}  // namespace

API void grace_cpu_lowrank_project_many(int64_t count, const float* const* a, const float* const* b,
                                        const int64_t* rows, const int64_t* cols, const float* const* q,
                                        const int64_t* r, float* const* m, float* const* p, float* nonfinite) {
  for (int64_t s = 0; s < count; ++s)
    lowrank_project(a[s], b ? b[s] : nullptr, rows[s], cols[s], q[s], r[s], m ? m[s] : nullptr, p[s], nonfinite);
}

API void grace_cpu_lowrank_back_many(int64_t count, const float* const* m, const int64_t* rows, const int64_t* cols,
                                     float* const* p, const int64_t* r, int unit, float* const* q) {
  for (int64_t s = 0; s < count; ++s) {
    if (unit && r[s] == 1) unit_column(p[s], rows[s]);
    lowrank_back(m[s], rows[s], cols[s], p[s], r[s], q[s]);
  }
}

API void grace_cpu_lowrank_expand_many(int64_t count, const float* const* p, const float* const* q, const int64_t* rows,
                                       const int64_t* cols, const int64_t* r, float divisor, float* const* q_out,
                                       float* const* out, const float* const* m, float* const* e) {
  for (int64_t s = 0; s < count; ++s) {
    for (int64_t i = 0; i < cols[s] * r[s]; ++i) q_out[s][i] = q[s][i] / divisor;
    lowrank_expand(p[s], q_out[s], rows[s], cols[s], r[s], out[s], m ? m[s] : nullptr, e ? e[s] : nullptr);
  }
}
