// grace CPU kernels, what every family's file shares: includes, threads, the AVX-512 switch, memory
// streams and parallel chunks. The other internal headers: lanes.h (8 float lanes, float helpers, the
// overflow check), pairwise.h (NumPy's pairwise summation), bitpack.h (bit packing), select.h (float
// keys, radix selection, error-feedback compensation), signs.h (the sign family's sums), draws.h
// (counter-based draws). A file per family: runtime.cpp (the library's own calls and state),
// packing.cpp, signs.cpp, draws.cpp, quantizers.cpp (TernGrad, QSGD, natural compression), decoders.cpp
// (and decoded sums), selection.cpp, segments.cpp (scatter-add, a bucket in one call), dgc.cpp,
// half.cpp, lowrank.cpp (PowerSGD).
//
// Compiled with -O3 -ffp-contract=off (no fused multiply-adds: every float operation rounds
// exactly as in the NumPy reference) and OpenMP; on x86-64 twice, for x86-64-v2 (SSE4.2: 8
// float lanes in two registers) and x86-64-v3 (AVX2: one register), the same results. Each
// kernel is a pass or two over memory; float32 sums reproduce NumPy's pairwise summation, so
// payload bytes equal the reference.
//
// Helpers defined here are inline or templates in an unnamed namespace (each file its own copy);
// the state and the few kernels several files call exist once, in namespace grace_cpu, declared
// in these headers and defined in one file (hidden, as everything but the API).
#pragma once
#include "grace_native.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

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

namespace grace_cpu {
// threads (runtime.cpp): whether this process is a fork's child (then one thread), and the count
// grace_cpu_set_num_threads set (0: OpenMP's)
extern std::atomic<bool> g_forked;
extern std::atomic<int> g_threads;
#if defined(__AVX2__)
extern const bool kAvx512;  // (runtime.cpp) the AVX-512 bodies run: see below
#endif
extern const bool kPrefetch;  // (runtime.cpp) the passes prefetch ahead: see prefetch below
int64_t cache_bytes();  // (runtime.cpp) the last-level cache's bytes: grace_cpu_set_cache_bytes
}  // namespace grace_cpu

