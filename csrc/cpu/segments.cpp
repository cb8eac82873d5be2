// grace CPU kernels: scatter-add, and a bucket of gradients in one call (see common.h)
#include "draws.h"
#include "select.h"
#include "signs.h"

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

// f(the indices as a typed pointer): the index type picked once per payload, not per index
template <class F>
inline void with_indices(const void* idx, int t, F&& f) {
  switch (t) {
    case GRACE_U8: return f((const uint8_t*)idx);
    case GRACE_I16: return f((const int16_t*)idx);
    case GRACE_I32: return f((const int32_t*)idx);
    default: return f((const int64_t*)idx);
  }
}

// Whether every index of payload p is in [0, numel_of[p]) (checked before anything is written, so
// that a bad index leaves no partial sums behind); and into up[p], where given, whether its
// indices ascend (none smaller than the one before). All the payloads' indices shared among the
// threads in one pass, however many payloads there are and however long each is.
bool payloads_in_bounds(int64_t count, const void* const* idx, const int* types, const int64_t* lengths,
                        const int64_t* numel_of, char* up = nullptr) {
  std::vector<int64_t> first(count + 1, 0);
  for (int64_t p = 0; p < count; ++p) {
    if (!idx_type_ok(types[p]) || lengths[p] < 0) return false;
    first[p + 1] = first[p] + lengths[p];
  }
  const int nc = threads_for(first[count]);
  std::vector<char> bad(nc, 0), down((size_t)nc * count, 0);  // (each chunk's own)
  for_chunks(first[count], 64, nc, [&](int c, int64_t lo, int64_t hi) {
    for (int64_t p = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
         p < count && first[p] < hi; ++p) {
      const int64_t a = std::max(lo, first[p]) - first[p], b = std::min(hi, first[p + 1]) - first[p];
      with_indices(idx[p], types[p], [&](auto* ix) {
        const int64_t n = numel_of[p];
        int out = 0, unordered = 0;  // (branch-free: the loops vectorise)
        for (int64_t j = a; j < b; ++j) out |= (uint64_t)(int64_t)ix[j] >= (uint64_t)n;
        for (int64_t j = std::max<int64_t>(a, 1); j < b; ++j) unordered |= ix[j] < ix[j - 1];
        bad[c] |= out;
        down[(size_t)c * count + p] |= unordered;
      });
    }
  });
  for (int c = 0; c < nc; ++c)
    if (bad[c]) return false;
  if (up)
    for (int64_t p = 0; p < count; ++p) {
      up[p] = 1;
      for (int c = 0; c < nc; ++c) up[p] &= !down[(size_t)c * count + p];
    }
  return true;
}

// payloads_in_bounds of payloads that all index [0, numel); *ascending: whether all ascend
bool scatter_in_bounds(int count, const void* const* idx, const int* types, const int64_t* lengths, int64_t numel,
                       bool* ascending = nullptr) {
  std::vector<int64_t> numel_of(count, numel);
  std::vector<char> up(count);
  if (!payloads_in_bounds(count, idx, types, lengths, numel_of.data(), up.data())) return false;
  if (ascending) *ascending = std::all_of(up.begin(), up.end(), [](char u) { return u != 0; });
  return true;
}

// A block's n sums stored at out (streamed where `stream`: out 16-byte aligned) and the block
// zeroed in the same sweep, ready for the next block's sums with no fill of its own
template <class T>
inline void store_and_clear(T* out, T* block, int64_t n, bool stream) {
  int64_t i = 0;
#ifdef GRACE_SIMD
  if constexpr (std::is_same<T, float>::value) {
    const F8 zero = set8(0.0f);
#if defined(__AVX2__)
    // one 32-byte streaming store a group where out is so aligned (torch's tensors are): a 25 MB
    // bucket's sums, one thread, an AMD EPYC VM, 0.12 ms (12%) faster than put8's two 16-byte
    // halves. Not put8 itself: PowerSGD's streamed M became slower with it (mlp48, one thread:
    // 1.91-1.95x -> 2.00-2.06x of the floor)
    if (stream && (uintptr_t)out % 32 == 0)
      for (; i + 8 <= n; i += 8) {
        _mm256_stream_ps(out + i, ld8(block + i).a);
        st8(block + i, zero);
      }
#endif
    for (; i + 8 <= n; i += 8) {
      put8(out + i, ld8(block + i), stream);
      st8(block + i, zero);
    }
  }
#endif
  store_block(out + i, block + i, n - i, stream);
  std::fill(block + i, block + n, T(0));
}

