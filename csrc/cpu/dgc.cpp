// grace CPU kernels: DGC's momentum correction and step (see common.h)
#include "draws.h"
#include "select.h"

#include <functional>

// ---- DGC's momentum correction -----------------------------------------------------------------
namespace {
// momentum factor masking where p is sent (its payload p + 0): u = (p - v) * 0 where it is not
// zero, v = p - (p + 0); pu holds p - v
inline void sent_at(float& p, float& pu) {
  const float sent = p + 0.0f;
  pu = sent != 0.0f ? pu * 0.0f : pu;
  p = p - sent;
}

// DGC's momentum correction of elements [lo, hi): p = v + (m u + g) into v_out and p - v into
// u_out (each rounding as the tensor ops make it: a product, then two sums; outputs may be their
// inputs), g being g * scale where kScaled (clipping: one product first, as the tensor op);
// where kSelect, those with |p| >= thr written from q on (sel: their indices, sel_p: p, sel_u:
// p - v) and their outputs as if sent (momentum factor masking: u = (p - v) * 0 where p + 0 != 0,
// v = p - (p + 0)), the few cut later put back from there: the new q; g's elements (before the
// scale) into `check`.
// Selecting, the outputs are streamed where aligned (AVX2): later only the few elements cut from
// the selection are written again, and streaming saves reading each output line before it is
// written (1.5 of 11 ms for 48 steps of 1 MB).
template <bool kSelect, bool kScaled>
int64_t dgc_range(const float* u, const float* v, const float* g, float m, float scale, float* u_out, float* v_out,
                  int64_t lo, int64_t hi, FiniteCheck& checked, float thr = 0.0f, int64_t* sel = nullptr,
                  float* sel_p = nullptr, float* sel_u = nullptr, int64_t q = 0) {
  FiniteCheck check;  // (in registers: a store to an output might alias `checked`, as far as the compiler knows)
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
    const F8 vv = ld8(v + i), raw = ld8(g + i);
    F8 p = vv + (vm * ld8(u + i) + (kScaled ? raw * vs : raw)), pu = p - vv;
    check.add8(raw);
    if (kSelect) {
      if (int k = mask8(ge8(abs8(p), t))) {
        alignas(32) float pv[8], uv[8];
        st8(pv, p);
        st8(uv, pu);
        for (; k; k &= k - 1) {
          const int j = __builtin_ctz(k);
          sel[q] = i + j;
          sel_p[q] = pv[j];
          sel_u[q++] = uv[j];
          sent_at(pv[j], uv[j]);
        }
        p = ld8(pv);
        pu = ld8(uv);
      }
    }
#if defined(__AVX2__)
    if (nt) {
      _mm256_stream_ps(u_out + i, pu.a);
      _mm256_stream_ps(v_out + i, p.a);
    } else
#endif
    {
      st8(u_out + i, pu);
      st8(v_out + i, p);
    }
  }
#endif
  for (; i < hi; ++i) {
    const float vv = v[i];
    float p = vv + (m * u[i] + (kScaled ? g[i] * scale : g[i])), pu = p - vv;
    check.add(g[i]);
    if (kSelect && std::fabs(p) >= thr) {
      sel[q] = i;
      sel_p[q] = p;
      sel_u[q++] = pu;
      sent_at(p, pu);
    }
    u_out[i] = pu;
    v_out[i] = p;
  }
  checked.merge(check);
  return q;
}

