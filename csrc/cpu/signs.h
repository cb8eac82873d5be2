// grace CPU kernels: the sign family's terms and scalars, shared by signs.cpp and segments.cpp
// (see common.h)
#pragma once
#include "pairwise.h"

namespace grace_cpu {
// (signs.cpp) grace_cpu_sign_pack, telling `bad` (where given) whether x holds an inf or a NaN
void sign_pack(const float* x, int64_t n, int negative, uint8_t* out, std::atomic<bool>* bad);
// (signs.cpp) sign_pack's bytes of elements [lo, hi) alone (lo a multiple of 8; hi one too, or n)
void sign_pack_range(const float* x, int64_t n, int64_t lo, int64_t hi, bool neg, uint8_t* out,
                     std::atomic<bool>* bad);
}  // namespace grace_cpu

namespace {
using grace_cpu::sign_pack;
using grace_cpu::sign_pack_range;

// bit i % 8 of out[i / 8]: the first element of a byte clears the others
inline void put_bit(uint8_t* out, int64_t i, bool bit) {
  const uint8_t b = (uint8_t)(bit << (i % 8));
  out[i / 8] = i % 8 ? (uint8_t)(out[i / 8] | b) : b;
}

// |x| for the scale; the sign bits (x >= 0) on the way
struct EfsignTerms {
  const float* x;
  uint8_t* out;
  void operator()(int64_t i, float* t) const {
    t[0] = std::fabs(x[i]);
    put_bit(out, i, x[i] >= 0.0f);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    const F8 v = ld8(x + i);
    out[i / 8] = (uint8_t)mask8(ge8(v, set8(0.0f)));
    t[0] = abs8(v);
  }
#endif
};

// (x >= 0), x where x >= 0 (else x * 0: NaN stays NaN) and x; the sign bits on the way
struct OnebitTerms {
  const float* x;
  uint8_t* out;
  void operator()(int64_t i, float* t) const {
    const float v = x[i];
    const bool pos = v >= 0.0f;
    t[0] = pos ? 1.0f : 0.0f;
    t[1] = pos ? v : v * 0.0f;
    t[2] = v;
    put_bit(out, i, pos);
  }
#ifdef GRACE_SIMD
  void group(int64_t i, F8* t) const {
    const F8 v = ld8(x + i), zero = set8(0.0f), m = ge8(v, zero);
    out[i / 8] = (uint8_t)mask8(m);
    t[0] = and8(m, set8(1.0f));
    t[1] = sel8(m, v, v * zero);
    t[2] = v;
  }
#endif
};

// A row's two decoded values, as its decoder computes them from its scalars (mode 0 signSGD:
// none; 1 scaled sign: the scale; 2 1-bit SGD: the two means).
inline void row_values(const float* scalars, int mode, float& lo, float& hi) {
  if (mode == 2) {
    const float mu0 = scalars[0], d = scalars[1] - mu0;
    lo = mu0 + 0.0f * d;
    hi = mu0 + 1.0f * d;
  } else {
    const float s = mode == 1 ? scalars[0] : 1.0f;
    lo = -1.0f * s;
    hi = 1.0f * s;
  }
}

// EF-signSGD's scale from its sums: sum|x| / max(1, n)
inline void efsign_scale(const Sums<1>& s, int64_t n, float* scale) {
  scale[0] = s.v[0] / (float)std::max<int64_t>(1, n);
}

// 1-bit SGD's means [mu0, mu1] from its sums, as grace/compressors/onebit.py computes them
inline void onebit_means(const Sums<3>& s, int64_t n, float* means) {
  float n_pos = s.v[0], sum_pos = s.v[1], total = s.v[2];
  float d1 = n_pos < 1.0f ? 1.0f : n_pos;
  float rest = (float)n - n_pos;
  float d0 = rest < 1.0f ? 1.0f : rest;
  means[1] = sum_pos / d1;
  means[0] = (total - sum_pos) / d0;
}
}  // namespace
