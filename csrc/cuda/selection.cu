// grace CUDA kernels: selection (top-k, threshold, nonzero) and its error-feedback steps (see
// common.cuh)
#include "select.cuh"

namespace {
// A pass of the radix select over one tensor's keys; the last block to finish narrows the state
// (find). The first pass starts the state at (0, 0, need) there: it reads none before.
template <class Key>
__global__ void k_hist_find(Key key, int64_t n, SelState* st, long long need, bool first, int shift, int nbins,
                            unsigned long long* h, unsigned* ticket) {
  const SelState start{0u, 0u, need};
  hist(key, n, first ? &start : st, shift, nbins, h, blockIdx.x, gridDim.x);
  narrow_if_last(ticket, gridDim.x, h, nbins, shift, st, first ? &start : nullptr);
}

struct ThresholdPredF {
  const float* x;
  float thr;
  int by_abs;
  __device__ void operator()(int64_t i, const SelState&, bool& gt, bool& eq) const {
    float v = x[i];
    gt = (by_abs ? fabsf(v) : v) >= thr;
    eq = false;
  }
};

struct MaskPred {
  const uint8_t* mask;
  __device__ void operator()(int64_t i, const SelState&, bool& gt, bool& eq) const {
    gt = mask[i] != 0;
    eq = false;
  }
};

// each tile's counts; the last block to finish scans them into the tiles' offsets
template <class Pred>
__global__ void k_count_scan(Pred pred, int64_t n, const SelState* st_, long long* cnt_gt, long long* cnt_eq,
                             long long* totals, unsigned* ticket) {
  count(pred, n, st_, cnt_gt, cnt_eq, blockIdx.x);
  if (last_of(ticket, gridDim.x)) scan2<kThreads>(cnt_gt, cnt_eq, tiles_of(n), totals);
}

template <class Pred, class Emit>
__global__ void k_write(Pred pred, int64_t n, const SelState* st_, const long long* off_gt, const long long* off_eq,
                        Emit emit) {
  write(pred, n, st_, off_gt, off_eq, emit, blockIdx.x);
}

__global__ void k_compensate(const float* g, const float* r, int64_t n, float beta, float gamma, int flags,
                             float* p) {
  compensate(g, r, n, beta, gamma, flags, p, blockIdx.x, gridDim.x);
}

__global__ void k_take_all(int64_t n, EmitIdx emit) {
  GRID_STRIDE(i, n) emit(i, i);
}

// Ordered compaction by `pred`; st_dev must be valid, `ticket` zero. Returns 0, or < 0 on a CUDA
// error. If total_host is not NULL, the number written is copied there (synchronizing the stream).
template <class Pred, class Emit>
int compact(Pred pred, int64_t n, const SelState* st_dev, unsigned* ticket, const Emit& emit,
            long long* total_host, cudaStream_t s) {
  const int64_t tiles = tiles_of(n);
  Scratch sc(align256(4 * tiles * sizeof(long long)) + 256, s);
  if (!sc.p) return -3;
  long long* cg = sc.at<long long>(0);
  long long* ce = cg + tiles;
  long long* totals = sc.at<long long>(align256(4 * tiles * sizeof(long long)));
  k_count_scan<<<(unsigned)tiles, kThreads, 0, s>>>(pred, n, st_dev, cg, ce, totals, ticket);
  k_write<<<(unsigned)tiles, kThreads, 0, s>>>(pred, n, st_dev, cg, ce, emit);
  if (total_host) {
    long long t[2];
    cudaMemcpyAsync(t, totals, sizeof(t), cudaMemcpyDeviceToHost, s);
    if (cudaStreamSynchronize(s) != cudaSuccess) return -2;
    *total_host = t[0];
  }
  return status();
}

// Radix select (11 + 11 + 10 bits) of the k largest keys, then the ordered compaction: one
// memset of the tickets (a pass's each, the counts') and the three histograms.
template <class Key>
int topk_run(Key key, int64_t n, int64_t k, const EmitIdx& emit, cudaStream_t s) {
  const size_t tickets_bytes = 256, hist_bytes = 3 * 2048 * sizeof(unsigned long long);
  Scratch sc(tickets_bytes + hist_bytes + 256, s);
  if (!sc.p) return -3;
  unsigned* tickets = sc.at<unsigned>(0);
  unsigned long long* hist = sc.at<unsigned long long>(tickets_bytes);
  SelState* st = sc.at<SelState>(tickets_bytes + hist_bytes);
  cudaMemsetAsync(tickets, 0, tickets_bytes + hist_bytes, s);
  const int shifts[3] = {21, 10, 0}, bins[3] = {2048, 2048, 1024};
  const int grid = grid_for(n, kThreads * 16, 2048);
  for (int d = 0; d < 3; ++d)
    k_hist_find<<<grid, kThreads, 0, s>>>(key, n, st, k, d == 0, shifts[d], bins[d], hist + d * 2048, tickets + d);
  return compact(TopkPred<Key>{key}, n, st, tickets + 3, emit, nullptr, s);
}

// a threshold's state (no ties: need = 0, all zero) and the compaction's ticket, by one memset
int threshold_state(SelState** st, unsigned** ticket, Scratch& sc, cudaStream_t s) {
  *ticket = sc.at<unsigned>(0);
  *st = sc.at<SelState>(128);
  cudaMemsetAsync(sc.p, 0, 256, s);
  return status();
}
}  // namespace
API int64_t grace_cuda_topk(const void* x, int val_type, int64_t n, int64_t k, int by_abs, void* idx, int idx_type,
                            void* values, void* stream) {
  if (val_type != GRACE_F32 || idx_type < 0 || idx_type > 3 || n < 0) return -1;
  cudaStream_t s = as_stream(stream);
  const float* xf = static_cast<const float*>(x);
  EmitIdx emit{idx, idx_type, xf, static_cast<float*>(values), nullptr};
  if (k <= 0 || n == 0) return 0;
  if (k >= n) {
    k_take_all<<<grid_for(n), kThreads, 0, s>>>(n, emit);
    int st = status();
    return st ? st : n;
  }
  int st = by_abs ? topk_run(KeyAbs{xf}, n, k, emit, s) : topk_run(KeySigned{xf}, n, k, emit, s);
  return st ? st : k;
}

