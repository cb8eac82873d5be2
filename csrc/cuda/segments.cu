// grace CUDA kernels: a bucket's segments, one launch per kernel (see common.cuh)
#include "decoders.cuh"
#include "quantizers.cuh"
#include "select.cuh"
#include "signs.cuh"

#include <type_traits>
#include <vector>

namespace {
// ---- a bucket's segments, one launch per kernel ---------------------------------------------------
// A bucket's gradients lie one after another in a flat buffer. A batch of up to kSegBatch
// segments travels as a kernel argument (no copy to the device, no host wait). A launch's grid
// is the segments' blocks one after another, each segment as many as it needs (seg_grid), so
// a small segment beside a large one costs no empty blocks. The reductions give each segment
// the blocks its per-tensor kernel launches (the same blocks summing in the same order), so a
// segment's result is the per-tensor one bit for bit.
constexpr int kSegBatch = 64;
struct SegBatch {
  int count;               // segments in this batch
  int64_t n[kSegBatch];    // elements
  int64_t x[kSegBatch];    // first element in the flat input (and the flat decoded output)
  int64_t u[kSegBatch];    // first draw; the draws' kernels: the seed words s0 | s1 << 32
  int64_t p[kSegBatch];    // first byte of its packed codes (natural compression: of its sign bits)
  int64_t q[kSegBatch];    // first scalar (scale, means, norms); natural compression: first code
  int64_t r[kSegBatch];    // first slot of its partial sums in the scratch; random-k: its seed words
  float f[kSegBatch];      // random-k: the factor its values are sent times (d / k, or 1)
  int block0[kSegBatch + 1];  // this launch's blocks of segment k: [block0[k], block0[k + 1])
};

// the segment that block blockIdx.x works on, and the block's place among that segment's blocks
struct SegBlock {
  int s;
  int64_t block, blocks;
};

__device__ __forceinline__ SegBlock seg_block(const SegBatch& t) {
  const int b = blockIdx.x;
  int lo = 0, hi = t.count - 1;  // the last segment whose blocks start at or before b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.block0[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return {lo, b - t.block0[lo], t.block0[lo + 1] - t.block0[lo]};
}

__device__ __forceinline__ uint32_t hash32(uint32_t h) {  // grace/core/draws.py's hash32
  h ^= h >> 16;
  h *= 0x21F0AAADu;
  h ^= h >> 15;
  h *= 0x735A2D97u;
  return h ^ (h >> 15);
}

__device__ __forceinline__ uint32_t draw_hash(int64_t j, int64_t words) {
  return hash32(hash32((uint32_t)j ^ (uint32_t)words) ^ (uint32_t)(words >> 32));
}

// draw j of the seed words (s0 | s1 << 32) as a uniform float, made where it is used
struct Drawn {
  int64_t words;
  __device__ __forceinline__ float operator[](int64_t j) const { return (float)(draw_hash(j, words) >> 8) * 0x1p-24f; }
};

// counter-based draws: uniform floats, or the sort keys segment << 32 | hash (random indices)
__global__ void k_uniform_seg(SegBatch t, float* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  float* o = out + t.x[s];
  const Drawn u{t.u[s]};
  BLOCK_STRIDE(j, t.n[s], sb.block, sb.blocks) o[j] = u[j];
}

__global__ void k_hash_keys_seg(SegBatch t, int64_t first, int64_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  int64_t* o = out + t.x[s];
  const int64_t high = (first + s) << 32;
  BLOCK_STRIDE(j, t.n[s], sb.block, sb.blocks) o[j] = high | (int64_t)draw_hash(j, t.u[s]);
}

__global__ void k_maxabs_seg(SegBatch t, const float* x, unsigned* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  maxabs(x + t.x[s], t.n[s], out + t.q[s], sb.block, sb.blocks);
}

// the quantizers, each segment's draws made from its seed words (t.u) where they are used
__global__ void k_terngrad_seg(SegBatch t, const float* x, const float* scale, uint8_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  terngrad(x + t.x[s], Drawn{t.u[s]}, t.n[s], scale + t.q[s], out + t.p[s], sb.block, sb.blocks);
}

__global__ void k_natural_seg(SegBatch t, const float* x, uint8_t* signs, uint8_t* codes) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  natural(x + t.x[s], Drawn{t.u[s]}, t.n[s], signs + t.p[s], codes + t.q[s], sb.block, sb.blocks);
}

// QSGD's norms: rows of b <= 4096 a warp each; longer rows by chunks (partials from t.r[s]), then
// one block per row
__global__ void k_norms_seg(SegBatch t, const float* x, int64_t bucket, float* norms, float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
  if (b <= 4096) {
    norms_warp(x + t.x[s], n, b, rows, norms + t.q[s], sb.block, sb.blocks);
    return;
  }
  const int64_t cpr = row_chunks(b);
  for (int64_t v = sb.block; v < rows * cpr; v += sb.blocks) {
    norms_partial(x + t.x[s], n, b, cpr, partial + t.r[s], v);
    __syncthreads();  // (block_sum's shared memory, again)
  }
}

__global__ void k_norms_final_seg(SegBatch t, int64_t bucket, float* norms, const float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
  if (b <= 4096) return;
  for (int64_t r = sb.block; r < rows; r += sb.blocks) {
    norms_final(partial + t.r[s], row_chunks(b), norms + t.q[s], r);
    __syncthreads();
  }
}

__global__ void k_qsgd_seg(SegBatch t, const float* x, float flevels, int64_t bucket, int bits,
                           const float* norms, uint8_t* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], b = qsgd_row(n, bucket);
  qsgd(x + t.x[s], Drawn{t.u[s]}, n, flevels, b, bits, norms + t.q[s], out + t.p[s], sb.block, sb.blocks);
}