// dense = zeros, then each payload's values (each divided by `divisor` where it is not 1) added
// at its indices, payload after payload. The indices are in bounds.
template <class T>
void scatter_add_apply(int count, const void* const* idx, const int* types, const void* const* values,
                       const int64_t* lengths, int64_t numel, T divisor, T* dense, bool ascending = false,
                       bool stream = false) {
  int64_t m = 0;
  for (int p = 0; p < count; ++p) m += lengths[p];
  const bool divide = divisor != T(1);
  auto value = [&](const T* v, int64_t j) { return divide ? v[j] / divisor : v[j]; };
  const int nc = threads_for(numel + m);
  if (ascending) {
    // Block by block, each block summed in a buffer that stays in the L1 cache and then stored
    // (streamed where `stream`): the output is written once, not zeroed and then read again
    // where the pairs land. Each payload's pairs of a block are the next ones in its order.
    constexpr int64_t kBlock = 4096;
    for_chunks(numel, kBlock, nc, [&](int, int64_t lo, int64_t hi) {
      alignas(64) T block[kBlock];
      std::fill(block, block + kBlock, T(0));  // (then each block's store leaves it zeroed)
      std::vector<int64_t> next(count);
      for (int p = 0; p < count; ++p) {  // the chunk's first pair of each payload
        int64_t a = 0, b = lengths[p];
        while (a < b) {
          const int64_t mid = (a + b) / 2;
          if (read_index(idx[p], types[p], mid) < lo) a = mid + 1; else b = mid;
        }
        next[p] = a;
      }
      for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
        const int64_t b1 = std::min(hi, b0 + kBlock);
        for (int p = 0; p < count; ++p) {
          const T* v = (const T*)values[p];
          const int64_t len = lengths[p];
          int64_t j = next[p];
          with_indices(idx[p], types[p], [&](auto* ix) {
            if (divide)
              for (; j < len && (int64_t)ix[j] < b1; ++j) block[ix[j] - b0] += v[j] / divisor;
            else
              for (; j < len && (int64_t)ix[j] < b1; ++j) block[ix[j] - b0] += v[j];
          });
          next[p] = j;
        }
        store_and_clear(dense + b0, block, b1 - b0, stream);
      }
      fence_streams(stream);
    });
  } else if (nc > 1 && m >= kGrain) {
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
    for_chunks(numel, 16, threads_for(numel), [&](int, int64_t lo, int64_t hi) {
      std::fill(dense + lo, dense + hi, T(0));
    });
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
  bool ascending = false;
  if (!scatter_in_bounds(count, idx, types, lengths, numel, &ascending)) return -1;
  scatter_add_apply(count, idx, types, values, lengths, numel, T(1), dense, ascending,
                    streams(dense, (int64_t)sizeof(T) * numel));
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
  const bool stream = bucket_bytes(count, n) >= kStreamBytes;
  std::atomic<bool> failed{false};
  for_segments(count, n, [&](int64_t s) {
    const int64_t ks = std::max<int64_t>(0, std::min(k[s], n[s]));
    if (topk_ef(g[s], r[s], n[s], ks, beta, gamma, flags, values[s], idx[s], idx_types[s], new_r[s], stream) != ks)
      failed = true;
    else
      flag.check(values[s], ks);  // (an inf or a NaN of p ranks above every number: it is sent)
  });
  return failed ? -1 : 0;
}

