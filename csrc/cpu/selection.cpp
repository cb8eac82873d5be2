// grace CPU kernels: selection (top-k, threshold, nonzero) and its error-feedback steps (see common.h)
#include "bitpack.h"
#include "select.h"

// ---- selection -------------------------------------------------------------------------------
namespace {
size_t idx_size(int t) { return t == GRACE_U8 ? 1 : t == GRACE_I16 ? 2 : t == GRACE_I32 ? 4 : 8; }

template <class T>
int64_t topk_any(const T* x, int64_t n, int64_t k, bool by_abs, void* idx, int idx_type, T* values) {
  return by_abs ? topk_typed<T, true>(x, n, k, idx, idx_type, values)
                : topk_typed<T, false>(x, n, k, idx, idx_type, values);
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
  return close_gaps(count, lo_of, idx, idx_size(idx_type), values, vsize);
}
}  // namespace

namespace grace_cpu {
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
  return close_gaps(count, lo_of, idx, idx_size(idx_type), values, sizeof(float));
}
}  // namespace grace_cpu

namespace {
template <class T>
int64_t threshold_typed(const T* x, int64_t n, T thr, bool by_abs, void* idx, int idx_type, T* values) {
  auto keep = [&](int64_t i) { return (by_abs ? std::fabs(x[i]) : x[i]) >= thr; };
  auto visit = [&](int64_t q, int64_t i) {
    if (q >= 0) values[q] = x[i];
  };
  return compact_select(n, idx, idx_type, values, sizeof(T), keep, visit);
}
}  // namespace

namespace grace_cpu {
// p = compensate(g, r) of n elements into p (may be r), in parallel chunks; whether g holds an
// inf or a NaN told to `bad` where given
void compensate_into(const float* g, const float* r, int64_t n, float beta, float gamma, int flags, float* p,
                     std::atomic<bool>* bad) {
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
}  // namespace grace_cpu

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
  return close_gaps(count, lo_of, idx, idx_size(idx_type));
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
// compress-store of 8 lanes without a branch per lane (most masks are empty, at random).
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

// Indices i + (each lane of `lanes`, one per byte) at idx[q], q + 1, ... (8 written: those past
// the lanes set are overwritten later or left beyond the count)
template <class I>
inline void put_lanes(void* idx, int64_t q, int64_t i, __m128i lanes) {
  if constexpr (sizeof(I) == 8) {
    const __m256i base = _mm256_set1_epi64x(i);
    _mm256_storeu_si256((__m256i*)((int64_t*)idx + q), _mm256_add_epi64(base, _mm256_cvtepu8_epi64(lanes)));
    _mm256_storeu_si256((__m256i*)((int64_t*)idx + q + 4),
                        _mm256_add_epi64(base, _mm256_cvtepu8_epi64(_mm_srli_si128(lanes, 4))));
  } else if constexpr (sizeof(I) == 4) {
    _mm256_storeu_si256((__m256i*)((int32_t*)idx + q),
                        _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), _mm256_cvtepu8_epi32(lanes)));
  } else if constexpr (sizeof(I) == 2) {
    _mm_storeu_si128((__m128i*)((int16_t*)idx + q),
                     _mm_add_epi16(_mm_set1_epi16((int16_t)i), _mm_cvtepu8_epi16(lanes)));
  } else {
    _mm_storel_epi64((__m128i*)((uint8_t*)idx + q), _mm_add_epi8(_mm_set1_epi8((char)i), lanes));
  }
}

// The lanes of p whose bits are set (elements i..i+7) appended at q: indices into idx, values
// into values; the new q. Only in groups that have any: most have none, and the branch a few
// mispredict cost less than 8 lanes stored in every group, which had made top-k's candidate
// pass over ResNet-50's gradients 1.5x the pass alone.
template <class I>
inline int64_t append_lanes(void* idx, float* values, int64_t q, int64_t i, __m256 p, int bits) {
  if (!bits) return q;
  const __m128i lanes = _mm_cvtsi64_si128((long long)kLanes.v[bits]);
  put_lanes<I>(idx, q, i, lanes);
  _mm256_storeu_ps(values + q, _mm256_permutevar8x32_ps(p, _mm256_cvtepu8_epi32(lanes)));
  return q + __builtin_popcount(bits);
}
#endif