// the sign family's bits and scalars: each segment on red_grid(n) blocks, as alone
template <int S>
__global__ void k_sign_sums_seg(SegBatch t, const float* x, uint8_t* out, float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  sign_sums<S>(x + t.x[s], t.n[s], out + t.p[s], partial + t.r[s], sb.block, sb.blocks);
}

// ... of the compensated gradient, made as it is read (residual memory's step, segment by segment)
template <int S>
__global__ void k_sign_ef_sums_seg(SegBatch t, const float* g, const float* r, float beta, float gamma, int flags,
                                   uint8_t* out, float* partial) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const Compensated p{g + t.x[s], r + t.x[s], beta, gamma, flags};
  sign_sums<S>(p, t.n[s], out + t.p[s], partial + t.r[s], sb.block, sb.blocks);
}

// the new residual p - decode(bits, scalars), p made again as it was for the sums
template <int S>
// (the last batch's first block also writes the overflow flag, where asked: 1 where any of the
// bucket's `count` scalars is an inf or a NaN, as every inf and NaN of p makes its segment's)
__global__ void k_sign_residual_seg(SegBatch t, const float* g, const float* r, float beta, float gamma, int flags,
                                    const uint8_t* bits, const float* scalars, float* new_r, int64_t count,
                                    void* flag, int flag_width) {
  if (flag && blockIdx.x == 0) {
    int bad = 0;
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) bad |= !isfinite(scalars[j]);
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) write_flag(flag, flag_width, bad != 0);
  }
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const Compensated p{g + t.x[s], r + t.x[s], beta, gamma, flags};
  const uint8_t* b = bits + t.p[s];
  const float* q = scalars + t.q[s];
  float* o = new_r + t.x[s];
  BLOCK_STRIDE(i, t.n[s], sb.block, sb.blocks) {
    o[i] = __fsub_rn(p[i], S == 1 ? sign_value(b, q, i) : onebit_value(b, q, i));
  }
}

template <int S>
__global__ void k_sign_final_seg(SegBatch t, const float* partial, float* scalars) {
  const int s = blockIdx.x;
  sign_final<S>(partial + t.r[s], red_grid(t.n[s]), t.n[s], scalars + t.q[s]);
}

// Element i of a segment decoded (Method: 0 sign bits, b the scale or NULL (signSGD), 1 1-bit SGD,
// 2 TernGrad, 3 QSGD, 4 natural compression (b: its codes)); a and b: the segment's own fields,
// row: QSGD's row length
template <int Method>
__device__ __forceinline__ float decoded(const uint8_t* a, const void* b, float flevels, int64_t row, int bits,
                                         int64_t i) {
  const float* scalars = static_cast<const float*>(b);
  if constexpr (Method == 0) return sign_value(a, scalars, i);
  if constexpr (Method == 1) return onebit_value(a, scalars, i);
  if constexpr (Method == 2) return terngrad_value(a, scalars, i);
  if constexpr (Method == 3) return qsgd_value(a, flevels, row, bits, scalars, i);
  if constexpr (Method == 4) return natural_value(a, static_cast<const uint8_t*>(b), i);
}

// a segment's b field from item q on (natural compression's codes are bytes, the others' floats)
template <int Method>
__device__ __forceinline__ const void* field_at(const void* b, int64_t q) {
  if (!b) return nullptr;
  if constexpr (Method == 4) return static_cast<const uint8_t*>(b) + q;
  return static_cast<const float*>(b) + q;
}

// How an aggregate follows from the decoded sum (Compressor.finish): its sign where vote (a majority
// vote), then times 1 / d for each divisor d in turn, as torch divides by a number on a GPU (a * (1 / d),
// 1 / d rounded to float first)
struct Finish {
  int vote, count;
  float r[4];
  __device__ __forceinline__ float operator()(float a) const {
    if (vote) a = a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : a);  // (torch's sign but at -0 and NaN: no sum of +-1)
    for (int d = 0; d < count; ++d) a = __fmul_rn(a, r[d]);
    return a;
  }
};

// every segment's aggregate over `ranks` ranks: rank r's fields at a + r * a_rank bytes and at
// item r * b_rank of b, decoded and added rank after rank, then finished; NaN everywhere where
// *overflow > 0 (the ranks that flagged an inf or a NaN; NULL: none counted)
template <int Method>
__global__ void k_mean_seg(SegBatch t, int ranks, const uint8_t* a, int64_t a_rank, const void* b, int64_t b_rank,
                           float flevels, int64_t bucket, int bits, Finish finish, const int64_t* overflow,
                           float* out) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t n = t.n[s], row = qsgd_row(n, bucket);
  const bool poisoned = overflow && *overflow > 0;
  float* o = out + t.x[s];
  BLOCK_STRIDE(i, n, sb.block, sb.blocks) {
    float acc = 0.0f;
    for (int r = 0; r < ranks; ++r) {
      const float v = decoded<Method>(a + r * a_rank + t.p[s], field_at<Method>(b, r * b_rank + t.q[s]), flevels,
                                      row, bits, i);
      acc = r ? __fadd_rn(acc, v) : v;
    }
    o[i] = poisoned ? __uint_as_float(0x7fc00000u) : finish(acc);
  }
}

// A selection with error feedback of every segment: t.u holds its k, t.p its first value and
// index, t.q its first compaction tile; selection state s and histogram s per segment. What it
// ranks by is `By`'s: top-k's |p| (grace_cuda_topk_ef), or random-k's draws (the k smallest
// hashes of draws 0 .. n - 1 of the seed words t.r[s], ties to the lowest index, as one stable
// sort by (segment, hash) takes them), sent times t.f[s] at indices in the bucket.
__host__ __device__ __forceinline__ bool selects(const SegBatch& t, int s) { return t.u[s] > 0 && t.u[s] < t.n[s]; }