namespace {
// The Terms of p = compensate(g, r) (see Blocks), which store p into `p` on the way for the
// compression's own terms (`inner`, reading p there): compensation and compression in one pass.
// Where r_bits is given, r is a residual whose subtraction was deferred: r - (bit ? r_hi : r_lo),
// its bits' decoded values (the same difference as grace_cpu_bits_residual makes).
template <class Inner>
struct CompensatedTerms {
  const float *g, *r;
  float* p;
  float beta, gamma;
  int flags;
  Inner inner;
  const uint8_t* r_bits;
  float r_lo, r_hi;
  float residual(int64_t i) const { return r_bits ? r[i] - (((r_bits[i >> 3] >> (i & 7)) & 1) ? r_hi : r_lo) : r[i]; }
  void operator()(int64_t i, float* t) const {
    p[i] = compensate(g[i], residual(i), beta, gamma, flags);
    inner(i, t);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    prefetch(g + i);
    prefetch(r + i);
    const F8 a = ld8(g + i);
    F8 b = ld8(r + i);
    if (r_bits) b = b - sel8(bits8(r_bits[i / 8]), set8(r_hi), set8(r_lo));
    st8(p + i, ((flags & 1) ? a * set8(gamma) : a) + ((flags & 2) ? b * set8(beta) : b));
    inner.group(i, t);
  }
#endif
};
}  // namespace

// The residual step of EF-signSGD (mode 1) or 1-bit SGD (mode 2) for every segment s: p =
// compensate(g, r) into new_r[s] (may be r[s]) with its bits and scalars (grace_cpu_efsign_compress
// or grace_cpu_onebit_compress of p) into packed[s] and scalars[s] in the same pass, then
// new_r[s] = p - decode(bits), each gradient in turn (it stays in the cache between the passes).
// Deferred (kept_packed given): new_r[s] keeps p, and the bits and scalars are copied into
// kept_packed[s] and kept_scalars[s], the subtraction left to the next step's pass, which reads
// them as r_packed[s] and r_scalars[s] (r_packed given: r[s] is such a p; a segment's NULL: a
// residual made). -1 for another mode.
API int grace_cpu_bits_ef_many(int64_t count, const float* const* g, const float* const* r,
                               const uint8_t* const* r_packed, const float* const* r_scalars, float* const* new_r,
                               const int64_t* n, float beta, float gamma, int flags, int mode, uint8_t* const* packed,
                               float* const* scalars, uint8_t* const* kept_packed, float* const* kept_scalars,
                               float* nonfinite) {
  if (mode != 1 && mode != 2) return -1;
  NonfiniteFlag flag(nonfinite);
  const int per_row = mode == 1 ? 1 : 2;
  for_segments(count, n, [&](int64_t s) {
    float* const ps = new_r[s];
    const int nt = threads_for(n[s]);
    const uint8_t* const rb = r_packed ? r_packed[s] : nullptr;
    float lo = 0.0f, hi = 0.0f;
    if (rb) row_values(r_scalars[s], mode, lo, hi);
    if (mode == 1) {
      const Sums<1> sums = pairwise_sums<1>(
          CompensatedTerms<EfsignTerms>{g[s], r[s], ps, beta, gamma, flags, {ps, packed[s]}, rb, lo, hi}, n[s], nt);
      efsign_scale(sums, n[s], scalars[s]);
    } else {
      const Sums<3> sums = pairwise_sums<3>(
          CompensatedTerms<OnebitTerms>{g[s], r[s], ps, beta, gamma, flags, {ps, packed[s]}, rb, lo, hi}, n[s], nt);
      onebit_means(sums, n[s], scalars[s]);
    }
    if (kept_packed) {
      std::memcpy(kept_packed[s], packed[s], (size_t)((n[s] + 7) / 8));
      std::memcpy(kept_scalars[s], scalars[s], sizeof(float) * per_row);
    } else {
      grace_cpu_bits_residual(ps, packed[s], n[s], scalars[s], mode, ps);
    }
    flag.check(scalars[s], per_row);  // (not finite where p is not)
  });
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
  std::atomic<bool> failed{false};
  for_segments(count, n, [&](int64_t s) {
    counts[s] = threshold_ef(g[s], r[s], n[s], thr, beta, gamma, flags, values[s], idx[s], idx_types[s], new_r[s],
                             flag.wanted(), streams(new_r[s], bytes));
    if (counts[s] < 0) failed = true;
  });
  return failed ? -1 : 0;
}

