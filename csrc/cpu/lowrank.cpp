// grace CPU kernels: PowerSGD's low-rank products (see common.h)
#include "lanes.h"

// ---- PowerSGD's products with a thin rank-r factor -------------------------------------------
// M is rows x cols, Q cols x r, P rows x r (all row-major). Each element of a product is summed in
// one fixed order, whatever the build and the threads: M Q's (i, k) as row_products says, M^T P's
// (j, k) over i ascending from 0, P Q^T's (i, j) over k ascending from the first term; products
// with subnormals flushed (FlushDenormals).
namespace {
// Q's columns as rows (r x cols): Q itself where r = 1
class Columns {
 public:
  Columns(const float* q, int64_t cols, int64_t r) : rows_(q) {
    if (r == 1) return;
    buf_.assign((size_t)(cols * r));
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = 0; k < r; ++k) buf_[k * cols + j] = q[j * r + k];
    rows_ = buf_.data();
  }
  const float* row(int64_t k, int64_t cols) const { return rows_ + k * cols; }

 private:
  const float* rows_;
  LineAligned<float> buf_;
};

constexpr int kDots = 2;  // products of a row computed in one sweep over it

// Subnormal floats read as zero and subnormal results written as zero while it lives (this
// thread): the products of tiny gradients (a deep net's vanishing ones, 1e-20 and below, times
// Q) fall below 1e-38 and take a microcode assist each otherwise, several times the pass's
// memory time. The sums and differences the memory keeps (M = g + e, e = M - P Q^T) run
// without it, exact.
class FlushDenormals {
 public:
#if defined(__SSE2__)
  FlushDenormals() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(csr_); }

 private:
  unsigned csr_;
#endif
};