constexpr int kHistBins = 2048;

// The selection's launches share their reductions' last steps: each segment's last block of a
// histogram pass narrows its state (find), and its last block of the tile counts scans them
// (last_of, one ticket counter per segment and launch: `tickets`, zeroed with the histograms).
constexpr int kTicketSets = 4;  // the three passes, the counts

// g's inf or NaN told to `bad` (where given): the overflow flag made in the pass that reads g
__device__ __forceinline__ void tell_nonfinite(float g, unsigned* bad) {
  if (bad && !isfinite(g)) atomicOr(bad, 1u);
}

// |p|'s key, p = compensate(g, r) written to p on the way: the first pass reads each element once
struct KeyAbsCompensated {
  Compensated c;
  float* p;
  unsigned* bad;
  __device__ __forceinline__ uint32_t operator()(int64_t i) const {
    const float v = c[i];
    p[i] = v;
    tell_nonfinite(c.g[i], bad);
    return __float_as_uint(v) & 0x7fffffffu;
  }
};

// a draw's key: the smallest hashes rank first
struct KeyDrawn {
  int64_t words;
  __device__ __forceinline__ uint32_t operator()(int64_t i) const { return ~draw_hash(i, words); }
};

// `key`, with p = compensate(g, r) written on the way (keys that do not read p)
template <class Key>
struct Compensating {
  Compensated c;
  float* p;
  unsigned* bad;
  Key key;
  __device__ __forceinline__ uint32_t operator()(int64_t i) const {
    p[i] = c[i];
    tell_nonfinite(c.g[i], bad);
    return key(i);
  }
};

struct ByMagnitude {
  static constexpr bool kInBucket = false;  // indices within their segment
  __device__ static KeyAbs key(const SegBatch& t, int s, const float* p) { return KeyAbs{p + t.x[s]}; }
  __device__ static KeyAbsCompensated first(const SegBatch& t, int s, const Compensated& c, float* p, unsigned* bad) {
    return KeyAbsCompensated{c, p + t.x[s], bad};
  }
};

struct ByDraws {
  static constexpr bool kInBucket = true;  // indices in the bucket
  __device__ static KeyDrawn key(const SegBatch& t, int s, const float*) { return KeyDrawn{t.r[s]}; }
  __device__ static Compensating<KeyDrawn> first(const SegBatch& t, int s, const Compensated& c, float* p,
                                                  unsigned* bad) {
    return Compensating<KeyDrawn>{c, p + t.x[s], bad, KeyDrawn{t.r[s]}};
  }
};

// p = compensate(g, r) of every segment (g's infs and NaNs told to `bad`, where given) and, for
// those that select, the first pass: the state starts at (prefix 0, mask 0, need k), so the pass
// needs no state read
template <class By>
__global__ void k_compensate_hist_seg(SegBatch t, const float* g, const float* r, float beta, float gamma, int flags,
                                      float* p, SelState* st, int shift, int nbins, unsigned long long* h,
                                      unsigned* tickets, unsigned* bad) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  const int64_t o = t.x[s];
  const Compensated c{g + o, r + o, beta, gamma, flags};
  if (!selects(t, s)) {
    BLOCK_STRIDE(i, t.n[s], sb.block, sb.blocks) {
      p[o + i] = c[i];
      tell_nonfinite(c.g[i], bad);
    }
    return;
  }
  const SelState start{0u, 0u, (long long)t.u[s]};
  hist(By::first(t, s, c, p, bad), t.n[s], &start, shift, nbins, h + (int64_t)s * kHistBins, sb.block, sb.blocks);
  narrow_if_last(tickets + s, sb.blocks, h + (int64_t)s * kHistBins, nbins, shift, st + s, &start);
}

template <class By>
__global__ void k_select_hist_seg(SegBatch t, const float* p, SelState* st, int shift, int nbins,
                                  unsigned long long* h, unsigned* tickets) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  if (!selects(t, s)) return;
  hist(By::key(t, s, p), t.n[s], st + s, shift, nbins, h + (int64_t)s * kHistBins, sb.block, sb.blocks);
  narrow_if_last(tickets + s, sb.blocks, h + (int64_t)s * kHistBins, nbins, shift, st + s);
}

// each tile's counts; a segment's last block scans them into the tiles' offsets
template <class By>
__global__ void k_select_count_seg(SegBatch t, const float* p, const SelState* st, long long* cg, long long* ce,
                                   long long* totals, unsigned* tickets) {
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  if (!selects(t, s)) return;
  using Key = decltype(By::key(t, s, p));
  count(TopkPred<Key>{By::key(t, s, p)}, t.n[s], st + s, cg + t.q[s], ce + t.q[s], sb.block);
  if (last_of(tickets + s, sb.blocks)) scan2<kThreads>(cg + t.q[s], ce + t.q[s], tiles_of(t.n[s]), totals + 2 * s);
}

// DGC's pair: p sent where |p| >= the segment's cut, +0.0 under it; momentum factor masking where
// sent (p = p - (0 + value) over p, u = u * 0 where 0 + value != 0), as DGCMemory.update
struct EmitCut {
  int64_t* idx;
  float* values;
  float* p;
  float* u;
  float cut;
  FramePairs out;  // where given, the pair goes there (as pair first + pos)
  int64_t first;
  __device__ void operator()(int64_t pos, int64_t i) const {
    const float x = p[i], v = fabsf(x) >= cut ? x : 0.0f, sent = __fadd_rn(0.0f, v);
    if (out.frame) {
      out.put(first + pos, v, i);
    } else {
      idx[pos] = i;
      values[pos] = v;
    }
    p[i] = __fsub_rn(x, sent);
    if (sent != 0.0f) u[i] = __fmul_rn(u[i], 0.0f);
  }
};