API int64_t grace_cuda_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma,
                               int flags, float* values, void* idx, int idx_type, float* new_r, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  cudaStream_t s = as_stream(stream);
  if (n == 0) return 0;
  k_compensate<<<grid_for(n), kThreads, 0, s>>>(g, r, n, beta, gamma, flags, new_r);
  if (k <= 0) return status();
  EmitIdx emit{idx, idx_type, new_r, values, new_r};
  if (k >= n) {
    k_take_all<<<grid_for(n), kThreads, 0, s>>>(n, emit);
    int st = status();
    return st ? st : n;
  }
  int st = topk_run(KeyAbs{new_r}, n, k, emit, s);
  return st ? st : k;
}

namespace {
// The elements `pred` keeps, written by `emit` in ascending order: their count, read back (or, where
// not `counted`, 0: no wait), or an error code
template <class Pred, class Emit>
int64_t compact_kept(const Pred& pred, int64_t n, const Emit& emit, void* stream, bool counted = true) {
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  Scratch sc(256, s);
  if (!sc.p) return -3;
  SelState* st;
  unsigned* ticket;
  threshold_state(&st, &ticket, sc, s);
  long long total = 0;
  int rc = compact(pred, n, st, ticket, emit, counted ? &total : nullptr, s);
  return rc ? rc : total;
}
}  // namespace

API int64_t grace_cuda_threshold(const void* x, int val_type, int64_t n, double thr, int by_abs, void* idx,
                                 int idx_type, void* values, void* stream) {
  if (val_type != GRACE_F32 || idx_type < 0 || idx_type > 3 || n < 0) return -1;
  const float* xf = static_cast<const float*>(x);
  return compact_kept(ThresholdPredF{xf, (float)thr, by_abs}, n,
                      EmitIdx{idx, idx_type, xf, static_cast<float*>(values), nullptr}, stream);
}

API int64_t grace_cuda_nonzero(const uint8_t* mask, int64_t n, void* idx, int idx_type, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  return compact_kept(MaskPred{mask}, n, EmitIdx{idx, idx_type, nullptr, nullptr, nullptr}, stream);
}

API int64_t grace_cuda_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                                    int flags, float* values, void* idx, int idx_type, float* new_r, void* stream) {
  if (idx_type < 0 || idx_type > 3 || n < 0) return -1;
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  k_compensate<<<grid_for(n), kThreads, 0, s>>>(g, r, n, beta, gamma, flags, new_r);
  Scratch sc(256, s);
  if (!sc.p) return -3;
  SelState* st;
  unsigned* ticket;
  threshold_state(&st, &ticket, sc, s);
  EmitIdx emit{idx, idx_type, new_r, values, new_r};
  long long total = 0;
  int rc = compact(ThresholdPredF{new_r, thr, 1}, n, st, ticket, emit, &total, s);
  return rc ? rc : total;
}

