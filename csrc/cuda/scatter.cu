// grace CUDA kernels: scatter-add (see common.cuh)
#include "common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

namespace {
// atomicAdd on float flushes subnormals to zero; a compare-and-swap loop adds exactly as the
// CPU does (one try when the indices of a payload are distinct, as sparsifiers send them)
__device__ __forceinline__ void add_exact(float* addr, float v) {
  unsigned* a = reinterpret_cast<unsigned*>(addr);
  unsigned old = *a, assumed;
  do {
    assumed = old;
    old = atomicCAS(a, assumed, __float_as_uint(__fadd_rn(__uint_as_float(assumed), v)));
  } while (assumed != old);
}

__device__ __forceinline__ void add_exact(double* addr, double v) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a, assumed;
  do {
    assumed = old;
    old = atomicCAS(a, assumed, __double_as_longlong(__dadd_rn(__longlong_as_double(assumed), v)));
  } while (assumed != old);
}

template <class T>
__global__ void k_scatter(const void* idx, int t, const T* v, int64_t len, int64_t numel, T* dense) {
  GRID_STRIDE(j, len) {
    int64_t i = get_index(idx, t, j);
    if (i >= 0 && i < numel) add_exact(&dense[i], v[j]);
  }
}

// The ranks' overflow flag bytes in their frames (flag_at -1: none): how many are set (the block's
// first thread reads them all); the first block writes that to *flagged (where asked).
struct FrameFlags {
  const uint8_t* frames;
  int64_t frame_size, flag_at;
  float* flagged;
  __device__ int count(int ranks) const {
    __shared__ int flags;
    if (threadIdx.x == 0) {
      int c = 0;
      for (int r = 0; r < ranks && flag_at >= 0; ++r) c += frames[r * frame_size + flag_at] != 0;
      flags = c;
      if (flagged && blockIdx.x == 0) *flagged = (float)c;
    }
    __syncthreads();
    return flags;
  }
};

// a pair's index on the wire: `width` little-endian bytes (byte loads: it need not be aligned)
__device__ __forceinline__ int64_t wire_index(const uint8_t* at, int64_t width) {
  uint64_t x = 0;
  for (int b = 0; b < (int)width; ++b) x |= (uint64_t)at[b] << (8 * b);
  return (int64_t)x;
}

// each pair's value / divisor added at its index (a rank's indices are distinct: no atomics)
__device__ __forceinline__ void add_pair(float v, int64_t i, float divisor, int64_t numel, float* out) {
  if (i >= 0 && i < numel) out[i] = __fadd_rn(out[i], __fdiv_rn(v, divisor));
}

// Rank r's pairs in frames of a fixed layout: pair j's value byte, index byte, index width and
// segment start in `slots` (four rows of `count`).
struct FixedPairs {
  const uint8_t* frames;
  int64_t frame_size;
  const int64_t* slots;
  int64_t count;
  float divisor;
  __device__ void add(int r, int64_t numel, float* out) const {
    const uint8_t* frame = frames + r * frame_size;
    GRID_STRIDE(j, count) {
      const float v = *reinterpret_cast<const float*>(frame + slots[j]);  // (values lie 4-aligned)
      add_pair(v, slots[3 * count + j] + wire_index(frame + slots[count + j], slots[2 * count + j]), divisor, numel,
               out);
    }
  }
};

// Rank r's pairs in variable-length frames: a row of GRACE_PAIR_COLUMNS per (rank, segment) in
// `table` (grace_native.h).
struct VariablePairs {
  const uint8_t* frames;
  int64_t nbytes;
  const int64_t* table;
  int64_t segments;
  float divisor;
  __device__ void add(int r, int64_t numel, float* out) const {
    const int64_t* rows = table + (int64_t)r * segments * GRACE_PAIR_COLUMNS;
    if (segments == 0) return;
    const int64_t* last = rows + (segments - 1) * GRACE_PAIR_COLUMNS;
    GRID_STRIDE(j, last[2] + last[3]) {
      const int64_t* t = pair_row(rows, segments, j);
      const int64_t at = j - t[2], value_at = t[0] + 4 * at, index_at = t[1] + t[5] * at;
      if (at >= t[3] || value_at < 0 || value_at + 4 > nbytes || index_at < 0 || index_at + t[5] > nbytes) continue;
      float v;
      memcpy(&v, frames + value_at, 4);
      add_pair(v, t[4] + wire_index(frames + index_at, t[5]), divisor, numel, out);
    }
  }
};

__device__ __forceinline__ void fill(bool poisoned, int64_t numel, float* out) {
  const float v = poisoned ? __int_as_float(0x7fc00000) : 0.0f;
  GRID_STRIDE(i, numel) out[i] = v;
}

// The whole mean in one cooperative launch: the fill (NaN where a rank flagged an overflow), then
// rank after rank, a grid-wide barrier before each (it orders every block's writes before the next
// rank's reads of the same element).
template <class Pairs>
__global__ void k_ranks_mean(Pairs pairs, int ranks, FrameFlags flags, int64_t numel, float* out) {
  const bool poisoned = flags.count(ranks) > 0;
  fill(poisoned, numel, out);
  if (poisoned) return;  // (every block alike: no barrier left waiting)
  cg::grid_group grid = cg::this_grid();
  for (int r = 0; r < ranks; ++r) {
    grid.sync();
    pairs.add(r, numel, out);
  }
}

// Where the device refuses a cooperative launch: the same in a fill and a launch per rank.
__global__ void k_ranks_fill(int ranks, FrameFlags flags, int64_t numel, float* out) {
  fill(flags.count(ranks) > 0, numel, out);
}