template <class By, class Emit>
__device__ void write_seg(const SegBatch& t, const SegBlock& sb, const float* p, const SelState* st,
                          const long long* cg, const long long* ce, const Emit& emit) {
  const int s = sb.s;
  const int64_t n = t.n[s], k = t.u[s];
  if (k >= n) {  // every element (k_take_all)
    BLOCK_STRIDE(i, n, sb.block, sb.blocks) emit(i, i);
    return;
  }
  if (k <= 0) return;
  using Key = decltype(By::key(t, s, p));
  write(TopkPred<Key>{By::key(t, s, p)}, n, st + s, cg + t.q[s], ce + t.q[s], emit, sb.block);
}

// A frame's bytes past its pairs that the last batch's first block zeroes: [zero_from, size)
struct FrameTail {
  uint8_t* frame = nullptr;
  int64_t zero_from = 0, size = 0;
};

// the selected written (by EmitIdx, or where `cut` is given (this batch's segments' cuts), by
// EmitCut; into the frame where out.frame is given); the last batch's first block also writes the
// overflow flag, where asked, and the frame's tail (its flag byte is `flag`, then zeros)
template <class By>
__global__ void k_select_write_seg(SegBatch t, float* p, const SelState* st, const long long* cg, const long long* ce,
                                   int64_t* idx, float* values, const unsigned* bad, void* flag, int flag_width,
                                   const float* cut, float* u, FramePairs out, FrameTail tail) {
  if (flag && blockIdx.x == 0 && threadIdx.x == 0) write_flag(flag, flag_width, *bad != 0);
  if (tail.frame && blockIdx.x == 0)
    for (int64_t b = tail.zero_from + threadIdx.x; b < tail.size; b += blockDim.x) tail.frame[b] = 0;
  const SegBlock sb = seg_block(t);
  const int s = sb.s;
  if (cut) {
    write_seg<By>(t, sb, p, st, cg, ce,
                  EmitCut{idx + t.p[s], values + t.p[s], p + t.x[s], u + t.x[s], cut[s], out, t.p[s]});
    return;
  }
  write_seg<By>(t, sb, p, st, cg, ce,
                EmitIdx{idx + t.p[s], GRACE_I64, p + t.x[s], values + t.p[s], p + t.x[s], t.f[s],
                        By::kInBucket ? t.x[s] : 0, out, t.p[s]});
}

// Runs launch(batch, its first segment) on each batch of up to kSegBatch segments, fill(batch,
// k, segment) setting batch slot k; each launch's grid: seg_grid(batch, blocks of slot k).
template <class Fill, class Launch>
int for_batches(int64_t segments, Fill fill, Launch launch) {
  if (segments < 0) return -1;
  for (int64_t first = 0; first < segments; first += kSegBatch) {
    SegBatch t;
    std::memset(&t, 0, sizeof(t));
    t.count = (int)std::min<int64_t>(kSegBatch, segments - first);
    for (int k = 0; k < t.count; ++k) fill(t, k, first + k);
    const int rc = launch(t, first);
    if (rc != 0) return rc;
  }
  return status();
}

// a launch's grid: slot k's blocks(k) blocks (at least 1, at most 2^16) after the slots before
// it, recorded in t.block0 for seg_block
template <class Blocks>
dim3 seg_grid(SegBatch& t, Blocks blocks) {
  int at = 0;
  for (int k = 0; k < t.count; ++k) {
    t.block0[k] = at;
    at += (int)std::max<int64_t>(1, std::min<int64_t>(blocks(k), 1 << 16));
  }
  t.block0[t.count] = at;
  return dim3((unsigned)at);
}

// the grids of the kernels with a thread per element, and a thread per 8 elements
inline dim3 per_element(SegBatch& t) {
  return seg_grid(t, [&](int k) { return (t.n[k] + kThreads - 1) / kThreads; });
}
inline dim3 per_byte(SegBatch& t) {
  return seg_grid(t, [&](int k) { return (t.n[k] + 7) / 8 / kThreads + 1; });
}

inline int64_t packed_bytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// The fields every drawn segment of a compress batch fills alike: its size, where its input starts,
// its seed words, and where its codes (`bits` per element, from a byte boundary) go, `bytes` on past them
inline void drawn_segment(SegBatch& t, int k, int64_t n, int64_t start, uint32_t s0, uint32_t s1, int bits,
                          int64_t& bytes) {
  t.n[k] = n;
  t.x[k] = start;
  t.u[k] = (int64_t)s0 | (int64_t)s1 << 32;
  t.p[k] = bytes;
  bytes += packed_bytes(n, bits);
}

}  // namespace

// ---- a bucket's segments (host arrays of segment sizes and offsets; device data) -----------------
// launch(batch, first segment) for the batches of segment s's numels[s] draws of the seed words
// (s0[s], s1[s]), the segments' draws in a row
template <class Launch>
static int draw_batches(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                        Launch launch) {
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 0 || numels[s] > (int64_t(1) << 32)) return -1;  // draw numbers are 32-bit
  int64_t at = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = at;
        t.u[k] = (int64_t)s0[s] | (int64_t)s1[s] << 32;
        at += numels[s];
      },
      launch);
}

API int grace_cuda_uniform_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                    float* out, void* stream) {
  return draw_batches(segments, numels, s0, s1, [&](SegBatch& t, int64_t) {
    const dim3 grid = per_element(t);
    k_uniform_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, out);
    return 0;
  });
}

// out[j] = segment << 32 | the hash of its draw j (segment draws in a row): random indices' sort keys
API int grace_cuda_hash_keys_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                      int64_t* out, void* stream) {
  return draw_batches(segments, numels, s0, s1, [&](SegBatch& t, int64_t first) {
    const dim3 grid = per_element(t);
    k_hash_keys_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, first, out);
    return 0;
  });
}