// One chunk's candidates of the sampled pass: the elements with |p| >= t, in index order, with
// their p (room made uninitialised: filling it would cost a pass of its own).
struct Candidates {
  std::unique_ptr<int64_t[]> at;
  std::unique_ptr<float[]> val;
  int64_t count = 0;
};

// Elements [lo, hi) of the candidate pass: those with !(|p| < t) appended to `out`, p stored
// for the others and p - (0 + p) for them, as if all were sent (most are: the few that are not
// are put back, where a store over each sent one would wait on memory); stops early (returning
// false) once more than `limit` are found, then p stored. GAMMA/BETA: whether g and r are
// scaled (x * 1 is exact, but the loop without the multiply is the common one).
template <bool GAMMA, bool BETA>
bool collect_candidates(const float* g, const float* r, float* p_out, int64_t lo, int64_t hi, float beta,
                        float gamma, float t, int64_t limit, bool stream, Candidates& out) {
  constexpr int64_t kBlock = 1024;  // elements between checks of the count
  out.at.reset(new int64_t[limit + kBlock + 8]);
  out.val.reset(new float[limit + kBlock + 8]);
  int64_t* const A = out.at.get();
  float* const V = out.val.get();
  int64_t q = 0, i = lo;
  auto scalar = [&](int64_t j) {
    const float p = (GAMMA ? g[j] * gamma : g[j]) + (BETA ? r[j] * beta : r[j]);
    const bool candidate = !(std::fabs(p) < t);
    p_out[j] = candidate ? p - (0.0f + p) : p;
    A[q] = j;
    V[q] = p;
    q += candidate;
  };
  while (i < hi && q <= limit) {
    const int64_t end = std::min(hi, i + kBlock);
#if defined(GRACE_SIMD) && defined(__AVX2__)
    const __m256 vt = _mm256_set1_ps(t), vb = _mm256_set1_ps(beta), vg = _mm256_set1_ps(gamma);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), zero = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      prefetch(g + i);
      prefetch(r + i);
      __m256 a = _mm256_loadu_ps(g + i), b = _mm256_loadu_ps(r + i);
      if (GAMMA) a = _mm256_mul_ps(a, vg);
      if (BETA) b = _mm256_mul_ps(b, vb);
      const __m256 p = _mm256_add_ps(a, b);
      const __m256 candidate = _mm256_cmp_ps(_mm256_and_ps(p, sign), vt, _CMP_NLT_UQ);
      put8(p_out + i, F8{_mm256_blendv_ps(p, _mm256_sub_ps(p, _mm256_add_ps(zero, p)), candidate)}, stream);
      q = append_lanes<int64_t>(A, V, q, i, p, _mm256_movemask_ps(candidate));
    }
#endif
    for (; i < end; ++i) scalar(i);
  }
  fence_streams(stream);
  for (int64_t j = i; j < hi; ++j)  // (too many: the rest of p only)
    p_out[j] = (GAMMA ? g[j] * gamma : g[j]) + (BETA ? r[j] * beta : r[j]);
  out.count = q;
  return q <= limit;
}