// p[k] = x . qt.row(k) for k < r, x a row of cols floats: 32 lanes (lane l: the terms j = l mod 32
// below the last multiple of 32, in order; four chains of additions, not one), lanes l, l + 8,
// l + 16 and l + 24 added as (a + b) + (c + d), those 8 combined as combine8, then the other terms
void row_products(const float* x, int64_t cols, const Columns& qt, int64_t r, float* p) {
  const int64_t c32 = cols - cols % 32;
  for (int64_t k0 = 0; k0 < r; k0 += kDots) {
    const int kn = (int)std::min<int64_t>(kDots, r - k0);
    const float* q[kDots];
    for (int d = 0; d < kn; ++d) q[d] = qt.row(k0 + d, cols);
    float sum[kDots];
#ifdef GRACE_SIMD
    F8 acc[kDots][4];
    for (int d = 0; d < kn; ++d)
      for (int c = 0; c < 4; ++c) acc[d][c] = set8(0.0f);
    for (int64_t j = 0; j < c32; j += 32) {
      if (k0 == 0) {
        prefetch(x + j);
        prefetch(x + j + 16);
      }
      for (int c = 0; c < 4; ++c) {
        const F8 v = ld8(x + j + 8 * c);
        for (int d = 0; d < kn; ++d) acc[d][c] = acc[d][c] + v * ld8(q[d] + j + 8 * c);
      }
    }
    for (int d = 0; d < kn; ++d) sum[d] = combine8((acc[d][0] + acc[d][1]) + (acc[d][2] + acc[d][3]));
#else
    for (int d = 0; d < kn; ++d) {
      float acc[32] = {};
      for (int64_t j = 0; j < c32; j += 32)
        for (int l = 0; l < 32; ++l) acc[l] = acc[l] + x[j + l] * q[d][j + l];
      float v[8];
      for (int l = 0; l < 8; ++l) v[l] = (acc[l] + acc[l + 8]) + (acc[l + 16] + acc[l + 24]);
      sum[d] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
#endif
    for (int d = 0; d < kn; ++d) {
      for (int64_t j = c32; j < cols; ++j) sum[d] = sum[d] + x[j] * q[d][j];
      p[k0 + d] = sum[d];
    }
  }
}

// Row i of P Q^T (pi: P's row, r terms), each element summed over k ascending from the first term
struct ApproxRow {
  ApproxRow(const float* pi, const Columns& qt, int64_t r, int64_t cols)
      : pi(pi), qt(qt), r(r), cols(cols), p0(pi[0]), q0(qt.row(0, cols)) {}
  const float* pi;
  const Columns& qt;
  int64_t r, cols;
  float p0;  // (the first term's, kept: stores of m might alias pi as far as the compiler knows)
  const float* q0;
#ifdef GRACE_SIMD
  F8 at8(int64_t j) const {
    F8 v = set8(p0) * ld8(q0 + j);
    for (int64_t k = 1; k < r; ++k) v = v + set8(pi[k]) * ld8(qt.row(k, cols) + j);
    return v;
  }
#endif
  float at(int64_t j) const {
    float v = p0 * q0[j];
    for (int64_t k = 1; k < r; ++k) v = v + pi[k] * qt.row(k, cols)[j];
    return v;
  }
};

// o = row i of P Q^T (ApproxRow), subnormals flushed: expand's approximation, and the one a
// deferred residual subtracts; o streamed where `stream` and 16-byte aligned (a row of the
// gradient: no read of its lines first)
void approx_row(const float* pi, const Columns& qt, int64_t cols, int64_t r, float* o, bool stream = false) {
  FlushDenormals flush;
  const ApproxRow row(pi, qt, r, cols);
  int64_t j = 0;
#ifdef GRACE_SIMD
  const bool nt = stream && (uintptr_t)o % 16 == 0;
  for (; j + 8 <= cols; j += 8) put8(o + j, row.at8(j), nt);
#endif
  for (; j < cols; ++j) o[j] = row.at(j);
}

// Whether products with Q (its elements q) come out the same without the flush: no factor
// subnormal and every nonzero product at least 2^-102 in magnitude, so that no product, nor any sum
// of them (multiples of 2^-125), is subnormal. Then a deferred approximation P Q^T (row) and, at
// rank 1, M's product with Q (least_factor) are made inside the compensating pass, where the
// flush cannot be on (it would read a subnormal gradient as zero).
class Unflushed {
 public:
  Unflushed(const float* q, int64_t n) {  // (NaNs compare false: they decide nothing)
    for (int64_t j = 0; j < n; ++j) {
      const float x = std::fabs(q[j]);
      if (x != 0.0f && x < std::numeric_limits<float>::min()) ok_ = false;
      if (x != 0.0f && x < least_) least_ = x;
    }
  }
  // whether P's row p (r terms) times Q^T comes out as approx_row makes it
  bool row(const float* p, int64_t r) const {
    for (int64_t k = 0; k < r && ok_; ++k) {
      const float x = std::fabs(p[k]);
      if (x != 0.0f && (x < std::numeric_limits<float>::min() || (double)x * least_ < 0x1p-102)) return false;
    }
    return ok_;
  }
  // the least |m| whose products with q (one column) row_products makes the same: m at least this
  // or zero makes every nonzero product at least 2^-102 (twice that: the float's rounding is no
  // matter). Zero where q holds a subnormal (DAZ reads it as zero: then no row is made so, not even
  // one of infinities, which would give inf where the flush gives NaN).
  float least_factor() const {
    return ok_ ? (float)std::max<double>(0x1p-101 / least_, std::numeric_limits<float>::min()) : 0.0f;
  }

 private:
  bool ok_ = true;
  double least_ = std::numeric_limits<double>::infinity();
};

// what a row's sum subtracts from b: nothing, a row made before, or P's row times Q^T made here
struct NoRow {};
struct MadeRow {
  const float* d;
#ifdef GRACE_SIMD
  F8 at8(int64_t j) const { return ld8(d + j); }
#endif
  float at(int64_t j) const { return d[j]; }
};

// a row to subtract, from its element `from` on (NoRow: nothing)
template <class Less>
struct Shifted {
  const Less& d;
  int64_t from;
#ifdef GRACE_SIMD
  F8 at8(int64_t j) const { return d.at8(from + j); }
#endif
  float at(int64_t j) const { return d.at(from + j); }
};
template <>
struct Shifted<NoRow> : NoRow {
  Shifted(const NoRow&, int64_t) {}
};

// an element of a row's sum, m = a + b or m = a + (b - d) with d a deferred subtraction from b, at
// j (8 of them from j: sum8); a's told to check for infs and NaNs
template <class Less>
inline float sum1(const float* a, const float* b, const Less& d, int64_t j, FiniteCheck& check) {
  check.add(a[j]);
  if constexpr (std::is_base_of<NoRow, Less>::value)
    return a[j] + b[j];
  else
    return a[j] + (b[j] - d.at(j));
}
#ifdef GRACE_SIMD
template <class Less>
inline F8 sum8(const float* a, const float* b, const Less& d, int64_t j, FiniteCheck& check) {
  const F8 v = ld8(a + j);
  check.add8(v);
  if constexpr (std::is_base_of<NoRow, Less>::value)
    return v + ld8(b + j);
  else
    return v + (ld8(b + j) - d.at8(j));
}
#endif

// a row's sum (sum1) of cols floats into m (m may be a or b; streamed where `stream`, m then
// 16-byte aligned)
template <class Less>
void row_sum(const float* a, const float* b, const Less& d, int64_t cols, float* m, FiniteCheck& checked,
             bool stream = false) {
  FiniteCheck check;  // (in registers: a store to m might alias `checked`, as far as the compiler knows)
  int64_t j = 0;
#ifdef GRACE_SIMD
  for (; j + 8 <= cols; j += 8) {
    if (!(j & 15)) {  // two input streams: one line of each every 16 elements
      prefetch(a + j);
      prefetch(b + j);
    }
    put8(m + j, sum8(a, b, d, j, check), stream);
  }
#else
  (void)stream;
#endif
  for (; j < cols; ++j) m[j] = sum1(a, b, d, j, check);
  checked.merge(check);
}

// row_sum's m and, in the same pass, its product with q (r = 1) summed as row_products sums it,
// into *p: whether every m was zero or at least `least` (else *p is to be made again, flushed)
template <class Less>
bool row_sum_product(const float* a, const float* b, const Less& d, int64_t cols, float* m, FiniteCheck& checked,
                     const float* q, float least, float* p, bool stream) {
#ifdef GRACE_SIMD
  FiniteCheck check;  // (in registers, as in row_sum)
  const int64_t c32 = cols - cols % 32;
  const F8 zero = set8(0.0f), low = set8(least);
  F8 acc[4] = {zero, zero, zero, zero}, small = zero;
  for (int64_t j = 0; j < c32; j += 32) {
    prefetch(a + j);
    prefetch(b + j);
    prefetch(a + j + 16);
    prefetch(b + j + 16);
    for (int c = 0; c < 4; ++c) {
      const int64_t at = j + 8 * c;
      const F8 x = sum8(a, b, d, at, check);
      put8(m + at, x, stream);
      const F8 t = abs8(x);
      small = or8(small, and8(lt8(t, low), gt8(t, zero)));
      acc[c] = acc[c] + x * ld8(q + at);
    }
  }
  checked.merge(check);
  if (c32 < cols) row_sum(a + c32, b + c32, Shifted<Less>{d, c32}, cols - c32, m + c32, checked, stream);
  float sum = combine8((acc[0] + acc[1]) + (acc[2] + acc[3]));
  bool fine = !mask8(small);
  for (int64_t j = c32; j < cols; ++j) {
    const float t = std::fabs(m[j]);
    fine = fine && !(t < least && t > 0.0f);
    sum = sum + m[j] * q[j];
  }
  *p = sum;
  return fine;
#else
  (void)q, (void)least, (void)p, (void)stream;
  row_sum(a, b, d, cols, m, checked);
  return false;
#endif
}

// one matrix's products (the _many entry points below deal the matrices with for_segments)
void lowrank_project(const float* a, const float* b, const float* dp, const float* dq, int64_t rows, int64_t cols,
                     const float* q, int64_t r, float* m, float* p, float* nonfinite, bool stream) {
  const Columns qt(q, cols, r);
  const Columns dqt(dp ? dq : q, cols, dp ? r : 1);  // (unused without dp)
  const Unflushed unflushed(dp ? dq : q, dp ? cols * r : 0);
  const float least = r == 1 && b ? Unflushed(q, cols).least_factor() : 0.0f;  // (0: no product made in the pass)
  std::atomic<bool> bad{false};
  // M streamed (no read of each line before it is written) where the bucket's are beyond the
  // caches, M has a buffer of its own (an input's lines are in the cache as M is written over
  // them) and each row's product is made in the same pass or from the row made again (M is not
  // read back)
  stream = stream && least > 0.0f && m != a && m != b && (uintptr_t)m % 16 == 0 && cols % 4 == 0;
  for_chunks(rows, 1, threads_for(rows * cols), [&](int, int64_t lo, int64_t hi) {
    FiniteCheck check;
    LineAligned<float> deferred(dp ? cols : 0), again(stream ? cols : 0);
    for (int64_t i = lo; i < hi; ++i) {
      const float* x = a + i * cols;
      if (b) {  // the row's sum (b less its deferred approximation) stored, and its product made
                // from the same registers where row_sum_product can (else from the row in the
                // cache, flushed); the approximation made in the same pass where Unflushed allows,
                // else first, flushed. ResNet-50's 54 matrices, one thread: 11.3 ms, against 14.6
                // with the products read back and 18.2 with the approximation made first too
        float* mi = m + i * cols;
        const float* pi = dp ? dp + i * r : nullptr;
        // the row the product is still to be made from, or nullptr where made in the pass. A
        // streamed row is not in the cache, but its inputs' lines are: where its product is made
        // again (subnormal sums: a deep net's vanishing gradients, a fifth to a third of a
        // 48-layer MLP's rows), its sums are made again from them, into `again`
        auto sum = [&](const auto& less) -> const float* {
          if (least == 0.0f) {
            row_sum(x, b + i * cols, less, cols, mi, check);
            return mi;
          }
          if (row_sum_product(x, b + i * cols, less, cols, mi, check, q, least, p + i, stream)) return nullptr;
          if (!stream) return mi;
          FiniteCheck checked;  // (in the pass)
          row_sum(x, b + i * cols, less, cols, again.data(), checked);
          return again.data();
        };
        if (!pi) {
          x = sum(NoRow{});
        } else if (unflushed.row(pi, r)) {
          x = sum(ApproxRow(pi, dqt, r, cols));
        } else {
          approx_row(pi, dqt, cols, r, deferred.data());
          x = sum(MadeRow{deferred.data()});
        }
        if (!x) continue;
      } else if (nonfinite) {
        check.range(x, 0, cols);
      }
      FlushDenormals flush;
      row_products(x, cols, qt, r, p + i * r);
    }
    fence_streams(stream);
    report(check, &bad);
  });
  if (nonfinite && bad.load()) *nonfinite = 1.0f;
}

void lowrank_back(const float* m, int64_t rows, int64_t cols, const float* p, int64_t r, float* q) {
  LineAligned<float> acc((size_t)(cols * r), 0.0f);  // Q^T (r x cols): a row per column of Q
  constexpr int64_t kRows = 4;  // rows added to a column's sum while it stays in a register
  // each thread sums its own columns over every row, in row order (the same sums either way below).
  // Threads that share each row's columns: kRows rows at a time (a row at a time, each thread's
  // part rows are a stream with gaps: 1.4x slower on an AMD EPYC). One that takes whole rows: a
  // row at a time, M read as one stream (kRows at a time ran at half a plain read's speed there).
  // A matrix run side by side with others (for_segments) is one thread's: whole rows then, not
  // its chunks in turn, each a stream with gaps (a 48-layer MLP's 1 MB matrices, two threads:
  // 1.6-2.0 ms a step, against 3.1-3.3 chunked and 2.6-2.7 on one thread)
  const int nc = omp_in_parallel() ? 1 : threads_for(rows * cols);
  for_chunks(cols, 8, nc, [&](int, int64_t lo, int64_t hi) {
    FlushDenormals flush;
    int64_t i = 0;
    for (; hi - lo < cols && i + kRows <= rows; i += kRows) {
      const float* x = m + i * cols;
      for (int64_t k = 0; k < r; ++k) {
        float* o = acc.data() + k * cols;
        float pk[kRows];
        for (int64_t d = 0; d < kRows; ++d) pk[d] = p[(i + d) * r + k];
        int64_t j = lo;
#ifdef GRACE_SIMD
        const F8 p0 = set8(pk[0]), p1 = set8(pk[1]), p2 = set8(pk[2]), p3 = set8(pk[3]);
        for (; j + 8 <= hi; j += 8) {
          if (!(j & 15) && k == 0)
            for (int64_t d = 0; d < kRows; ++d) prefetch(x + d * cols + j);
          F8 sum = ld8(o + j) + ld8(x + j) * p0;
          sum = sum + ld8(x + cols + j) * p1;
          sum = sum + ld8(x + 2 * cols + j) * p2;
          st8(o + j, sum + ld8(x + 3 * cols + j) * p3);
        }
#endif
        for (; j < hi; ++j) {
          float sum = o[j];
          for (int64_t d = 0; d < kRows; ++d) sum = sum + x[d * cols + j] * pk[d];
          o[j] = sum;
        }
      }
    }
    for (; i < rows; ++i) {
      const float* x = m + i * cols;
      for (int64_t k = 0; k < r; ++k) {
        float* o = acc.data() + k * cols;
        const float pk = p[i * r + k];
        int64_t j = lo;
#ifdef GRACE_SIMD
        const F8 pv = set8(pk);
        for (; j + 8 <= hi; j += 8) st8(o + j, ld8(o + j) + ld8(x + j) * pv);
#endif
        for (; j < hi; ++j) o[j] = o[j] + x[j] * pk;
      }
    }
  });
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t k = 0; k < r; ++k) q[j * r + k] = acc[k * cols + j];
}

