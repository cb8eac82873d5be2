// grace CPU kernels: float keys, radix selection and error-feedback compensation, shared by
// selection.cpp, segments.cpp and dgc.cpp (see common.h)
#pragma once
#include "lanes.h"

namespace grace_cpu {
// (selection.cpp) the elements of x with x >= thr (|x| >= thr where by_abs), ascending, into idx
// (and values where not NULL): their count
int64_t threshold_f32(const float* x, int64_t n, float thr, bool by_abs, void* idx, int idx_type, float* values);
// (selection.cpp) p = compensate(g, r) of n elements into p (may be r); g's infs and NaNs told to bad
void compensate_into(const float* g, const float* r, int64_t n, float beta, float gamma, int flags, float* p,
                     std::atomic<bool>* bad = nullptr);
// (selection.cpp) grace_cpu_topk_ef; new_r streamed where `stream` and it is not r (the caller
// judges whether the outputs are beyond the caches: a bucket's together)
int64_t topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                float* values, void* idx, int idx_type, float* new_r, bool stream);
// (selection.cpp) grace_cpu_threshold_ef, telling `bad`; new_r streamed where `stream` and it is
// not r
int64_t threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma, int flags,
                     float* values, void* idx, int idx_type, float* new_r, std::atomic<bool>* bad, bool stream);

// Chunk c wrote its count[c] kept elements at the start of its own range (from lo_of[c]) of idx
// (isz bytes each) and of values (vsize bytes each, where not NULL): move them together. The total.
inline int64_t close_gaps(const std::vector<int64_t>& count, const std::vector<int64_t>& lo_of, void* idx, size_t isz,
                          void* values = nullptr, size_t vsize = 0) {
  int64_t pos = 0;
  for (size_t c = 0; c < count.size(); ++c) {
    if (count[c] && pos != lo_of[c]) {
      std::memmove((char*)idx + pos * isz, (char*)idx + lo_of[c] * isz, count[c] * isz);
      if (values) std::memmove((char*)values + pos * vsize, (char*)values + lo_of[c] * vsize, count[c] * vsize);
    }
    pos += count[c];
  }
  return pos;
}
}  // namespace grace_cpu

namespace {
using grace_cpu::close_gaps;
using grace_cpu::compensate_into;
using grace_cpu::threshold_ef;
using grace_cpu::topk_ef;
using grace_cpu::threshold_f32;

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

inline bool idx_type_ok(int t) { return t >= GRACE_U8 && t <= GRACE_I64; }

constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;

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

// The positions j of the `need` largest keys (1 <= need <= their number), ties to the lowest j,
// each handed to take(j) in ascending order: the need-th largest by kth_largest, then one pass.
template <class K, class Take>
void largest_in_order(const std::vector<K>& keys, int64_t need, Take&& take) {
  const K t = kth_largest(keys, need);
  int64_t ties = need;
  for (const K key : keys) ties -= key > t;
  for (int64_t j = 0; j < (int64_t)keys.size(); ++j)
    if (keys[j] > t || (keys[j] == t && ties-- > 0)) take(j);
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
  largest_in_order(cand_key, need, [&](int64_t j) { chosen.push_back(cand[j]); });
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
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    hist1(c, lo, hi, hist.data() + (size_t)c * kBins, shift);
  });
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

inline float compensate(float g, float r, float beta, float gamma, int flags) {
  float p = (flags & 1) ? g * gamma : g;
  return p + ((flags & 2) ? r * beta : r);
}
}  // namespace