namespace {

// ---- threads -------------------------------------------------------------------------------
using grace_cpu::g_forked;
using grace_cpu::g_threads;

// elements per thread below which waking another thread costs more than it saves (thread
// wake-ups take tens of microseconds on shared virtual machines)
constexpr int64_t kGrain = 1 << 17;
// the same for a pass that reads or writes at scattered places (each access waits on memory)
constexpr int64_t kScatteredGrain = 4096;

inline int max_threads() {
  if (g_forked.load()) return 1;
  int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
}

inline int threads_for(int64_t work, int64_t grain = kGrain) {
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
#define GRACE_AVX512 __attribute__((target("avx512f,avx512bw")))
using grace_cpu::kAvx512;  // the CPU has AVX-512F and BW, and GRACE_NATIVE_AVX512 does not turn it off
#else
constexpr bool kAvx512 = false;
#endif

// ---- memory streams ------------------------------------------------------------------------
// On an Intel VM the hardware prefetcher of one core did not keep two or three input streams
// busy enough: the passes over large inputs prefetch this many bytes ahead, one line at a time.
// Not on an AMD CPU (kPrefetch, asked when the library loads), where the same instructions made
// the passes slower (an AMD EPYC VM, one thread: EF-signSGD's and 1-bit SGD's bucketed steps
// about 9% faster without them, PowerSGD's first product 12%).
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch(const void* p) {
  if (!grace_cpu::kPrefetch) return;
#if defined(__SSE2__)
  _mm_prefetch((const char*)p + kPrefetchBytes, _MM_HINT_T0);
#else
  __builtin_prefetch((const char*)p + kPrefetchBytes);
#endif
}

// Reads at random places (DGC's sample) asked for this many places ahead, into the L2 cache: on
// an AMD EPYC VM such reads were bound by the misses a core keeps in flight to its L1 cache, which
// a prefetch into L1 (or a non-temporal one) occupies as well (the sample of ResNet-50's
// gradients, one thread: about 3 of its 5 ms saved).
constexpr int64_t kRandomAhead = 64;
inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

// Outputs of at least this many bytes (beyond the caches) are written with streaming stores,
// as memcpy does: no read of each line before it is overwritten, half the memory traffic.
constexpr int64_t kStreamBytes = 8 << 20;
inline bool streams(const void* out, int64_t bytes) { return bytes >= kStreamBytes && (uintptr_t)out % 16 == 0; }
// A payload read back later in the step (by its collective and decoder) stays in the caches where
// the `bytes` written before it is read back fit in the last-level cache, else is streamed past it.
// fp16, one thread, an AMD EPYC VM (a 32 MB L3 a core): mlp48's 25 MB of halves a step kept, 3.1
// against 3.4-4.0 ms streamed; ResNet-50's 51 MB streamed, 7.0 against 8.2-8.5 ms kept.
inline bool streams_payload(int64_t bytes) {
  return bytes >= std::max<int64_t>(kStreamBytes, grace_cpu::cache_bytes());
}
#if defined(__SSE2__)
// 4 floats at out (16-byte aligned when stream), streamed or stored
inline void store4(float* out, __m128 v, bool stream) {
  if (stream)
    _mm_stream_ps(out, v);
  else
    _mm_storeu_ps(out, v);
}
#endif
// n values of a small buffer stored at out: streamed where `stream` (out 16-byte aligned), else copied
template <class T>
inline void store_block(T* out, const T* in, int64_t n, bool stream) {
  int64_t i = 0;
#if defined(__SSE2__)
  if (stream && sizeof(T) == 4) {
    for (; i + 4 <= n; i += 4) _mm_stream_ps((float*)(out + i), _mm_load_ps((const float*)(in + i)));
  } else if (stream && sizeof(T) == 8) {
    for (; i + 2 <= n; i += 2) _mm_stream_pd((double*)(out + i), _mm_load_pd((const double*)(in + i)));
  }
#endif
  std::memcpy(out + i, in + i, sizeof(T) * (n - i));
}
// Scratch of n values on a cache line's boundary: a loop that reads and writes a scratch row
// beside a stream (PowerSGD's M^T P over ResNet-50's matrices, one thread, AMD EPYC) ran 4.8-5.7
// ms with it so, 6.6-8.9 where std::vector placed it (16 bytes past a line, or 32).
template <class T>
class LineAligned {
 public:
  explicit LineAligned(size_t n = 0, T fill = T()) { assign(n, fill); }
  LineAligned(const LineAligned&) = delete;  // (a copy would point into the original's buffer)
  LineAligned& operator=(const LineAligned&) = delete;
  void assign(size_t n, T fill = T()) {
    buf_.assign(n ? n + 64 / sizeof(T) : 0, fill);
    at_ = (T*)(((uintptr_t)buf_.data() + 63) & ~(uintptr_t)63);
  }
  T* data() { return at_; }
  const T* data() const { return at_; }
  T& operator[](size_t i) { return at_[i]; }

 private:
  std::vector<T> buf_;
  T* at_ = nullptr;
};

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
  // (inside a region, as a segment side by side: one thread, its chunks in turn, whatever the
  // nesting OpenMP is set to allow)
#pragma omp parallel num_threads(nc) if (!omp_in_parallel())
  {
    int T = omp_get_num_threads();
    for (int c = omp_get_thread_num(); c < nc; c += T) {
      int64_t lo, hi;
      chunk_bounds(n, align, nc, c, lo, hi);
      f(c, lo, hi);
    }
  }
}

// f(s, lo, hi) for every chunk of every segment s of a bucket (numels[s] elements, each cut as
// for_chunks cuts it for threads_for(numels[s]) threads), in one parallel region: the chunks
// dealt to the threads in turn, segment after segment, with no wait between segments. For kernels
// whose chunks are independent: the threads are woken once per call, not once per segment.
template <class F>
void for_segment_chunks(int64_t count, const int64_t* numels, int64_t align, F&& f) {
  int nc = 1;
  for (int64_t s = 0; s < count; ++s) nc = std::max(nc, threads_for(numels[s]));
  if (nc <= 1) {
    for (int64_t s = 0; s < count; ++s) f(s, (int64_t)0, numels[s]);
    return;
  }
#pragma omp parallel num_threads(nc)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t dealt = 0;  // chunks dealt before this segment's
    for (int64_t s = 0; s < count; ++s) {
      const int ns = threads_for(numels[s]);
      for (int c = 0; c < ns; ++c)
        if ((dealt + c) % T == t) {
          int64_t lo, hi;
          chunk_bounds(numels[s], align, ns, c, lo, hi);
          f(s, lo, hi);
        }
      dealt += ns;
    }
  }
}