// The momentum correction of n elements and, in the same pass, those with |p| >= thr as dgc_range
// leaves them, ascending, in sel, sel_p and sel_u (room for n; each chunk's at the start of its own
// range, then moved together): their count. Whether g holds an inf or a NaN told to `bad` where given.
int64_t dgc_compensate_select(const float* u, const float* v, const float* g, int64_t n, float m, float scale,
                              float thr, float* u_out, float* v_out, int64_t* sel, float* sel_p, float* sel_u,
                              std::atomic<bool>* bad) {
  const int nc = threads_for(n);
  std::vector<int64_t> count(nc, 0), lo_of(nc, 0);
  for_chunks(n, 64, nc, [&](int c, int64_t lo, int64_t hi) {
    FiniteCheck check;
    count[c] = (scale != 1.0f ? dgc_range<true, true>(u, v, g, m, scale, u_out, v_out, lo, hi, check, thr, sel,
                                                      sel_p, sel_u, lo)
                              : dgc_range<true, false>(u, v, g, m, scale, u_out, v_out, lo, hi, check, thr, sel,
                                                       sel_p, sel_u, lo)) -
               lo;
    lo_of[c] = lo;
    report(check, bad);
  });
  fence_streams(true);
  close_gaps(count, lo_of, sel_u, sizeof(float));
  return close_gaps(count, lo_of, sel, sizeof(int64_t), sel_p, sizeof(float));
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

namespace {
// Uninitialised room for at least n values (filling it would cost a pass), allocated again only
// to grow: kept from call to call, as fresh pages are faulted in and cleared where first written.
template <class T>
struct KeptRoom {
  std::unique_ptr<T[]> data;
  int64_t size = 0;
  T* at_least(int64_t n) {
    n = std::max<int64_t>(n, 1);
    if (n > size) {
      data.reset(new T[n]);
      size = n;
    }
    return data.get();
  }
};

// A thread's room and buffers for DGC's step, kept for its next call (see KeptRoom)
struct DgcScratch {
  KeptRoom<int64_t> sel;
  KeptRoom<float> sel_p, sel_u;
  std::vector<float> drawn;
  std::vector<uint32_t> keys, cand_keys;
  std::vector<int64_t> pick;
};
DgcScratch& dgc_scratch() {
  thread_local DgcScratch scratch;
  return scratch;
}

// DGC's threshold: the need-th largest of a sample's keys (|p| as bits: NaN above inf, as sorts put it)
float key_threshold(const std::vector<uint32_t>& keys, int64_t need) {
  const uint32_t t = kth_largest(keys, need);
  float thr;
  std::memcpy(&thr, &t, 4);
  return thr;
}

// The k largest of c > k candidates by their magnitudes abs_of(j) (ties to the lowest j), ascending,
// into the scratch's pick: where the sample underestimated the threshold and more than k were selected.
// By largest_in_order, not top-k's selection: the candidates lie just above the threshold, within
// a few of its 2048 bins, and a gradient has a few thousand (ResNet-50's 123-133 cut gradients:
// 1.4-1.9 ms a step by the bins' histogram, 0.41-0.62 so).
template <class Magnitude>
void pick_largest(DgcScratch& scratch, int64_t c, int64_t k, Magnitude abs_of) {
  std::vector<uint32_t>& keys = scratch.cand_keys;
  keys.resize(c);
  for (int64_t j = 0; j < c; ++j) keys[j] = KeyOf<float>::key(abs_of(j), false);
  std::vector<int64_t>& pick = scratch.pick;
  pick.clear();
  largest_in_order(keys, k, [&](int64_t j) { pick.push_back(j); });
}

// The k largest |p| of the c > k elements selected at sel (ascending; ties to the lowest index),
// ascending, into the scratch's pick; `chosen` then points at them. Returns k.
int64_t largest_selected(const float* p, const int64_t* sel, int64_t c, int64_t k, DgcScratch& scratch,
                         const int64_t*& chosen) {
  pick_largest(scratch, c, k, [&](int64_t j) { return std::fabs(p[sel[j]]); });
  std::vector<int64_t>& pick = scratch.pick;
  for (int64_t j = 0; j < k; ++j) pick[j] = sel[pick[j]];
  chosen = pick.data();
  return k;
}

// The k largest |p| of every element but NaNs (ties to the lowest index), ascending, into the
// scratch's pick, for a threshold of 0: a sample with fewer nonzeros than it needs (a sparse p,
// such as a shard's owner sums of the ranks' selections). Zeros rank below every other element
// and tie with one another: the nonzeros' k largest where there are more than k nonzeros, else
// all of them and the first zeros in index order, without ranking d keys (a 6.4M-element shard
// of ResNet-50's bucket, one thread: 25 ms). By the bits (0 and the NaNs' keys), whatever the
// CPU's denormal mode. Their count; `chosen` then points at them.
int64_t select_above_zero(const float* p, int64_t d, int64_t k, DgcScratch& scratch, const int64_t*& chosen) {
  int64_t* const sel = scratch.sel.at_least(d);
  std::vector<int64_t>& pick = scratch.pick;
  pick.clear();  // (the first zeros, at most k)
  int64_t c = 0;
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t key = KeyOf<float>::key(p[i], true);
    if (key == 0) {
      if ((int64_t)pick.size() < k) pick.push_back(i);
    } else if (key <= 0x7f800000u) {
      sel[c++] = i;
    }
  }
  if (c > k) return largest_selected(p, sel, c, k, scratch, chosen);
  const int64_t zeros = std::min<int64_t>(k - c, (int64_t)pick.size());
  std::vector<int64_t> merged(c + zeros);
  std::merge(sel, sel + c, pick.begin(), pick.begin() + zeros, merged.begin());
  pick.swap(merged);
  chosen = pick.data();
  return c + zeros;
}

// DGC.select of p (d > 0 floats, compensated): the threshold from S elements drawn at floor(u_j * d)
// (u_j: the uniform draws of the seed words (s0, s1); the product in float32), or from every
// element where S = d; the elements with |p| at or above it, ascending, cut to the k largest |p| of
// them (ties to the lowest index) where more. Their count; `chosen` then points at their indices
// (in the scratch).
int64_t select_sampled(const float* p, int64_t d, int64_t S, int64_t need, int64_t k, uint32_t s0, uint32_t s1,
                       DgcScratch& scratch, const int64_t*& chosen) {
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(S);
  if (S == d) {
    for (int64_t j = 0; j < d; ++j) keys[j] = KeyOf<float>::key(p[j], true);
  } else {
    std::vector<float>& drawn = scratch.drawn;
    drawn.resize(S);
    uniform_range(0, S, s0, s1, drawn.data());
    const float df = (float)d;
    auto place = [&](int64_t j) { return (int64_t)std::floor(drawn[j] * df); };
    for (int64_t j = 0; j < S; ++j) {  // (reads at random places, each asked for ahead)
      if (j + kRandomAhead < S) prefetch_to_l2(p + place(j + kRandomAhead));
      keys[j] = KeyOf<float>::key(p[place(j)], true);
    }
  }
  const float thr = key_threshold(keys, need);
  if (thr == 0.0f) return select_above_zero(p, d, k, scratch, chosen);
  int64_t* const sel = scratch.sel.at_least(d);
  const int64_t c = threshold_f32(p, d, thr, true, sel, GRACE_I64, nullptr);
  chosen = sel;
  return c <= k ? c : largest_selected(p, sel, c, k, scratch, chosen);
}
}  // namespace

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
  NonfiniteFlag flag(nonfinite);
  // gradient s's whole step, with the scratch of the thread it runs on
  auto step = [&](int64_t s, DgcScratch& scratch) {
    int64_t* const sel = scratch.sel.at_least(most);
    float* const sel_p = scratch.sel_p.at_least(most);
    float* const sel_u = scratch.sel_u.at_least(most);
    std::vector<float>& drawn = scratch.drawn;
    std::vector<uint32_t>& keys = scratch.keys;
    std::vector<int64_t>& pick = scratch.pick;
    const int64_t d = n[s];
    counts[s] = 0;
    float* const p = v_out[s];
    float* const un = u_out[s];
    const int64_t k = at_most(ratio * (double)d, d), S = at_most(sample_ratio * (double)d, d);
    const float scale = scales ? scales[s] : 1.0f;
    if (d == 0) return;
    const int64_t need = at_most(ratio * (double)S, S);
    // the c chosen elements of p sent: values, indices, momentum factor masking
    auto send = [&](const int64_t* chosen, int64_t c) {
      for_chunks(c, 64, threads_for(c, kScatteredGrain), [&](int, int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t i = chosen[j];
          values[s][j] = p[i];
          write_index(idx[s], idx_types[s], j, i);
          sent_at(p[i], un[i]);
        }
      });
      counts[s] = c;
    };
    if (S == d) {  // every element: compensate, then select
      dgc_compensate(u[s], v[s], g[s], d, m, scale, un, p, flag.wanted());
      const int64_t* chosen;
      const int64_t c = select_sampled(p, d, S, need, k, 0, 0, scratch, chosen);
      return send(chosen, c);
    }
    // the sample's p first (the same sums as the pass makes), then compensate and select in one pass
    keys.resize(S);
    drawn.resize(S);
    const float df = (float)d;  // (floor(u d) < d: u <= 1 - 2^-24, and the product never rounds up to d)
    for_chunks(S, 64, threads_for(S, kScatteredGrain), [&](int, int64_t lo, int64_t hi) {
      uniform_range(lo, hi, s0[s], s1[s], drawn.data() + lo);
      auto place = [&](int64_t j) { return (int64_t)std::floor(drawn[j] * df); };
      for (int64_t j = lo; j < hi; ++j) {  // (reads at random places, each asked for ahead)
        if (j + kRandomAhead < hi) {
          const int64_t a = place(j + kRandomAhead);
          prefetch_to_l2(u[s] + a);
          prefetch_to_l2(v[s] + a);
          prefetch_to_l2(g[s] + a);
        }
        const int64_t i = place(j);
        keys[j] = KeyOf<float>::key(v[s][i] + (m * u[s][i] + (scale != 1.0f ? g[s][i] * scale : g[s][i])), true);
      }
    });
    const float thr = key_threshold(keys, need);
    if (thr == 0.0f) {  // (a mostly zero gradient, an embedding's: every element would pass; select_above_zero)
      dgc_compensate(u[s], v[s], g[s], d, m, scale, un, p, flag.wanted());
      const int64_t* chosen;
      const int64_t c = select_above_zero(p, d, k, scratch, chosen);
      return send(chosen, c);
    }
    const int64_t c = dgc_compensate_select(u[s], v[s], g[s], d, m, scale, thr, un, p, sel, sel_p, sel_u,
                                            flag.wanted());
    // (outputs masked by the pass: the cut ones put back, values and indices in order)
    if (c > k) pick_largest(scratch, c, k, [&](int64_t j) { return std::fabs(sel_p[j]); });
    // (pointers in locals: through the thread's scratch, each store made the loop find its
    // thread-local storage again)
    const int64_t* const picked = pick.data();
    float* const sent = values[s];
    void* const sent_idx = idx[s];
    const int idx_type = idx_types[s];
    int64_t q = 0;
    for (int64_t j = 0; j < c; ++j) {
      if (c <= k || (q < k && picked[q] == j)) {
        sent[q] = sel_p[j];
        write_index(sent_idx, idx_type, q++, sel[j]);
      } else {
        un[sel[j]] = sel_u[j];
        p[sel[j]] = sel_p[j];
      }
    }
    counts[s] = q;
  };
  for_segments(count, n, [&](int64_t s) { step(s, dgc_scratch()); });
  return 0;
}