// the segments' payloads in a row: codes (packed per segment, each from a byte boundary) and
// the scalars, as terngrad_compress / qsgd_compress / natural_compress make them for each alone
API int grace_cuda_terngrad_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                              const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                              uint8_t* out, float* scale, void* stream) {
  cudaStream_t st = as_stream(stream);
  if (segments > 0) cudaMemsetAsync(scale, 0, segments * sizeof(float), st);
  int64_t bytes = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        drawn_segment(t, k, numels[s], starts[s], s0[s], s1[s], 2, bytes);
        t.q[k] = s;
      },
      [&](SegBatch& t, int64_t) {
        const dim3 max_grid = seg_grid(t, [&](int k) { return red_grid(t.n[k]); });
        k_maxabs_seg<<<max_grid, kThreads, 0, st>>>(t, x, reinterpret_cast<unsigned*>(scale));
        const dim3 grid = per_byte(t);
        k_terngrad_seg<<<grid, kThreads, 0, st>>>(t, x, scale, out);
        return 0;
      });
}

API int grace_cuda_natural_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                             const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                             uint8_t* signs, uint8_t* codes, void* stream) {
  int64_t bytes = 0, at = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        drawn_segment(t, k, numels[s], starts[s], s0[s], s1[s], 1, bytes);
        t.q[k] = at;
        at += numels[s];
      },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = per_byte(t);
        k_natural_seg<<<grid, kThreads, 0, as_stream(stream)>>>(t, x, signs, codes);
        return 0;
      });
}

API int grace_cuda_qsgd_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                          const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                          int levels, int64_t bucket, int bits, uint8_t* out, float* norms,
                                          void* stream) {
  if (bits < 1 || bits > 8 || levels < 1 || bucket < 0) return -1;
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 1) return -1;
  cudaStream_t st = as_stream(stream);
  // scratch for the partial sums of the rows longer than 4096
  int64_t slots = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t b = qsgd_row(numels[s], bucket);
    if (b > 4096) slots += qsgd_rows(numels[s], b) * row_chunks(b);
  }
  Scratch sc(slots * sizeof(float), st);
  if (!sc.p) return -3;
  int64_t bytes = 0, row = 0, slot = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        const int64_t n = numels[s], b = qsgd_row(n, bucket), rows = qsgd_rows(n, b);
        drawn_segment(t, k, n, starts[s], s0[s], s1[s], bits, bytes);
        t.q[k] = row;
        t.r[k] = slot;
        row += rows;
        if (b > 4096) slot += rows * row_chunks(b);
      },
      [&](SegBatch& t, int64_t) {
        bool long_rows = false;  // rows longer than 4096: by chunks, then a block per row
        const dim3 norm_grid = seg_grid(t, [&](int k) {
          const int64_t b = qsgd_row(t.n[k], bucket), rows = qsgd_rows(t.n[k], b);
          if (b <= 4096) return (rows * 32 + kThreads - 1) / kThreads;  // a warp per row
          long_rows = true;
          return rows * row_chunks(b);
        });
        float* partial = sc.at<float>(0);
        k_norms_seg<<<norm_grid, kThreads, 0, st>>>(t, x, bucket, norms, partial);
        if (long_rows) {
          const dim3 final_grid = seg_grid(t, [&](int k) {
            const int64_t b = qsgd_row(t.n[k], bucket);
            return b > 4096 ? qsgd_rows(t.n[k], b) : int64_t(1);
          });
          k_norms_final_seg<<<final_grid, kThreads, 0, st>>>(t, bucket, norms, partial);
        }
        const dim3 grid = per_byte(t);
        k_qsgd_seg<<<grid, kThreads, 0, st>>>(t, x, (float)levels, bucket, bits, norms, out);
        return 0;
      });
}

// Residual memory's step around a sign compression: p = compensate(g, r) compressed, new_r = p - its
// decoding (new_r may be r)
struct SignEF {
  const float* r;
  float beta, gamma;
  int flags;
  float* new_r;
};

// the sign family's bits and scalars of every segment, as efsign_compress / onebit_compress make them
// for each alone; with ef, of the compensated x, then the new residuals
template <int S>
static int sign_segments(const float* x, const SignEF* ef, int64_t segments, const int64_t* starts,
                         const int64_t* numels, uint8_t* out, float* scalars, cudaStream_t st, void* flag = nullptr,
                         int flag_width = 0) {
  if (segments == 0 && flag) cudaMemsetAsync(flag, 0, flag_width, st);
  int64_t slots = 0;
  for (int64_t s = 0; s < segments; ++s) slots += S * red_grid(numels[s]);
  Scratch sc(slots * sizeof(float), st);
  if (!sc.p) return -3;
  int64_t bytes = 0, slot = 0;
  constexpr int per = S == 1 ? 1 : 2;  // scalars per segment
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = starts[s];
        t.p[k] = bytes;
        t.q[k] = per * s;
        t.r[k] = slot;
        bytes += packed_bytes(numels[s], 1);
        slot += S * red_grid(numels[s]);
      },
      [&](SegBatch& t, int64_t first) {
        const bool last = first + t.count >= segments;
        const dim3 grid = seg_grid(t, [&](int k) { return red_grid(t.n[k]); });
        float* partial = sc.at<float>(0);
        if (ef) {
          k_sign_ef_sums_seg<S><<<grid, kThreads, 0, st>>>(t, x, ef->r, ef->beta, ef->gamma, ef->flags, out, partial);
        } else {
          k_sign_sums_seg<S><<<grid, kThreads, 0, st>>>(t, x, out, partial);
        }
        k_sign_final_seg<S><<<t.count, 1024, 0, st>>>(t, partial, scalars);
        if (ef) {
          k_sign_residual_seg<S><<<per_element(t), kThreads, 0, st>>>(t, x, ef->r, ef->beta, ef->gamma, ef->flags,
                                                                       out, scalars, ef->new_r, per * segments,
                                                                       last ? flag : nullptr, flag_width);
        }
        return 0;
      });
}

