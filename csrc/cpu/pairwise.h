// grace CPU kernels: NumPy's pairwise summation, and its blocks 8 lanes at a time (see common.h)
#pragma once
#include "lanes.h"

namespace {
// ---- NumPy's pairwise summation ------------------------------------------------------------
// numpy/_core/src/umath/loops_utils.h.src: n < 8: a plain loop; n <= 128: 8 accumulators
// combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)) then the rest; else split at
// n2 = n/2 - (n/2)%8. The reduction starts from 0, so the result is 0.0f + pairwise(a).
// A Leaf computes the S sums of one block (n <= 128), leaf(lo, n), and may do more work on the
// way (packing the block's codes): one pass over memory. Block starts are multiples of 8.
constexpr int64_t kBlock = 128;

template <int S>
struct Sums {
  float v[S];
};

inline int64_t pw_half(int64_t n) {
  int64_t n2 = n / 2;
  return n2 - n2 % 8;
}

template <int S, class Leaf>
Sums<S> pairwise_seq(const Leaf& leaf, int64_t lo, int64_t n) {
  if (n <= kBlock) return leaf(lo, n);
  const int64_t n2 = pw_half(n);
  Sums<S> a = pairwise_seq<S>(leaf, lo, n2);
  Sums<S> b = pairwise_seq<S>(leaf, lo + n2, n - n2);
  for (int s = 0; s < S; ++s) a.v[s] = a.v[s] + b.v[s];
  return a;
}

struct Node {
  int64_t lo, n;
};

inline void pw_collect(int64_t lo, int64_t n, int64_t cutoff, std::vector<Node>& out) {
  if (n <= kBlock || n <= cutoff) {
    out.push_back({lo, n});
    return;
  }
  const int64_t n2 = pw_half(n);
  pw_collect(lo, n2, cutoff, out);
  pw_collect(lo + n2, n - n2, cutoff, out);
}

template <int S>
Sums<S> pw_combine(int64_t n, int64_t cutoff, const std::vector<Sums<S>>& vals, size_t& pos) {
  if (n <= kBlock || n <= cutoff) return vals[pos++];
  const int64_t n2 = pw_half(n);
  Sums<S> a = pw_combine<S>(n2, cutoff, vals, pos);
  Sums<S> b = pw_combine<S>(n - n2, cutoff, vals, pos);
  for (int s = 0; s < S; ++s) a.v[s] = a.v[s] + b.v[s];
  return a;
}

// The same tree, its top levels cut into subtrees evaluated in parallel: the result does not
// depend on the number of threads.
template <int S, class Leaf>
Sums<S> pairwise(const Leaf& leaf, int64_t n, int nt) {
  Sums<S> root;
  if (nt <= 1) {
    root = pairwise_seq<S>(leaf, 0, n);
  } else {
    std::vector<Node> nodes;
    pw_collect(0, n, std::max<int64_t>(kBlock, n / (8 * nt)), nodes);
    std::vector<Sums<S>> vals(nodes.size());
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)nodes.size(); ++i) vals[i] = pairwise_seq<S>(leaf, nodes[i].lo, nodes[i].n);
    size_t pos = 0;
    root = pw_combine<S>(n, std::max<int64_t>(kBlock, n / (8 * nt)), vals, pos);
  }
  for (int s = 0; s < S; ++s) root.v[s] = 0.0f + root.v[s];
  return root;
}

// A leaf over terms t(i, sums[S]) for i in [lo, lo+n): NumPy's block and small-n loops.
template <int S, class Term>
inline Sums<S> leaf_sums(const Term& term, int64_t lo, int64_t n) {
  Sums<S> res;
  if (n < 8) {
    for (int s = 0; s < S; ++s) res.v[s] = -0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float t[S];
      term(lo + i, t);
      for (int s = 0; s < S; ++s) res.v[s] += t[s];
    }
    return res;
  }
  float r[S][8];
  for (int j = 0; j < 8; ++j) {
    float t[S];
    term(lo + j, t);
    for (int s = 0; s < S; ++s) r[s][j] = t[s];
  }
  int64_t i = 8;
  for (; i < n - (n % 8); i += 8)
    for (int j = 0; j < 8; ++j) {
      float t[S];
      term(lo + i + j, t);
      for (int s = 0; s < S; ++s) r[s][j] += t[s];
    }
  for (int s = 0; s < S; ++s)
    res.v[s] = ((r[s][0] + r[s][1]) + (r[s][2] + r[s][3])) + ((r[s][4] + r[s][5]) + (r[s][6] + r[s][7]));
  for (; i < n; ++i) {
    float t[S];
    term(lo + i, t);
    for (int s = 0; s < S; ++s) res.v[s] += t[s];
  }
  return res;
}

// ---- the blocks of a pairwise sum -----------------------------------------------------------
// Terms give a kernel's S summands: terms(i, float t[S]) of element i and, with SIMD,
// terms.group(i, F8 t[S]) of the 8 elements from i (i a multiple of 8); both may do the
// kernel's other work for those elements on the way, visited in ascending order.
// Blocks<S, Terms> is the Leaf of pairwise() for them: NumPy's block loop, 8 lanes at a time.
template <int S, class Terms>
struct Blocks {
  Terms terms;
  Sums<S> operator()(int64_t lo, int64_t n) const {
    // a local copy, kept in registers: the kernels' byte stores may alias anything in memory,
    // this object's pointers included, which would be read again after every store
    const Terms terms = this->terms;
#ifdef GRACE_SIMD
    if (n >= 8) {
      F8 r[S], t[S];
      terms.group(lo, r);
      int64_t i = 8;
      for (; i + 8 <= n; i += 8) {
        terms.group(lo + i, t);
        for (int s = 0; s < S; ++s) r[s] = r[s] + t[s];
      }
      Sums<S> res;
      for (int s = 0; s < S; ++s) res.v[s] = combine8(r[s]);
      for (; i < n; ++i) {
        float t1[S];
        terms(lo + i, t1);
        for (int s = 0; s < S; ++s) res.v[s] += t1[s];
      }
      return res;
    }
#endif
    return leaf_sums<S>(terms, lo, n);
  }
};

// NumPy's pairwise sums of terms over [0, n), the top of the tree on nt threads
template <int S, class Terms>
Sums<S> pairwise_sums(const Terms& terms, int64_t n, int nt) {
  return pairwise<S>(Blocks<S, Terms>{terms}, n, nt);
}
}  // namespace