// DGC's selection of one tensor's p (DGC.select): the threshold, the need-th largest |p| of S
// elements drawn at floor(u_j * d) (u_j: the uniform draws of the seed words (s0, s1); the product
// in float32) or of every element where S = d; the elements with |p| >= threshold, ascending, cut
// to the k largest |p| of them (ties to the lowest index) where more. Their indices into idx (int64,
// room for k), their count; -1 on bad arguments.
API int64_t grace_cpu_dgc_select(const float* p, int64_t d, int64_t S, int64_t need, int64_t k, uint32_t s0,
                                 uint32_t s1, int64_t* idx) {
  if (d < 0 || (d > 0 && !(1 <= need && need <= S && S <= d && 1 <= k && k <= d))) return -1;
  if (d == 0) return 0;
  const int64_t* chosen;
  const int64_t c = select_sampled(p, d, S, need, k, s0, s1, dgc_scratch(), chosen);
  std::copy(chosen, chosen + c, idx);
  return c;
}

// DGC's selection of every segment of a bucket from its compensated p (grace_cpu_dgc_compensate's):
// each segment's ks[s] largest |p| (grace_cpu_topk: ties to the lowest index, ascending), p sent
// where |p| >= cut[s] and +0.0 under it, and momentum factor masking where sent, as DGCMemory.update
// makes it from the decompressed payload: p = p - (0 + value) over p, u = u * 0 where 0 + value != 0.
// The flag (where given): whether any p is an inf or a NaN. Returns -1 (nothing written) on bad
// arguments.
API int grace_cpu_dgc_select_segments(float* p, float* u, int64_t segments, const int64_t* starts,
                                      const int64_t* numels, const int64_t* ks, const float* cut, float* values,
                                      int64_t* idx, void* flag, int flag_width, uint8_t* frame, const int64_t* slots,
                                      int64_t pairs, int64_t zero_from, int64_t frame_size) {
  if (segments < 0) return -1;
  int64_t total = 0;
  for (int64_t s = 0; s < segments; ++s) {
    if (numels[s] < 0 || starts[s] < 0 || ks[s] < 0 || ks[s] > numels[s]) return -1;
    total += ks[s];
  }
  if (frame && total != pairs) return -1;
  std::vector<float> frame_values(frame ? total : 0);
  std::vector<int64_t> frame_idx(frame ? total : 0);
  if (frame) {  // (the pairs made here, then written into the frame)
    values = frame_values.data();
    idx = frame_idx.data();
  }
  bool bad = false;
  for (int64_t s = 0, at = 0; s < segments; at += ks[s++]) {
    float* ps = p + starts[s];
    float* us = u + starts[s];
    for (int64_t i = 0; i < numels[s]; ++i) bad |= !std::isfinite(ps[i]);
    if (grace_cpu_topk(ps, GRACE_F32, numels[s], ks[s], 1, idx + at, GRACE_I64, values + at) != ks[s]) return -1;
    for (int64_t j = at; j < at + ks[s]; ++j) {
      const int64_t i = idx[j];
      const float x = ps[i], v = std::fabs(x) >= cut[s] ? x : 0.0f, sent = 0.0f + v;
      values[j] = v;
      ps[i] = x - sent;
      if (sent != 0.0f) us[i] = us[i] * 0.0f;
    }
  }
  if (flag) write_flag(flag, flag_width, bad);
  if (frame) grace_cpu_pairs_into_frame(values, idx, pairs, slots, frame, zero_from, frame_size);
  return 0;
}