template <class Pairs>
__global__ void k_rank_pairs(Pairs pairs, int r, int ranks, FrameFlags flags, int64_t numel, float* out) {
  flags.flagged = nullptr;  // (written by the fill)
  if (flags.count(ranks) > 0) return;  // (out stays NaN)
  pairs.add(r, numel, out);
}

// Blocks of kThreads that a cooperative launch of k_ranks_mean<Pairs> may have on the current device
// (all resident at once), or 0 where the device has no cooperative launch; found once per device.
template <class Pairs>
int cooperative_blocks() {
  static std::atomic<int> known[64];  // per device: blocks + 1, 0 not yet known
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int blocks = known[device].load();
  if (blocks == 0) {
    int coop = 0, sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_ranks_mean<Pairs>, kThreads, 0);
    cudaGetLastError();  // (a refused query leaves no error behind: 0 blocks)
    blocks = (coop ? sms * per_sm : 0) + 1;
    known[device].store(blocks);
  }
  return blocks - 1;
}

// The ranks' mean into out[numel] (every rank's pairs at most numel: indices are distinct).
template <class Pairs>
int ranks_mean(Pairs pairs, int ranks, FrameFlags flags, int64_t numel, float* out, cudaStream_t s) {
  if (numel == 0) {
    if (flags.flagged) k_ranks_fill<<<1, kThreads, 0, s>>>(ranks, flags, 0, out);
    return status();
  }
  const int blocks = std::min(grid_for(numel), cooperative_blocks<Pairs>());
  if (blocks > 0) {
    void* args[] = {&pairs, &ranks, &flags, &numel, &out};
    if (cudaLaunchCooperativeKernel((const void*)k_ranks_mean<Pairs>, blocks, kThreads, args, 0, s) == cudaSuccess)
      return status();
    cudaGetLastError();  // (refused, as under some sharing modes: launched the other way)
  }
  k_ranks_fill<<<grid_for(numel), kThreads, 0, s>>>(ranks, flags, numel, out);
  for (int r = 0; r < ranks; ++r)
    k_rank_pairs<Pairs><<<grid_for(numel), kThreads, 0, s>>>(pairs, r, ranks, flags, numel, out);
  return status();
}

// an allreduced sum's mean: 0, or NaN everywhere where the summed flag is above 0
__global__ void k_flagged_fill(const float* flag, int64_t numel, float* out) {
  const float v = flag && *flag > 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
  GRID_STRIDE(i, numel) out[i] = v;
}

// its values / divisor added at their indices (distinct: no atomics)
__global__ void k_sum_pairs(const float* values, const int64_t* idx, int64_t count, float divisor, const float* flag,
                            int64_t numel, float* out) {
  if (flag && *flag > 0.0f) return;  // (out stays NaN)
  GRID_STRIDE(j, count) {
    const int64_t i = idx[j];
    if (i >= 0 && i < numel) out[i] = __fadd_rn(out[i], __fdiv_rn(values[j], divisor));
  }
}
}  // namespace

API int grace_cuda_sparse_sum_mean(const float* values, const int64_t* idx, int64_t count, float divisor,
                                   const float* flag, int64_t numel, float* out, void* stream) {
  if (count < 0 || numel < 0) return -1;
  cudaStream_t s = as_stream(stream);
  if (numel == 0) return status();
  k_flagged_fill<<<grid_for(numel), kThreads, 0, s>>>(flag, numel, out);
  if (count > 0) k_sum_pairs<<<grid_for(count), kThreads, 0, s>>>(values, idx, count, divisor, flag, numel, out);
  return status();
}

API int grace_cuda_sparse_frames_mean(const uint8_t* frames, int ranks, int64_t frame_size, const int64_t* slots,
                                      int64_t count, int64_t flag_at, float divisor, int64_t numel, float* out,
                                      float* flagged, void* stream) {
  if (ranks < 0 || count < 0 || numel < 0 || frame_size < 0) return -1;
  return ranks_mean(FixedPairs{frames, frame_size, slots, count, divisor}, ranks,
                    FrameFlags{frames, frame_size, flag_at, flagged}, numel, out, as_stream(stream));
}

API int grace_cuda_sparse_variable_mean(const uint8_t* frames, int64_t nbytes, const int64_t* table, int64_t segments,
                                        int ranks, float divisor, int64_t numel, float* out, void* stream) {
  if (ranks < 0 || segments < 0 || numel < 0 || nbytes < 0) return -1;
  return ranks_mean(VariablePairs{frames, nbytes, table, segments, divisor}, ranks, FrameFlags{frames, 0, -1, nullptr},
                    numel, out, as_stream(stream));
}

API int grace_cuda_scatter_add(int count, const void* const* idx, const int* idx_types, const void* const* values,
                               const int64_t* lengths, int val_type, int64_t numel, void* dense, void* stream) {
  if (count < 0 || numel < 0 || (val_type != GRACE_F32 && val_type != GRACE_F64)) return -1;
  cudaStream_t s = as_stream(stream);
  const size_t vs = val_type == GRACE_F32 ? 4 : 8;
  if (numel > 0) cudaMemsetAsync(dense, 0, numel * vs, s);
  for (int p = 0; p < count; ++p) {
    if (idx_types[p] < 0 || idx_types[p] > 3) return -1;
    if (lengths[p] <= 0) continue;
    if (val_type == GRACE_F32)
      k_scatter<float><<<grid_for(lengths[p]), kThreads, 0, s>>>(idx[p], idx_types[p], (const float*)values[p],
                                                                 lengths[p], numel, (float*)dense);
    else
      k_scatter<double><<<grid_for(lengths[p]), kThreads, 0, s>>>(idx[p], idx_types[p], (const double*)values[p],
                                                                  lengths[p], numel, (double*)dense);
  }
  return status();
}
