// grace CUDA kernels: selection's device code (radix select, ordered compaction, compensation), run
// by selection.cu and segments.cu (see common.cuh)
#pragma once
#include "common.cuh"

namespace {
// ---- selection ----------------------------------------------------------------------------------
// Keys: unsigned, order-preserving. Elements are selected by key > T, plus the first `need`
// (in index order) with key == T; an ordered compaction writes them at
// pos = (# selected-by-gt before) + min(# eq before, need).
struct SelState {
  uint32_t prefix;      // key bits fixed so far (topk), or the threshold key
  uint32_t mask;        // which bits of prefix are fixed
  long long need;       // how many elements with key == prefix to take
};

struct KeyAbs {
  const float* x;
  __device__ uint32_t operator()(int64_t i) const { return __float_as_uint(x[i]) & 0x7fffffffu; }
};
struct KeySigned {
  const float* x;
  __device__ uint32_t operator()(int64_t i) const {
    uint32_t u = __float_as_uint(x[i]);
    return (u >> 31) ? ~u : (u | 0x80000000u);
  }
};

template <class Key>
__device__ inline void hist(Key key, int64_t n, const SelState* st, int shift, int nbins, unsigned long long* hist,
                            int64_t block, int64_t nblocks) {
  __shared__ unsigned sh[2048];
  for (int j = threadIdx.x; j < nbins; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix, mask = st->mask;
  const int lane = threadIdx.x & 31;
  // shared-memory atomics, except where the whole warp falls in one bin (runs of zeros, or
  // the later passes where most keys match no prefix): one add for the warp. Aggregating
  // every warp with __match_any_sync costs more than the collisions it saves (H200).
  BLOCK_WARP_STRIDE(base, n, block, nblocks) {
    int64_t i = base + lane;
    int bin = nbins;  // none
    if (i < n) {
      uint32_t k = key(i);
      if ((k & mask) == prefix) bin = (int)((k >> shift) & (nbins - 1));
    }
    if (__all_sync(kFull, bin == __shfl_sync(kFull, bin, 0))) {
      if (lane == 0 && bin < nbins) atomicAdd(&sh[bin], 32u);
    } else if (bin < nbins) {
      atomicAdd(&sh[bin], 1u);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < nbins; j += blockDim.x)
    if (sh[j]) atomicAdd(&hist[j], (unsigned long long)sh[j]);
}

// one warp: the bin (from the top) where the count reaches `need`; narrow the state to it
__device__ inline void find(const unsigned long long* hist, int nbins, int shift, SelState* st) {
  const int lane = threadIdx.x;
  const int per = nbins / 32;
  long long s = 0;
  for (int j = 0; j < per; ++j) s += (long long)__ldcg(&hist[nbins - lane * per - 1 - j]);  // (L2: other blocks' adds)
  long long incl = s;
  for (int o = 1; o < 32; o <<= 1) {
    long long t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  const long long excl = incl - s;
  const long long need = st->need;
  unsigned ball = __ballot_sync(kFull, excl < need && need <= incl);
  int L = __ffs(ball) - 1;
  if (L < 0) L = 31;  // cannot happen with 1 <= need <= count; keep the state sane
  if (lane == L) {
    long long acc = excl;
    int b = nbins - L * per - 1;
    for (; b > nbins - (L + 1) * per; --b) {
      long long h = (long long)__ldcg(&hist[b]);
      if (acc + h >= need) break;
      acc += h;
    }
    st->need = need - acc;
    st->prefix |= (uint32_t)b << shift;
    st->mask |= (uint32_t)(nbins - 1) << shift;
  }
}

// Whether this block is the last of its segment's `blocks` to finish, by a ticket each taken
// after a fence that publishes the block's writes: that block then reads what all of them
// wrote (through L2, __ldcg), so a reduction and the step that needs its total share a launch.
__device__ inline bool last_of(unsigned* tickets, int64_t blocks) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(tickets, 1u) == (unsigned)(blocks - 1);
  __syncthreads();
  return last;
}

// A histogram pass's end: the last of its `blocks` to finish narrows the state (find); where the
// pass was the first, it starts the state there first (at `start`: the pass read no state before).
__device__ inline void narrow_if_last(unsigned* ticket, int64_t blocks, const unsigned long long* h, int nbins,
                                      int shift, SelState* st, const SelState* start = nullptr) {
  if (!last_of(ticket, blocks)) return;
  if (start && threadIdx.x == 0) *st = *start;
  __syncthreads();
  if (threadIdx.x < 32) find(h, nbins, shift, st);
}

constexpr int kItems = 16;
constexpr int64_t kTile = (int64_t)kThreads * kItems;

__host__ __device__ inline int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// The predicate of the compaction: gt(i) (always taken) and eq(i) (taken while rank < need).
template <class Key>
struct TopkPred {
  Key key;
  __device__ void operator()(int64_t i, const SelState& st, bool& gt, bool& eq) const {
    uint32_t k = key(i);
    gt = k > st.prefix;
    eq = k == st.prefix;
  }
};

// tile `tile`'s counts
template <class Pred>
__device__ inline void count(Pred pred, int64_t n, const SelState* st_, long long* cnt_gt, long long* cnt_eq,
                             int64_t tile) {
  __shared__ long long smem[32];
  const SelState st = *st_;
  const int64_t base = tile * kTile;
  long long gt_n = 0, eq_n = 0;
  for (int j = 0; j < kItems; ++j) {
    int64_t i = base + j * kThreads + threadIdx.x;
    if (i < n) {
      bool gt, eq;
      pred(i, st, gt, eq);
      gt_n += gt;
      eq_n += eq;
    }
  }
  gt_n = block_sum(gt_n, smem);
  eq_n = block_sum(eq_n, smem);
  if (threadIdx.x == 0) {
    cnt_gt[tile] = gt_n;
    cnt_eq[tile] = eq_n;
  }
}

// one block of kT threads: exclusive scans of both count arrays; totals[0..1] their sums
template <int kT>
__device__ inline void scan2(long long* a, long long* b, int64_t m, long long* totals) {
  __shared__ long long sa[kT], sb[kT];
  const int t = threadIdx.x;
  long long ca = 0, cb = 0;
  for (int64_t base = 0; base < m; base += kT) {
    int64_t i = base + t;
    long long va = i < m ? __ldcg(&a[i]) : 0, vb = i < m ? __ldcg(&b[i]) : 0;  // (L2: other blocks' counts)
    sa[t] = va;
    sb[t] = vb;
    __syncthreads();
    for (int o = 1; o < kT; o <<= 1) {
      long long ta = t >= o ? sa[t - o] : 0, tb = t >= o ? sb[t - o] : 0;
      __syncthreads();
      sa[t] += ta;
      sb[t] += tb;
      __syncthreads();
    }
    if (i < m) {
      a[i] = ca + sa[t] - va;
      b[i] = cb + sb[t] - vb;
    }
    ca += sa[kT - 1];
    cb += sb[kT - 1];
    __syncthreads();
  }
  if (t == 0) {
    totals[0] = ca;
    totals[1] = cb;
  }
}

// A fixed layout's frame that the selected pairs are written into, in place of values and indices
// (frame NULL: none): pair j's float32 value at byte slots[j], its index's low slots[2 * pairs + j]
// bytes (little-endian) at byte slots[pairs + j]; byte stores (pieces need not be aligned).
struct FramePairs {
  uint8_t* frame = nullptr;
  const int64_t* slots = nullptr;
  int64_t pairs = 0;
  __device__ void put(int64_t j, float v, int64_t i) const {
    const uint32_t bits = __float_as_uint(v);
    uint8_t* at = frame + slots[j];
    for (int b = 0; b < 4; ++b) at[b] = (uint8_t)(bits >> (8 * b));
    at = frame + slots[pairs + j];
    for (int b = 0; b < (int)slots[2 * pairs + j]; ++b) at[b] = (uint8_t)(i >> (8 * b));
  }
};

// Emit: what to write for a selected element i at output position pos.
struct EmitIdx {
  void* idx;
  int idx_type;
  const float* values_src;  // NULL: no values
  float* values;
  float* new_r;             // error feedback: new_r[i] = p - (0 + v) where sent
  float scale = 1.0f;       // v = p * scale (random-k's d / k; 1: p itself)
  int64_t base = 0;         // the index written: base + i
  FramePairs out = {};      // where given, the pair goes there (as pair first + pos), not to idx and values
  int64_t first = 0;
  __device__ void operator()(int64_t pos, int64_t i) const {
    const float p = values_src ? values_src[i] : 0.0f, v = scale == 1.0f ? p : __fmul_rn(p, scale);
    if (out.frame) {
      out.put(first + pos, v, base + i);
    } else {
      put_index(idx, idx_type, pos, base + i);
      if (values) values[pos] = v;
    }
    if (values_src && new_r) new_r[i] = __fsub_rn(p, __fadd_rn(0.0f, v));
  }
};

// Warp w of a block owns kItems rounds of 32 consecutive elements of the block's tile, so the
// block needs one synchronization (for the warps' counts); each warp keeps its ballots in
// registers and writes in order with its own running offsets.
template <class Pred, class Emit>
__device__ inline void write(Pred pred, int64_t n, const SelState* st_, const long long* off_gt,
                             const long long* off_eq, const Emit& emit, int64_t tile) {
  __shared__ int wg[kThreads / 32], we[kThreads / 32];
  const SelState st = *st_;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const unsigned lt = (1u << lane) - 1;
  const int64_t wbase = tile * kTile + (int64_t)w * kItems * 32;
  unsigned bg[kItems], be[kItems];
  int count_g = 0, count_e = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = wbase + j * 32 + lane;
    bool gt = false, eq = false;
    if (i < n) pred(i, st, gt, eq);
    bg[j] = __ballot_sync(kFull, gt);
    be[j] = __ballot_sync(kFull, eq);
    count_g += __popc(bg[j]);
    count_e += __popc(be[j]);
  }
  if (lane == 0) {
    wg[w] = count_g;
    we[w] = count_e;
  }
  __syncthreads();
  long long run_gt = off_gt[tile], run_eq = off_eq[tile];
  for (int v = 0; v < w; ++v) {
    run_gt += wg[v];
    run_eq += we[v];
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const long long rg = run_gt + __popc(bg[j] & lt), re = run_eq + __popc(be[j] & lt);
    const bool gt = bg[j] >> lane & 1, eq = be[j] >> lane & 1;
    if (gt || (eq && re < st.need)) emit(rg + (re < st.need ? re : st.need), wbase + j * 32 + lane);
    run_gt += __popc(bg[j]);
    run_eq += __popc(be[j]);
  }
}

__device__ inline void compensate(const float* g, const float* r, int64_t n, float beta, float gamma, int flags,
                                  float* p, int64_t block, int64_t nblocks) {
  const Compensated c{g, r, beta, gamma, flags};
  BLOCK_STRIDE(i, n, block, nblocks) p[i] = c[i];
}
}  // namespace