namespace {
// the segment of element i: the last s whose start (a prefix sum of the sizes) is <= i
__device__ __forceinline__ int64_t segment_of(const int64_t* starts, int64_t segments, int64_t i) {
  int64_t lo = 0, hi = segments;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (__ldg(starts + mid) <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// One pass over the bucket, a warp on 32 elements in a row: p, the mask, the counts (the lanes
// of one segment add theirs by one integer atomic: the same counts in any order) and whether a g
// is non-finite; the last block to finish writes the counts, the header and the flag.
__global__ void k_threshold_select(Compensated c, int64_t n, const int64_t* starts, int64_t segments, float thr,
                                   float* p, uint8_t* take, unsigned long long* tally, unsigned* state,
                                   int64_t* counts, int64_t* header, void* flag, int flag_width) {
  bool bad = false;
  WARP_STRIDE(base, n) {
    const int64_t i = base + (threadIdx.x & 31);
    bool t = false;
    int64_t s = -1;
    if (i < n) {
      const float v = c[i];
      p[i] = v;
      t = fabsf(v) >= thr;
      take[i] = t;
      bad |= !isfinite(c.g[i]);
      s = segment_of(starts, segments, i);
    }
    const unsigned same = __match_any_sync(kFull, s), taken = __ballot_sync(kFull, t);
    if (s >= 0 && (threadIdx.x & 31) == __ffs(same) - 1 && (same & taken))
      atomicAdd(tally + s, (unsigned long long)__popc(same & taken));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(state, 1u);
  if (!last_of(state + 1, gridDim.x)) return;
  const bool nonfinite = __ldcg(state) != 0;
  for (int64_t s = threadIdx.x; s < segments; s += blockDim.x) {
    const int64_t k = (int64_t)__ldcg(tally + s);
    counts[s] = header[2 * s] = k;
    header[2 * s + 1] = k | (flag && nonfinite && s == segments - 1 ? int64_t(1) << GRACE_FLAG_SHIFT : 0);
  }
  if (flag && threadIdx.x == 0) write_flag(flag, flag_width, nonfinite);
}
}  // namespace

API int grace_cuda_threshold_select_segments(const float* g, const float* r, int64_t n, const int64_t* starts,
                                             int64_t segments, float thr, float beta, float gamma, int flags, float* p,
                                             uint8_t* take, int64_t* counts, int64_t* header, void* flag,
                                             int flag_width, void* stream) {
  if (n < 0 || segments < 1) return -1;
  cudaStream_t s = as_stream(stream);
  const size_t tally = align256(8 * (size_t)segments);
  Scratch sc(tally + 8, s);
  if (!sc.p) return -3;
  cudaMemsetAsync(sc.p, 0, tally + 8, s);  // the counts, the non-finite bit, the ticket
  k_threshold_select<<<grid_for(std::max<int64_t>(n, 1)), kThreads, 0, s>>>(
      Compensated{g, r, beta, gamma, flags}, n, starts, segments, thr, p, take, sc.at<unsigned long long>(0),
      sc.at<unsigned>(tally), counts, header, flag, flag_width);
  return status();
}

namespace {
// A threshold's pair written into its rank's frame where the segment's row of `table` lays it
// (GRACE_PAIR_COLUMNS, grace_native.h; byte stores: pieces need not be aligned), and the new
// residual over p in its place: p - (0 + p).
struct EmitFrame {
  float* p;
  uint8_t* frame;
  const int64_t* table;
  int64_t segments;
  __device__ void operator()(int64_t pos, int64_t i) const {
    const int64_t* t = pair_row(table, segments, pos);
    const int64_t j = pos - t[2], local = i - t[4];
    const float v = p[i];
    const uint32_t bits = __float_as_uint(v);
    for (int b = 0; b < 4; ++b) frame[t[0] + 4 * j + b] = (uint8_t)(bits >> (8 * b));
    for (int b = 0; b < (int)t[5]; ++b) frame[t[1] + t[5] * j + b] = (uint8_t)(local >> (8 * b));
    p[i] = __fsub_rn(v, __fadd_rn(0.0f, v));
  }
};

// the frame's end: the flag byte (where given) at `tail`, then zeros
__global__ void k_frame_tail(uint8_t* frame, int64_t tail, int64_t size, const uint8_t* flag) {
  for (int64_t b = tail + threadIdx.x; b < size; b += blockDim.x) frame[b] = b == tail && flag ? *flag : 0;
}
}  // namespace

API int grace_cuda_threshold_write_segments(float* p, const uint8_t* take, int64_t n, const int64_t* table,
                                            int64_t segments, uint8_t* frame, int64_t frame_size, int64_t tail,
                                            const uint8_t* flag, void* stream) {
  if (n < 0 || segments < 1 || tail < 0 || tail > frame_size) return -1;
  const int64_t rc = compact_kept(MaskPred{take}, n, EmitFrame{p, frame, table, segments}, stream, false);
  if (rc < 0) return (int)rc;
  if (frame_size > tail) k_frame_tail<<<1, kThreads, 0, as_stream(stream)>>>(frame, tail, frame_size, flag);
  return status();
}
