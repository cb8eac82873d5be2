// grace CPU kernels: counter-based uniform draws (see common.h)
#pragma once
#include "common.h"

namespace grace_cpu {
// (draws.cpp) out[j - lo] = draw j of the seed words (s0, s1), grace/core/draws.py's uniform, j in [lo, hi)
void uniform_range(int64_t lo, int64_t hi, uint32_t s0, uint32_t s1, float* out);
}  // namespace grace_cpu

namespace {
using grace_cpu::uniform_range;

// grace/core/draws.py's hash32 of a value below 2**64: the first xor-shift sees all 64 bits,
// every later step only the low 32 (its products are taken mod 2**32)
inline uint32_t hash32(uint64_t h) {
  h ^= h >> 16;
  uint32_t x = (uint32_t)h * 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

// f(u, ubase, g, ge) on groups [g0, g1) of 8 elements, a block at a time, u holding the draws of
// seed words (s0, s1) for elements [8 g, min(n, 8 ge)): element i's draw (draw i) is u[i - ubase].
// Made in L1 where they are used: no tensor of n draws written and read back.
template <class F>
void with_draws(int64_t n, int64_t g0, int64_t g1, uint32_t s0, uint32_t s1, const F& f) {
  constexpr int64_t kGroups = 256;  // draws of 2048 elements at a time
  alignas(32) float u[8 * kGroups];
  for (int64_t g = g0; g < g1; g += kGroups) {
    const int64_t ge = std::min(g1, g + kGroups);
    uniform_range(8 * g, std::min(n, 8 * ge), s0, s1, u);
    f(u, 8 * g, g, ge);
  }
}
}  // namespace