// For each segment s: dense[s] (numels[s] elements) = zeros, then each rank's payload of it
// (values and indices [s * ranks + r], lengths[s * ranks + r]) divided by `divisor` and added,
// rank after rank: every gradient's sparse aggregate. 0, or -1 (nothing written) on an index
// out of range.
API int grace_cpu_scatter_add_segments(int64_t segments, int ranks, const void* const* idx, const int* idx_types,
                                       const void* const* values, const int64_t* lengths, float divisor,
                                       const int64_t* numels, float* const* dense) {
  if (segments < 0 || ranks < 0) return -1;
  std::vector<int64_t> numel_of(segments * ranks);
  for (int64_t s = 0; s < segments; ++s) {
    if (numels[s] < 0) return -1;
    std::fill(numel_of.begin() + s * ranks, numel_of.begin() + (s + 1) * ranks, numels[s]);
  }
  std::vector<char> up(segments * ranks), ascending(segments);
  if (!payloads_in_bounds(segments * ranks, idx, idx_types, lengths, numel_of.data(), up.data())) return -1;
  for (int64_t s = 0; s < segments; ++s)
    ascending[s] = std::all_of(up.begin() + s * ranks, up.begin() + (s + 1) * ranks, [](char u) { return u != 0; });
  const int64_t bytes = bucket_bytes(segments, numels);
  for (int64_t s = 0; s < segments; ++s)
    scatter_add_apply(ranks, idx + s * ranks, idx_types + s * ranks, values + s * ranks, lengths + s * ranks,
                      numels[s], divisor, dense[s], (bool)ascending[s], streams(dense[s], bytes));
  return 0;
}


namespace {
// an index on the wire: the little-endian integer of `width` bytes (non-negative), unaligned
inline int64_t wire_index(const uint8_t* at, int64_t width) {
  uint64_t x = 0;
  std::memcpy(&x, at, (size_t)width);
  return (int64_t)x;
}
}  // namespace