API int grace_cuda_efsign_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                      const int64_t* numels, float beta, float gamma, int flags, uint8_t* out,
                                      float* scale, float* new_r, void* flag, int flag_width, void* stream) {
  const SignEF ef{r, beta, gamma, flags, new_r};
  return sign_segments<1>(g, &ef, segments, starts, numels, out, scale, as_stream(stream), flag, flag_width);
}

API int grace_cuda_onebit_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                      const int64_t* numels, float beta, float gamma, int flags, uint8_t* out,
                                      float* means, float* new_r, void* flag, int flag_width, void* stream) {
  const SignEF ef{r, beta, gamma, flags, new_r};
  return sign_segments<3>(g, &ef, segments, starts, numels, out, means, as_stream(stream), flag, flag_width);
}

API int grace_cuda_efsign_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                            const int64_t* numels, uint8_t* out, float* scale, void* stream) {
  return sign_segments<1>(x, nullptr, segments, starts, numels, out, scale, as_stream(stream));
}

API int grace_cuda_onebit_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                            const int64_t* numels, uint8_t* out, float* means, void* stream) {
  return sign_segments<3>(x, nullptr, segments, starts, numels, out, means, as_stream(stream));
}

namespace {
// The decoders' segments: each one's size, first element, first packed byte and first scalar (natural
// compression: first code); `bytes` and `scalars` run on past them (after the last: one rank's fields)
struct DecodeLayout {
  int method, code_bits;
  int64_t bucket, bytes = 0, at = 0, scalars = 0;
  DecodeLayout(int method_, int bits, int64_t bucket_)
      : method(method_), code_bits(method_ == 2 ? 2 : (method_ == 3 ? bits : 1)), bucket(bucket_) {}
  bool valid(int levels, int bits) const {
    return method >= 0 && method <= 4 && (method != 3 || (bits >= 1 && bits <= 8 && levels >= 1 && bucket >= 0));
  }
  void fill(SegBatch& t, int k, int64_t n) {
    t.n[k] = n;
    t.x[k] = at;
    t.p[k] = bytes;
    t.q[k] = method == 4 ? at : scalars;
    bytes += packed_bytes(n, code_bits);
    at += n;
    scalars += method == 1 ? 2 : (method == 3 ? qsgd_rows(n, qsgd_row(n, bucket)) : 1);
  }
};

// launch(the method as a std::integral_constant): its decoder's kernels chosen at compile time
template <class Launch>
void by_method(int method, Launch launch) {
  switch (method) {
    case 0: launch(std::integral_constant<int, 0>{}); break;
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 3: launch(std::integral_constant<int, 3>{}); break;
    default: launch(std::integral_constant<int, 4>{}); break;
  }
}
}  // namespace

// every segment's aggregate over `ranks` ranks into the flat out: a and b hold each rank's fields
// in a row (as decode_segments takes one rank's), rank after rank; the decoded sum's sign where vote,
// divided by divisors[0 .. ndiv) in turn (ndiv <= 4); NaN where the device's *overflow > 0 (overflow
// may be NULL)
API int grace_cuda_mean_segments(int method, int64_t segments, const int64_t* numels, int ranks, const uint8_t* a,
                                 const void* b, int levels, int64_t bucket, int bits, int vote, const float* divisors,
                                 int ndiv, const int64_t* overflow, float* out, void* stream) {
  DecodeLayout layout(method, bits, bucket), rank(method, bits, bucket);
  if (!layout.valid(levels, bits) || ranks < 1 || ndiv < 0 || ndiv > 4 || segments < 0) return -1;
  SegBatch scratch;
  for (int64_t s = 0; s < segments; ++s) rank.fill(scratch, 0, numels[s]);  // one rank's bytes and scalars
  Finish finish{vote != 0, ndiv, {}};
  for (int d = 0; d < ndiv; ++d) finish.r[d] = 1.0f / divisors[d];
  return for_batches(
      segments, [&](SegBatch& t, int k, int64_t s) { layout.fill(t, k, numels[s]); },
      [&](SegBatch& t, int64_t) {
        const dim3 grid = per_element(t);
        cudaStream_t st = as_stream(stream);
        by_method(method, [&](auto m) {
          k_mean_seg<decltype(m)::value><<<grid, kThreads, 0, st>>>(
              t, ranks, a, rank.bytes, b, method == 4 ? rank.at : rank.scalars, (float)levels, bucket, bits, finish,
              overflow, out);
        });
        return 0;
      });
}

// every segment's payload decompressed into the flat out (segments in a row): method 0 sign
// bits (b: a scale per segment, or NULL), 1 1-bit SGD (two means each), 2 TernGrad (a scale
// each), 3 QSGD (its norms), 4 natural compression (a: sign bits, b: codes). One rank's
// aggregate, unfinished: each element its decoding.
API int grace_cuda_decode_segments(int method, int64_t segments, const int64_t* numels, const uint8_t* a,
                                   const void* b, int levels, int64_t bucket, int bits, float* out, void* stream) {
  return grace_cuda_mean_segments(method, segments, numels, 1, a, b, levels, bucket, bits, 0, nullptr, 0, nullptr, out,
                                  stream);
}