// The sample's histogram of |p|'s top bits (8 of the exponent, 6 of the mantissa), the sampled
// lines shared among the threads (whose histograms are added: the same counts).
constexpr int kFineBits = 14, kFineShift = 31 - kFineBits;
std::vector<uint32_t> sample_histogram(const float* g, const float* r, int64_t n, float beta, float gamma,
                                       int flags, int64_t lines) {
  constexpr int64_t kStride = kLine * kSampleEvery;
  // (the hardware may not see the stride) far enough ahead that a line's wait is covered: 8
  // strides left a sample's reads waiting on memory (48 gradients of 1 MB, one thread, an AMD
  // EPYC VM: top-k's bucket call 0.14-0.19 ms faster at 24-64 strides than at 8)
  constexpr int64_t kAhead = 32 * kStride;
  const int nt = threads_for(n);
  std::vector<uint32_t> hist((size_t)nt << kFineBits, 0);
  for_chunks(lines, 1, nt, [&](int c, int64_t lo, int64_t hi) {
    uint32_t* const h = hist.data() + ((size_t)c << kFineBits);
    for (int64_t line = lo * kStride; line < hi * kStride; line += kStride) {
      if (line + kAhead < n) {
        __builtin_prefetch(g + line + kAhead);
        __builtin_prefetch(r + line + kAhead);
      }
      for (int64_t i = line; i < line + kLine; ++i)
        h[KeyOf<float>::key(compensate(g[i], r[i], beta, gamma, flags), true) >> kFineShift]++;
    }
  });
  for (int c = 1; c < nt; ++c)
    for (size_t b = 0; b < ((size_t)1 << kFineBits); ++b) hist[b] += hist[((size_t)c << kFineBits) + b];
  hist.resize((size_t)1 << kFineBits);
  return hist;
}

// The k largest |p| of the chunks' candidates (ties to the lowest index) into values and idx,
// and p put back in new_r over the candidates not among them; each chunk's by its own thread
// (their places in new_r are scattered: the writes wait on memory). false, with nothing
// written, where the candidates are fewer than k.
bool write_largest(const std::vector<Candidates>& cand, int64_t k, float* values, void* idx, int idx_type,
                   float* new_r) {
  const int nc = (int)cand.size();
  std::vector<int64_t> first(nc + 1, 0);
  for (int c = 0; c < nc; ++c) first[c + 1] = first[c] + cand[c].count;
  if (first[nc] < k) return false;
  std::vector<uint32_t> keys(first[nc]);
  for (int c = 0; c < nc; ++c)
    for (int64_t j = 0; j < cand[c].count; ++j) keys[first[c] + j] = KeyOf<float>::key(cand[c].val[j], true);
  const uint32_t T = kth_largest(keys, k);
  // chunk c writes its keys above T and, of the ties, those left after the chunks before it
  std::vector<int64_t> above(nc, 0), equal(nc, 0), out_at(nc), ties_of(nc);
  int64_t ties = k;
  for (int c = 0; c < nc; ++c) {
    for (int64_t j = first[c]; j < first[c + 1]; ++j) {
      above[c] += keys[j] > T;
      equal[c] += keys[j] == T;
    }
    ties -= above[c];
  }
  for (int64_t c = 0, pos = 0; c < nc; ++c) {
    ties_of[c] = std::min(ties, equal[c]);
    ties -= ties_of[c];
    out_at[c] = pos;
    pos += above[c] + ties_of[c];
  }
  for_chunks(nc, 1, threads_for(k, kScatteredGrain) > 1 ? nc : 1, [&](int, int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      int64_t q = out_at[c], ties = ties_of[c];
      for (int64_t j = 0; j < cand[c].count; ++j) {
        const uint32_t key = keys[first[c] + j];
        const int64_t i = cand[c].at[j];
        if (key > T || (key == T && ties-- > 0)) {
          write_index(idx, idx_type, q, i);
          values[q++] = cand[c].val[j];
        } else {
          new_r[i] = cand[c].val[j];  // (not sent after all)
        }
      }
    }
  });
  return true;
}

// Top-k of p = compensate(g, r) into values/idx with p stored in new_r and the sent elements'
// p - (0 + p) over it, where the sample leads to k candidates (kChosen).
Sampled topk_ef_sampled(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                        float* new_r, float* values, void* idx, int idx_type, bool stream) {
  if (n < kSampledFrom) return Sampled::kNotTried;
  // Every kSampleEvery-th line: a prime stride, so that the sample sees every column of a
  // matrix (a stride that divides the rows would see the same few columns of every row).
  const int64_t lines = (n - kLine) / (kLine * kSampleEvery) + 1;
  const std::vector<uint32_t> hist = sample_histogram(g, r, n, beta, gamma, flags, lines);
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
  std::vector<Candidates> cand(nc);
  std::atomic<bool> over{false};
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    const int64_t limit = cap / nc + 64;
    bool ok;
    switch (flags & 3) {
      case 0: ok = collect_candidates<false, false>(g, r, new_r, lo, hi, beta, gamma, t, limit, stream, cand[c]); break;
      case 1: ok = collect_candidates<true, false>(g, r, new_r, lo, hi, beta, gamma, t, limit, stream, cand[c]); break;
      case 2: ok = collect_candidates<false, true>(g, r, new_r, lo, hi, beta, gamma, t, limit, stream, cand[c]); break;
      default: ok = collect_candidates<true, true>(g, r, new_r, lo, hi, beta, gamma, t, limit, stream, cand[c]);
    }
    if (!ok) over = true;
  });
  if (!over && write_largest(cand, k, values, idx, idx_type, new_r)) return Sampled::kChosen;
  for (const Candidates& c : cand)  // p back over the candidates, for the exact path
    for (int64_t j = 0; j < c.count; ++j) new_r[c.at[j]] = c.val[j];
  return Sampled::kStored;
}
}  // namespace