// The ranks' fixed-k sparse frames read in place: every index checked first, then the fill (NaN
// where a rank flagged an overflow) and each rank's pairs added in turn, as scatter-add does;
// how many ranks flagged one into *flagged (where given).
API int grace_cpu_sparse_frames_mean(const uint8_t* frames, int ranks, int64_t frame_size, const int64_t* slots,
                                     int64_t count, int64_t flag_at, float divisor, int64_t numel, float* out,
                                     float* flagged) {
  if (ranks < 0 || count < 0 || numel < 0 || frame_size < 0) return -1;
  const int64_t *value_at = slots, *index_at = slots + count, *width = slots + 2 * count, *base = slots + 3 * count;
  auto index_of = [&](const uint8_t* frame, int64_t j) { return base[j] + wire_index(frame + index_at[j], width[j]); };
  int flags = 0;
  for (int r = 0; r < ranks && flag_at >= 0; ++r) flags += frames[r * frame_size + flag_at] != 0;
  for (int r = 0; r < ranks; ++r)
    for (int64_t j = 0; j < count; ++j) {
      if (width[j] < 1 || width[j] > 8) return -1;
      const int64_t i = index_of(frames + r * frame_size, j);
      if (i < 0 || i >= numel) return -1;
    }
  if (flagged) *flagged = (float)flags;
  const bool poisoned = flags > 0;
  std::fill(out, out + numel, poisoned ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
  if (poisoned) return 0;
  for (int r = 0; r < ranks; ++r) {
    const uint8_t* frame = frames + r * frame_size;
    for (int64_t j = 0; j < count; ++j) {
      float v;
      std::memcpy(&v, frame + value_at[j], 4);
      out[index_of(frame, j)] += v / divisor;
    }
  }
  return 0;
}

// The ranks' variable-length sparse frames read in place (the rows of `table` in the header's
// terms): every piece and index checked first, then the fill and each rank's pairs added in turn.
API int grace_cpu_sparse_variable_mean(const uint8_t* frames, int64_t nbytes, const int64_t* table, int64_t segments,
                                       int ranks, float divisor, int64_t numel, float* out) {
  if (ranks < 0 || segments < 0 || numel < 0 || nbytes < 0) return -1;
  const int64_t rows = (int64_t)ranks * segments;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* t = table + GRACE_PAIR_COLUMNS * row;
    const int64_t count = t[3], width = t[5];
    if (count < 0 || width < 1 || width > 8 || t[0] < 0 || t[1] < 0 || t[0] + 4 * count > nbytes ||
        t[1] + width * count > nbytes)
      return -1;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t i = t[4] + wire_index(frames + t[1] + width * j, width);
      if (i < 0 || i >= numel) return -1;
    }
  }
  std::fill(out, out + numel, 0.0f);
  for (int64_t row = 0; row < rows; ++row) {  // (rank after rank: each rank's rows in a row)
    const int64_t* t = table + GRACE_PAIR_COLUMNS * row;
    for (int64_t j = 0; j < t[3]; ++j) {
      float v;
      std::memcpy(&v, frames + t[0] + 4 * j, 4);
      out[t[4] + wire_index(frames + t[1] + t[5] * j, t[5])] += v / divisor;
    }
  }
  return 0;
}

// The allreduced sum's indices checked first; then the fill (NaN where a rank flagged an
// overflow) and each value / divisor added (0 + v / n: the decompressed sum divided, to the bit).
API int grace_cpu_sparse_sum_mean(const float* values, const int64_t* idx, int64_t count, float divisor,
                                  const float* flag, int64_t numel, float* out) {
  if (count < 0 || numel < 0) return -1;
  for (int64_t j = 0; j < count; ++j)
    if (idx[j] < 0 || idx[j] >= numel) return -1;
  const bool poisoned = flag && *flag > 0.0f;
  std::fill(out, out + numel, poisoned ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
  if (!poisoned)
    for (int64_t j = 0; j < count; ++j) out[idx[j]] += values[j] / divisor;
  return 0;
}

// The draws ranked by hash, as a GPU's stable sort by (segment, hash) takes them (~hash: the
// smallest first; the selection's ties go to the lowest index); the residual step as randomk_ef.
API int grace_cpu_randomk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                      const int64_t* numels, const int64_t* ks, const uint32_t* s0,
                                      const uint32_t* s1, const float* scales, float beta, float gamma, int flags,
                                      float* values, int64_t* idx, float* new_r, void* flag, int flag_width) {
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 0 || ks[s] < 0 || ks[s] > numels[s]) return -1;
  int64_t at = 0;
  std::vector<int64_t> sel;
  std::atomic<bool> bad{false};
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t n = numels[s], k = ks[s], o = starts[s];
    float* p = new_r + o;
    compensate_into(g + o, r + o, n, beta, gamma, flags, p, flag ? &bad : nullptr);
    sel.clear();
    if (k >= n) {
      for (int64_t i = 0; i < n; ++i) sel.push_back(i);
    } else if (k > 0) {
      const uint32_t a = s0[s], b = s1[s];
      auto key = [&](int64_t i) { return (uint32_t)~hash32(hash32((uint64_t)i ^ a) ^ b); };
      auto hist1 = [&](int, int64_t lo, int64_t hi, int64_t* h, int shift) {
        for (int64_t i = lo; i < hi; ++i) h[key(i) >> shift]++;
      };
      topk_select<uint32_t>(n, k, 32, hist1, key, sel);
    }
    const float scale = scales ? scales[s] : 1.0f;
    for (int64_t j = 0; j < (int64_t)sel.size(); ++j) {
      const int64_t i = sel[j];
      const float v = scale == 1.0f ? p[i] : p[i] * scale;
      values[at + j] = v;
      idx[at + j] = o + i;
      p[i] = p[i] - (0.0f + v);
    }
    at += k;
  }
  if (flag) write_flag(flag, flag_width, bad);
  return 0;
}