namespace {
// The selections with error feedback of every segment (0 <= ks[s] <= numels[s]), by `By`: p =
// compensate(g, r) into new_r, the ks[s] chosen into values and idx (int64) from the previous
// segments' ks on, new_r = p - (0 + value) where sent; one launch per kernel per 64 segments.
// words, scales: random-k's seed words and factors per segment (NULL: none, 1). cut, u: DGC's
// cuts per segment and momenta (NULL: none; then EmitCut writes the selected). out, tail: the
// frame the pairs go into instead of values and idx (out.frame NULL: none), and its tail.
template <class By>
int select_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts, const int64_t* numels,
                       const int64_t* ks, const int64_t* words, const float* scales, float beta, float gamma,
                       int flags, float* values, int64_t* idx, float* new_r, void* flag, int flag_width,
                       void* stream, const float* cut = nullptr, float* u = nullptr, FramePairs out = {},
                       FrameTail tail = {}) {
  int64_t most_tiles = 0;
  if (!r && !(flags & 4)) return -1;
  for (int64_t s = 0; s < segments; ++s) {
    if (numels[s] < 0 || ks[s] < 0 || ks[s] > numels[s]) return -1;
    most_tiles += tiles_of(numels[s]);
  }
  cudaStream_t st = as_stream(stream);
  if (segments == 0 && flag) cudaMemsetAsync(flag, 0, flag_width, st);
  if (segments == 0 && tail.frame && tail.size > tail.zero_from)
    cudaMemsetAsync(tail.frame + tail.zero_from, 0, tail.size - tail.zero_from, st);
  constexpr int kPasses = 3;  // the radix passes: 11 + 11 + 10 bits, a histogram each, all zeroed at once
  // the word that tells an inf or a NaN (zeroed with the first batch's), each batch's tickets, its histograms
  const size_t bad_bytes = 256, ticket_bytes = align256(kTicketSets * kSegBatch * sizeof(unsigned));
  const size_t hist_bytes =
      bad_bytes + ticket_bytes + (size_t)kPasses * kSegBatch * kHistBins * sizeof(unsigned long long);
  const size_t state_bytes = align256(kSegBatch * sizeof(SelState));
  const size_t totals_bytes = align256(2 * kSegBatch * sizeof(long long));
  const size_t counts_bytes = 2 * std::max<int64_t>(most_tiles, 1) * sizeof(long long);
  Scratch sc(align256(hist_bytes) + state_bytes + totals_bytes + counts_bytes, st);
  if (!sc.p) return -3;
  unsigned* bad = sc.at<unsigned>(0);
  unsigned* tickets = sc.at<unsigned>(bad_bytes);
  unsigned long long* h = sc.at<unsigned long long>(bad_bytes + ticket_bytes);
  SelState* state = sc.at<SelState>(align256(hist_bytes));
  long long* totals = sc.at<long long>(align256(hist_bytes) + state_bytes);
  long long* cg = sc.at<long long>(align256(hist_bytes) + state_bytes + totals_bytes);
  long long* ce = cg + std::max<int64_t>(most_tiles, 1);
  int64_t sent = 0, tile = 0;
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = starts[s];
        t.u[k] = ks[s];
        t.p[k] = sent;
        t.q[k] = tile;
        t.r[k] = words ? words[s] : 0;
        t.f[k] = scales ? scales[s] : 1.0f;
        sent += ks[s];
        tile += tiles_of(numels[s]);
      },
      [&](SegBatch& t, int64_t first) {
        const size_t pass_bins = (size_t)t.count * kHistBins;  // a pass's histograms, for this batch
        const size_t zeroed = ticket_bytes + kPasses * pass_bins * sizeof(unsigned long long);
        if (first == 0) cudaMemsetAsync(bad, 0, bad_bytes + zeroed, st);
        else cudaMemsetAsync(tickets, 0, zeroed, st);
        const bool last = first + t.count >= segments;
        const int shifts[kPasses] = {21, 10, 0}, bins[kPasses] = {2048, 2048, 1024};
        // (segments that send all or nothing select nothing: their blocks only compensate)
        const dim3 first_grid = seg_grid(t, [&](int k) {
          return selects(t, k) ? grid_for(t.n[k], kThreads * 16, 2048) : (t.n[k] + kThreads - 1) / kThreads;
        });
        k_compensate_hist_seg<By><<<first_grid, kThreads, 0, st>>>(t, g, r, beta, gamma, flags, new_r, state,
                                                                    shifts[0], bins[0], h, tickets,
                                                                    flag ? bad : nullptr);
        const dim3 hist_grid =
            seg_grid(t, [&](int k) { return selects(t, k) ? grid_for(t.n[k], kThreads * 16, 2048) : 1; });
        for (int d = 1; d < kPasses; ++d)
          k_select_hist_seg<By><<<hist_grid, kThreads, 0, st>>>(t, new_r, state, shifts[d], bins[d],
                                                                h + d * pass_bins, tickets + d * kSegBatch);
        const dim3 tile_grid = seg_grid(t, [&](int k) { return selects(t, k) ? tiles_of(t.n[k]) : 1; });
        k_select_count_seg<By><<<tile_grid, kThreads, 0, st>>>(t, new_r, state, cg, ce, totals,
                                                               tickets + kPasses * kSegBatch);
        const dim3 write_grid = seg_grid(t, [&](int k) {  // all: a thread per element; none: a block
          return t.u[k] >= t.n[k] ? (t.n[k] + kThreads - 1) / kThreads : (t.u[k] > 0 ? tiles_of(t.n[k]) : 1);
        });
        k_select_write_seg<By><<<write_grid, kThreads, 0, st>>>(t, new_r, state, cg, ce, idx, values, bad,
                                                                last ? flag : nullptr, flag_width,
                                                                cut ? cut + first : nullptr, u, out,
                                                                last ? tail : FrameTail{});
        return 0;
      });
}
}  // namespace