// out = P Q^T and, where e is given, e = M - P Q^T (e may be m), row by row: each row's
// approximation made in a buffer (subnormals flushed), then its residual (exact) and the row of
// out stored from there, out's streamed where `stream` and the row is 16-byte aligned (out is the
// gradient, long out of the caches: no read of its lines before they are written)
void lowrank_expand(const float* p, const float* q, int64_t rows, int64_t cols, int64_t r, float* out, const float* m,
                    float* e, bool stream) {
  const Columns qt(q, cols, r);
  for_chunks(rows, 1, threads_for(rows * cols), [&](int, int64_t lo, int64_t hi) {
    LineAligned<float> row(e ? cols : 0);
    for (int64_t i = lo; i < hi; ++i) {
      float* o = e ? row.data() : out + i * cols;
      approx_row(p + i * r, qt, cols, r, o, stream && !e);
      if (e) {  // the row's residual, and the row of out
        const float* mi = m + i * cols;
        float* ei = e + i * cols;
        float* oi = out + i * cols;
        int64_t j = 0;
#ifdef GRACE_SIMD
        const bool nt = stream && (uintptr_t)oi % 16 == 0;
        for (; j + 8 <= cols; j += 8) {
          if (!(j & 15)) prefetch(mi + j);
          const F8 v = ld8(o + j);
          st8(ei + j, ld8(mi + j) - v);
          put8(oi + j, v, nt);
        }
#endif
        for (; j < cols; ++j) {
          ei[j] = mi[j] - o[j];
          oi[j] = o[j];
        }
      }
    }
    fence_streams(stream);
  });
}