namespace grace_cpu {
int64_t topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                float* values, void* idx, int idx_type, float* new_r, bool stream) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  std::vector<int64_t> sel;
  auto key = [&](int64_t i) { return KeyOf<float>::key(new_r[i], true); };
  const Sampled sampled = k > 0 && k < n
                              ? topk_ef_sampled(g, r, n, k, beta, gamma, flags, new_r, values, idx, idx_type,
                                                stream && new_r != r && (uintptr_t)new_r % 16 == 0)
                              : Sampled::kNotTried;
  if (sampled == Sampled::kChosen) {
    return k;  // (written, in one pass over memory)
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
}  // namespace grace_cpu

API int64_t grace_cpu_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma,
                              int flags, float* values, void* idx, int idx_type, float* new_r) {
  return topk_ef(g, r, n, k, beta, gamma, flags, values, idx, idx_type, new_r, 4 * n >= kStreamBytes);
}

namespace {
#if defined(GRACE_SIMD) && defined(__AVX2__)
// threshold_ef's pass over [i, hi) in groups of 8, the sent ones appended from q (append_lanes):
// the new q; i advanced to the last group's end
template <class I>
int64_t threshold_ef_lanes(const float* g, const float* r, int64_t& i, int64_t hi, int64_t q, float thr, float beta,
                           float gamma, int flags, float* values, void* idx, float* new_r, FiniteCheck& check,
                           bool stream) {
  const F8 t = set8(thr), vb = set8(beta), vg = set8(gamma), zero = set8(0.0f);
  for (; i + 8 <= hi; i += 8) {
    prefetch(g + i);
    prefetch(r + i);
    const F8 a = ld8(g + i), b = ld8(r + i);
    check.add8(a);
    const F8 p = ((flags & 1) ? a * vg : a) + ((flags & 2) ? b * vb : b);
    const F8 sent = ge8(abs8(p), t);
    q = append_lanes<I>(idx, values, q, i, p.a, mask8(sent));
    put8(new_r + i, sel8(sent, p - (zero + p), p), stream);
  }
  return q;
}
#endif
}  // namespace

namespace grace_cpu {
// grace_cpu_threshold_ef, telling `bad` (where given) whether g holds an inf or a NaN; new_r
// streamed where `stream` (16-byte aligned) and it is not r: the sent elements' p - (0 + p) made
// before the store
int64_t threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma, int flags,
                     float* values, void* idx, int idx_type, float* new_r, std::atomic<bool>* bad, bool stream) {
  if (!idx_type_ok(idx_type) || n < 0) return -1;
  stream = stream && new_r != r;  // (over its own input each line was just read: a plain store)
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    int64_t q = lo, i = lo;
    FiniteCheck check;
#if defined(GRACE_SIMD) && defined(__AVX2__)
    switch (idx_type) {
      case GRACE_U8: q = threshold_ef_lanes<uint8_t>(g, r, i, hi, q, thr, beta, gamma, flags, values, idx, new_r,
                                                     check, stream); break;
      case GRACE_I16: q = threshold_ef_lanes<int16_t>(g, r, i, hi, q, thr, beta, gamma, flags, values, idx, new_r,
                                                      check, stream); break;
      case GRACE_I32: q = threshold_ef_lanes<int32_t>(g, r, i, hi, q, thr, beta, gamma, flags, values, idx, new_r,
                                                      check, stream); break;
      default: q = threshold_ef_lanes<int64_t>(g, r, i, hi, q, thr, beta, gamma, flags, values, idx, new_r, check,
                                               stream);
    }
    fence_streams(stream);
#elif defined(GRACE_SIMD)
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
  return close_gaps(count, lo_of, idx, idx_size(idx_type), values, sizeof(float));
}
}  // namespace grace_cpu