// grace_cuda_topk_ef of every segment: the ks[s] largest |p| (ties to the lowest index), indices
// in the segment. flags & 4: p = g (r unread, may be NULL): a bucket's plain top-k, new_r its scratch.
// frame: where given, the pairs written there (FramePairs) and its bytes [zero_from, frame_size) zeroed
API int grace_cuda_topk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                    const int64_t* numels, const int64_t* ks, float beta, float gamma, int flags,
                                    float* values, int64_t* idx, float* new_r, void* flag, int flag_width,
                                    uint8_t* frame, const int64_t* slots, int64_t pairs, int64_t zero_from,
                                    int64_t frame_size, void* stream) {
  return select_ef_segments<ByMagnitude>(g, r, segments, starts, numels, ks, nullptr, nullptr, beta, gamma, flags,
                                         values, idx, new_r, flag, flag_width, stream, nullptr, nullptr,
                                         FramePairs{frame, slots, pairs}, FrameTail{frame, zero_from, frame_size});
}

// random-k with residual memory of every segment: the indices of the ks[s] smallest hashes of
// draws 0 .. numels[s] - 1 of the seed words (s0[s], s1[s]) (ties to the lowest index), in the
// bucket, ascending; the values p times scales[s] (NULL: as they are)
API int grace_cuda_randomk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                       const int64_t* numels, const int64_t* ks, const uint32_t* s0,
                                       const uint32_t* s1, const float* scales, float beta, float gamma, int flags,
                                       float* values, int64_t* idx, float* new_r, void* flag, int flag_width,
                                       void* stream) {
  std::vector<int64_t> words(std::max<int64_t>(segments, 0));
  for (int64_t s = 0; s < segments; ++s) words[s] = (int64_t)((uint64_t)s0[s] | (uint64_t)s1[s] << 32);
  return select_ef_segments<ByDraws>(g, r, segments, starts, numels, ks, words.data(), scales, beta, gamma, flags,
                                     values, idx, new_r, flag, flag_width, stream);
}

// DGC's selection of every segment from its compensated p (grace_cpu_dgc_select_segments): top-k's
// kernels on p (compensating nothing: flag 4), their writes by EmitCut
API int grace_cuda_dgc_select_segments(float* p, float* u, int64_t segments, const int64_t* starts,
                                       const int64_t* numels, const int64_t* ks, const float* cut, float* values,
                                       int64_t* idx, void* flag, int flag_width, uint8_t* frame, const int64_t* slots,
                                       int64_t pairs, int64_t zero_from, int64_t frame_size, void* stream) {
  return select_ef_segments<ByMagnitude>(p, nullptr, segments, starts, numels, ks, nullptr, nullptr, 1.0f, 1.0f, 4,
                                         values, idx, p, flag, flag_width, stream, cut, u,
                                         FramePairs{frame, slots, pairs}, FrameTail{frame, zero_from, frame_size});
}

namespace {
// DGC's cut of each segment of a batch, a block per segment: the need-th largest key (the bits of
// |p|, NaN above inf) of its sample (t.q[s] elements: drawn at floor(u_j d) from t.r[s]'s draws
// where fewer than d, else every one), by a radix select of 11 + 11 + 10 bits in shared memory.
__global__ void k_dgc_cut_seg(SegBatch t, const float* p, int64_t n, float* cut) {
  const int s = blockIdx.x;
  const int64_t d = t.n[s], count = t.q[s];
  const Drawn draw{t.r[s]};
  __shared__ unsigned hist[2048];
  __shared__ uint32_t prefix, mask;
  __shared__ long long need;
  if (threadIdx.x == 0) {
    prefix = mask = 0;
    need = t.u[s];
  }
  const int shifts[3] = {21, 10, 0}, bins[3] = {2048, 2048, 1024};
  for (int pass = 0; pass < 3; ++pass) {
    for (int b = threadIdx.x; b < 2048; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t pre = prefix, msk = mask;
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
      const int64_t i = count < d ? min(t.x[s] + (int64_t)floorf(__fmul_rn(draw[j], (float)d)), n - 1) : t.x[s] + j;
      const uint32_t key = __float_as_uint(p[i]) & 0x7fffffffu;
      if ((key & msk) == pre) atomicAdd(&hist[(key >> shifts[pass]) & (bins[pass] - 1)], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the bin holding the need-th largest, from the top
      long long left = need;
      int b = bins[pass] - 1;
      for (; b > 0 && (long long)hist[b] < left; --b) left -= hist[b];
      prefix = pre | (uint32_t)b << shifts[pass];
      mask = msk | (uint32_t)(bins[pass] - 1) << shifts[pass];
      need = left;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) cut[s] = __uint_as_float(prefix);
}
}  // namespace

// grace_cpu_dgc_cut_segments on the device: a launch per 64 segments
API int grace_cuda_dgc_cut_segments(const float* p, int64_t n, int64_t segments, const int64_t* starts,
                                    const int64_t* numels, const int64_t* sizes, const int64_t* needs,
                                    const uint32_t* s0, const uint32_t* s1, float* cut, void* stream) {
  if (n < 0) return -1;
  for (int64_t s = 0; s < segments; ++s)
    if (numels[s] < 1 || starts[s] < 0 || starts[s] + numels[s] > n || sizes[s] < 1 || sizes[s] > numels[s] ||
        needs[s] < 1 || needs[s] > sizes[s])
      return -1;
  cudaStream_t st = as_stream(stream);
  return for_batches(
      segments,
      [&](SegBatch& t, int k, int64_t s) {
        t.n[k] = numels[s];
        t.x[k] = starts[s];
        t.q[k] = sizes[s];
        t.u[k] = needs[s];
        t.r[k] = (int64_t)((uint64_t)s0[s] | (uint64_t)s1[s] << 32);
      },
      [&](SegBatch& t, int64_t first) {
        k_dgc_cut_seg<<<t.count, kThreads, 0, st>>>(t, p, n, cut + first);
        return 0;
      });
}