// p / |p| for one column of n floats, the squares summed in float64 in index order (no
// underflow where p is tiny), the quotients rounded to float32; the first unit vector where p is
// zero: reduced QR's Q with a non-negative diagonal, as the backends' orthonormalize gives it
void unit_column(float* p, int64_t n) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += (double)p[i] * (double)p[i];
  const double norm = std::sqrt(squares);
  for (int64_t i = 0; i < n; ++i) p[i] = norm == 0.0 ? (i == 0 ? 1.0f : 0.0f) : (float)((double)p[i] / norm);
}
}  // namespace

namespace {
// each matrix's elements (rows x cols): what for_segments deals the matrices by
std::vector<int64_t> matrix_sizes(int64_t count, const int64_t* rows, const int64_t* cols) {
  std::vector<int64_t> sizes(count);
  for (int64_t s = 0; s < count; ++s) sizes[s] = rows[s] * cols[s];
  return sizes;
}
}  // namespace

API void grace_cpu_lowrank_project_many(int64_t count, const float* const* a, const float* const* b,
                                        const float* const* dp, const float* const* dq, const int64_t* rows,
                                        const int64_t* cols, const float* const* q, const int64_t* r,
                                        float* const* m, float* const* p, float* nonfinite) {
  std::vector<float> flags(nonfinite ? count : 0, 0.0f);  // (each matrix's own: written by one thread)
  const std::vector<int64_t> sizes = matrix_sizes(count, rows, cols);
  const bool stream = bucket_bytes(count, sizes.data()) >= kStreamBytes;  // (the bucket's Ms together)
  for_segments(count, sizes.data(), [&](int64_t s) {
    const bool deferred = b && b[s] && dp && dp[s];
    lowrank_project(a[s], b ? b[s] : nullptr, deferred ? dp[s] : nullptr, deferred ? dq[s] : nullptr, rows[s],
                    cols[s], q[s], r[s], m ? m[s] : nullptr, p[s], nonfinite ? &flags[s] : nullptr, stream);
  });
  for (float f : flags)
    if (f != 0.0f) *nonfinite = 1.0f;
}