// DGC's cut of every segment of a bucket (grace_native.h): each sample's key the bits of its |p|
// (NaN above inf), the need[s]-th largest of them by nth_element.
API int grace_cpu_dgc_cut_segments(const float* p, int64_t n, int64_t segments, const int64_t* starts,
                                   const int64_t* numels, const int64_t* sizes, const int64_t* needs,
                                   const uint32_t* s0, const uint32_t* s1, float* cut) {
  if (n < 0 || segments < 0) return -1;
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 1 || starts[s] < 0 || starts[s] + numels[s] > n || sizes[s] < 1 || sizes[s] > numels[s] ||
        needs[s] < 1 || needs[s] > sizes[s])
      return -1;
  std::vector<uint32_t> keys;
  std::vector<float> u;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t d = numels[s], count = sizes[s];
    const bool drawn = count < d;
    keys.resize(count);
    if (drawn) {
      u.resize(count);
      uniform_range(0, count, s0[s], s1[s], u.data());
    }
    for (int64_t j = 0; j < count; ++j) {
      // a drawn place: floor(u d) in float32, as the tensor ops round it (past the bucket: its last)
      const int64_t i = drawn ? std::min<int64_t>(starts[s] + (int64_t)std::floor(u[j] * (float)d), n - 1)
                              : starts[s] + j;
      uint32_t bits;
      std::memcpy(&bits, p + i, 4);
      keys[j] = bits & 0x7fffffffu;
    }
    std::nth_element(keys.begin(), keys.begin() + (needs[s] - 1), keys.end(), std::greater<uint32_t>());
    const uint32_t chosen = keys[needs[s] - 1];
    std::memcpy(cut + s, &chosen, 4);
  }
  return 0;
}
