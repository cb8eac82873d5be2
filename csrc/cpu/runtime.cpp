// grace CPU kernels: the library's own calls (ABI, instruction set, AVX-512 switch, threads) and
// its state (see common.h)
#include "common.h"

#include <pthread.h>
#include <strings.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace grace_cpu {
// libgomp is not fork-safe: a child of a process that ran a parallel region would hang in its
// first one. After fork every kernel runs on the calling thread only.
std::atomic<bool> g_forked{false};
std::atomic<int> g_threads{0};
}  // namespace grace_cpu

namespace {
void on_fork_child() { g_forked.store(true); }
struct AtFork {
  AtFork() { pthread_atfork(nullptr, nullptr, on_fork_child); }
} at_fork_;
// A switch in the environment: `otherwise` where unset, else off where "0", "false", "no" or
// "off" (any case, around spaces: as the loader reads GRACE_NATIVE), on for anything else
bool switch_on(const char* name, bool otherwise) {
  const char* v = std::getenv(name);
  if (!v) return otherwise;
  while (*v == ' ') ++v;
  const size_t n = std::strcspn(v, " ");
  for (const char* off : {"0", "false", "no", "off"})
    if (std::strlen(off) == n && strncasecmp(v, off, n) == 0) return false;
  return true;
}

bool amd_cpu() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // (a static initializer may run before libgcc's own)
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// The highest cache level's size as Linux tells it (sysfs, cpu0: one instance, the part a core can
// hold data in), or 0. An AMD EPYC VM's: 32 MB, where its C library tells 384 MB (every CCD's L3).
int64_t sysfs_cache_bytes() {
  int64_t bytes = 0;
  int top = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    int64_t size = 0;
    char unit = 0;
    if (!(level_file >> level) || !(size_file >> size)) break;
    size_file >> unit;
    size *= unit == 'K' ? 1024 : unit == 'M' ? 1 << 20 : unit == 'G' ? 1 << 30 : 1;
    if (level >= top) top = level, bytes = size;
  }
  return bytes;
}

// the last-level cache a core shares: sysfs's, else the largest level the C library tells of
// (glibc: from CPUID; a VM's may be its host's)
int64_t told_cache_bytes() {
  int64_t bytes = sysfs_cache_bytes();
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  if (bytes <= 0)
    for (int name : {_SC_LEVEL2_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE}) bytes = std::max<int64_t>(bytes, sysconf(name));
#endif
  return bytes;
}
const int64_t kToldCacheBytes = told_cache_bytes();
std::atomic<int64_t> g_cache_bytes{-1};  // grace_cpu_set_cache_bytes's (< 0: kToldCacheBytes)
}  // namespace

namespace grace_cpu {
int64_t cache_bytes() {
  const int64_t set = g_cache_bytes.load();
  return set < 0 ? kToldCacheBytes : set;
}
}  // namespace grace_cpu

#if defined(__AVX2__)
namespace grace_cpu {
const bool kAvx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) &&
                     switch_on("GRACE_NATIVE_AVX512", true);
}  // namespace grace_cpu
#endif
namespace grace_cpu {
const bool kPrefetch = switch_on("GRACE_NATIVE_PREFETCH", !amd_cpu());
}  // namespace grace_cpu

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
API int grace_cpu_uses_prefetch(void) { return grace_cpu::kPrefetch ? 1 : 0; }
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
API void grace_cpu_set_cache_bytes(int64_t n) { g_cache_bytes.store(n < 0 ? -1 : n); }
API int64_t grace_cpu_get_cache_bytes(void) { return grace_cpu::cache_bytes(); }