// for_segments' order: (the segments run side by side, largest first; those run in turn). Side
// by side: those below two threads' grain, and those no larger than a thread's share of the
// bucket's work; only a larger one would leave the other threads waiting. Dealt largest first, the
// last few dealt are the smallest. In turn, a segment's serial parts keep the other threads
// spinning: with two threads, ResNet-50's DGC step took 12.4-13.2 ms where segments above an
// eighth of a thread's share ran in turn, and 10.2 ms under this rule.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> segment_order(int64_t count, const int64_t* numels,
                                                                            int threads) {
  int64_t total = 0;
  for (int64_t s = 0; s < count; ++s) total += std::max<int64_t>(0, numels[s]);
  std::vector<int64_t> small, large;
  for (int64_t s = 0; s < count; ++s)
    (threads_for(numels[s]) > 1 && numels[s] * threads > total ? large : small).push_back(s);
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) { return numels[a] > numels[b]; });
  return {std::move(small), std::move(large)};
}

// f(s) for every segment s of a bucket (numels[s] elements): some one per thread, side by side
// (segment_order), each as on one thread (its for_chunks cut alike and run by that thread: the
// same results); then the others in turn, each sharing the threads in its own chunks. Side by
// side a segment pays no wait between its serial and parallel parts: a third of DGC's step with
// 48 gradients of 1 MB, on two threads. For kernels whose segments are independent and whose
// scratch is their own.
template <class F>
void for_segments(int64_t count, const int64_t* numels, F&& f) {
  const int threads = max_threads();
  const auto [small, large] = segment_order(count, numels, threads);
  if (threads > 1 && small.size() > 1) {
#pragma omp parallel for num_threads((int)std::min<int64_t>(threads, (int64_t)small.size())) schedule(dynamic, 1)
    for (int64_t j = 0; j < (int64_t)small.size(); ++j) f(small[j]);
  } else {  // (no region of one thread: a for_chunks inside it would start a team of its own)
    for (int64_t s : small) f(s);
  }
  for (int64_t s : large) f(s);
}

// the overflow flag: 1 where `set`, else 0, a float32 or (width 1) a byte
inline void write_flag(void* flag, int width, bool set) {
  if (width == 1) *static_cast<uint8_t*>(flag) = set ? 1 : 0;
  else *static_cast<float*>(flag) = set ? 1.0f : 0.0f;
}

// The bytes of a bucket's float32 outputs: a bucket call streams every segment's output where
// they are beyond the caches together (each gradient's alone may not be), as `streams` says.
inline int64_t bucket_bytes(int64_t segments, const int64_t* numels) {
  int64_t n = 0;
  for (int64_t s = 0; s < segments; ++s) n += std::max<int64_t>(0, numels[s]);
  return 4 * n;
}

}  // namespace