API void grace_cpu_lowrank_back_many(int64_t count, const float* const* m, const int64_t* rows, const int64_t* cols,
                                     float* const* p, const int64_t* r, int unit, float* const* q) {
  for_segments(count, matrix_sizes(count, rows, cols).data(), [&](int64_t s) {
    if (unit && r[s] == 1) unit_column(p[s], rows[s]);
    lowrank_back(m[s], rows[s], cols[s], p[s], r[s], q[s]);
  });
}

API void grace_cpu_lowrank_expand_many(int64_t count, const float* const* p, const float* const* q, const int64_t* rows,
                                       const int64_t* cols, const int64_t* r, float divisor, float* const* q_out,
                                       float* const* out, const float* const* m, float* const* e) {
  const std::vector<int64_t> sizes = matrix_sizes(count, rows, cols);
  int64_t bytes = 0;  // (the bucket's outputs together: beyond the caches, or not)
  for (int64_t n : sizes) bytes += 4 * n;
  for_segments(count, sizes.data(), [&](int64_t s) {
    for (int64_t i = 0; i < cols[s] * r[s]; ++i) q_out[s][i] = q[s][i] / divisor;
    lowrank_expand(p[s], q_out[s], rows[s], cols[s], r[s], out[s], m ? m[s] : nullptr, e ? e[s] : nullptr,
                   bytes >= kStreamBytes);
  });
}