API int64_t grace_cpu_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                                   int flags, float* values, void* idx, int idx_type, float* new_r) {
  return threshold_ef(g, r, n, thr, beta, gamma, flags, values, idx, idx_type, new_r, nullptr, streams(new_r, 4 * n));
}

// Threshold's selection of a bucket's contiguous segments before its frame is made: p, the mask,
// each segment's count, the header (each count twice, the overflow flag on top of the last) and
// the flag (any g non-finite), in one pass.
API int grace_cpu_threshold_select_segments(const float* g, const float* r, int64_t n, const int64_t* starts,
                                            int64_t segments, float thr, float beta, float gamma, int flags, float* p,
                                            uint8_t* take, int64_t* counts, int64_t* header, void* flag,
                                            int flag_width) {
  if (n < 0 || segments < 1 || starts[0] != 0) return -1;
  for (int64_t s = 1; s < segments; ++s)
    if (starts[s] < starts[s - 1] || starts[s] > n) return -1;
  bool bad = false;
  for (int64_t s = 0, i = 0; s < segments; ++s) {
    int64_t c = 0;
    for (const int64_t end = s + 1 < segments ? starts[s + 1] : n; i < end; ++i) {
      bad |= !std::isfinite(g[i]);
      p[i] = compensate(g[i], r[i], beta, gamma, flags);
      take[i] = std::fabs(p[i]) >= thr;
      c += take[i];
    }
    counts[s] = header[2 * s] = header[2 * s + 1] = c;
  }
  if (flag && bad) header[2 * segments - 1] |= int64_t(1) << GRACE_FLAG_SHIFT;
  if (flag) write_flag(flag, flag_width, bad);
  return 0;
}

// Threshold's frame from its selection: each segment's taken values and indices where its row of
// `table` lays them, the new residual p - (0 + p) over p in their place, then the flag byte and
// zeros; every row checked against the mask and the frame first.
API int grace_cpu_threshold_write_segments(float* p, const uint8_t* take, int64_t n, const int64_t* table,
                                           int64_t segments, uint8_t* frame, int64_t frame_size, int64_t tail,
                                           const uint8_t* flag) {
  if (n < 0 || segments < 1 || tail < 0 || tail > frame_size) return -1;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t* t = table + GRACE_PAIR_COLUMNS * s;
    const int64_t end = s + 1 < segments ? t[GRACE_PAIR_COLUMNS + 4] : n;
    if (t[4] < 0 || end < t[4] || end > n || t[5] < 1 || t[5] > 8 || t[0] < 0 || t[1] < 0 ||
        t[0] + 4 * t[3] > tail || t[1] + t[5] * t[3] > tail)
      return -1;
    int64_t c = 0;
    for (int64_t i = t[4]; i < end; ++i) c += take[i] != 0;
    if (c != t[3]) return -1;
  }
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t* t = table + GRACE_PAIR_COLUMNS * s;
    const int64_t end = s + 1 < segments ? t[GRACE_PAIR_COLUMNS + 4] : n;
    for (int64_t i = t[4], j = 0; i < end; ++i) {
      if (!take[i]) continue;
      const int64_t local = i - t[4];
      std::memcpy(frame + t[0] + 4 * j, p + i, 4);
      std::memcpy(frame + t[1] + t[5] * j, &local, (size_t)t[5]);  // (little-endian: its low bytes)
      p[i] = p[i] - (0.0f + p[i]);
      ++j;
    }
  }
  for (int64_t b = tail; b < frame_size; ++b) frame[b] = b == tail && flag ? *flag : 0;
  return 0;
}