// Segment s: the first ks[s] distinct of the index draws floor(hash_j * n / 2^32), j = 0, 1, ...,
// ascending, into out (the segments one after another): a bitmap of the n indices marks those
// drawn, and a scan of it writes them in order. The segments side by side on the threads, the
// largest first (each a serial draw: on one thread, ResNet-50's 161 took 3 ms). Returns -1 where
// k > n or n > 2^32.
API int grace_cpu_random_indices_segments(int64_t segments, const int64_t* numels, const int64_t* ks,
                                          const uint32_t* s0, const uint32_t* s1, int64_t* out) {
  int64_t draws = 0;
  std::vector<int64_t> at(segments), order(segments);
  for (int64_t s = 0; s < segments; ++s) {
    if (ks[s] < 0 || ks[s] > numels[s] || numels[s] > ((int64_t)1 << 32)) return -1;
    at[s] = draws;
    draws += ks[s];
    order[s] = s;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return numels[a] > numels[b]; });
  auto draw = [&](int64_t s) {
    const int64_t n = numels[s], k = ks[s];
    int64_t* const o = out + at[s];
    if (k == n) {
      for (int64_t i = 0; i < n; ++i) o[i] = i;
    } else if (k > 0) {
      std::vector<uint64_t> taken((n + 63) / 64, 0);
      for (int64_t j = 0, got = 0; got < k; ++j) {
        const uint64_t i = ((uint64_t)hash32(hash32((uint64_t)j ^ s0[s]) ^ s1[s]) * (uint64_t)n) >> 32;
        const uint64_t bit = (uint64_t)1 << (i & 63);
        got += !(taken[i >> 6] & bit);
        taken[i >> 6] |= bit;
      }
      int64_t q = 0;
      for (int64_t w = 0; w < (int64_t)taken.size(); ++w)
        for (uint64_t word = taken[w]; word; word &= word - 1) o[q++] = 64 * w + __builtin_ctzll(word);
    }
  };
  const int threads = (int)std::min<int64_t>(threads_for(draws, kScatteredGrain), std::max<int64_t>(1, segments));
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t j = 0; j < segments; ++j) draw(order[j]);
  } else {
    for (int64_t s = 0; s < segments; ++s) draw(s);
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
  for_segments(count, n, [&](int64_t s) {
    float* const ps = new_r[s];
    if (ascend[s]) {  // (as the draws make them)
      randomk_ef(g[s], r[s], n[s], idx[s], k[s], beta, gamma, flags, scale ? scale + s : nullptr, values[s], ps,
                 flag.wanted(), streams(ps, bytes));
      return;
    }
    compensate_into(g[s], r[s], n[s], beta, gamma, flags, ps, flag.wanted());
    for (int64_t j = 0; j < k[s]; ++j) {
      const int64_t i = idx[s][j];
      const float p = ps[i], v = scale ? p * scale[s] : p;
      values[s][j] = v;
      ps[i] = p - (0.0f + v);
    }
  });
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

// The selected pairs written into a fixed layout's frame where `slots` lays them, then its bytes
// [zero_from, frame_size) zeroed (grace_native.h)
API void grace_cpu_pairs_into_frame(const float* values, const int64_t* idx, int64_t pairs, const int64_t* slots,
                                    uint8_t* frame, int64_t zero_from, int64_t frame_size) {
  for (int64_t j = 0; j < pairs; ++j) {
    std::memcpy(frame + slots[j], values + j, 4);
    std::memcpy(frame + slots[pairs + j], idx + j, (size_t)slots[2 * pairs + j]);  // (little-endian: its low bytes)
  }
  if (frame_size > zero_from) std::memset(frame + zero_from, 0, (size_t)(frame_size - zero_from));
}

API void grace_cpu_copy_pieces(int64_t pieces, const void* const* src, const int64_t* nbytes, uint8_t* dst,
                               const int64_t* offsets) {
  for (int64_t j = 0; j < pieces; ++j) std::memcpy(dst + offsets[j], src[j], (size_t)nbytes[j]);
}

API int grace_cpu_variable_frame(int64_t pieces, int64_t per, const void* const* src, const int64_t* counts,
                                 const int64_t* widths, int flagged, uint8_t* frame, int64_t room, int64_t* sizes) {
  if (pieces < 0 || per < 1 || flagged < 0 || flagged > 1) return -1;
  int64_t end = 8 * pieces;
  for (int64_t j = 0; j < pieces; ++j) {
    const int64_t w = widths[j];
    if (counts[j / per] < 0 || !(w == 1 || w == 2 || w == 4 || w == 8)) return -1;
    end += counts[j / per] * w;
  }
  const int64_t size = (end + flagged + 7) / 8 * 8;
  sizes[0] = size;
  sizes[1] = end;
  if (frame == nullptr || size > room) return 0;
  for (int64_t j = 0; j < pieces; ++j) std::memcpy(frame + 8 * j, counts + j / per, 8);
  int64_t at = 8 * pieces;
  for (int64_t w = 8; w >= 1; w /= 2) {  // (the widest first: each piece aligned after the 8-byte header)
    for (int64_t j = 0; j < pieces; ++j) {
      if (widths[j] != w) continue;
      const int64_t nbytes = counts[j / per] * w;
      std::memcpy(frame + at, src[j], (size_t)nbytes);
      at += nbytes;
    }
  }
  std::memset(frame + end, 0, (size_t)(size - end));
  return 1;
}

API int grace_cpu_variable_rows(const uint8_t* data, int64_t total, int64_t ranks, int64_t pieces,
                                const int64_t* widths, int flagged, const int64_t* slots, uint64_t* pointers,
                                int64_t* counts, int64_t* flags_set) {
  if (ranks < 0 || pieces < 1 || total < 0 || flagged < 0 || flagged > 1) return -1;
  int64_t start = 0, set = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    if (total - start < 8 * pieces) return -1;
    const uint8_t* const frame = data + start;
    int64_t first, end = 8 * pieces;
    std::memcpy(&first, frame, 8);
    if (first == -1) return 1;  // (a rank sent its dense bucket)
    for (int64_t j = 0; j < pieces; ++j) {
      int64_t c;
      std::memcpy(&c, frame + 8 * j, 8);
      if (c < 0 || c > total) return -1;
      counts[slots[j] + r] = c;
      end += c * widths[j];
    }
    const int64_t size = (end + flagged + 7) / 8 * 8;
    if (size > total - start) return -1;
    int64_t at = 8 * pieces;
    for (int64_t w = 8; w >= 1; w /= 2) {  // (the order variable_frame writes them in)
      for (int64_t j = 0; j < pieces; ++j) {
        if (widths[j] != w) continue;
        pointers[slots[j] + r] = (uint64_t)(uintptr_t)(frame + at);
        at += counts[slots[j] + r] * w;
      }
    }
    if (at != end) return -1;  // (a width other than 1, 2, 4 or 8)
    set += flagged && frame[end] != 0;
    start += size;
  }
  if (start != total) return -1;
  *flags_set = set;
  return 0;
}
