// Element-wise functors: sums, copies, scaled accumulation, fills, squared-norm partials.
//
// Elements are read with to_accum, combined in accum_t<T> and written with
// from_accum<T> (core/dtype.hpp): one rounding per output for bf16 storage.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// out[i] = a[i] + b[i]
template <class T>
struct Add {
  const T* a;
  const T* b;
  T* out;
  TESSERA_HD void operator()(std::int64_t i) const { out[i] = from_accum<T>(to_accum(a[i]) + to_accum(b[i])); }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {2 * e * sizeof(T), e * sizeof(T), e, 0};
  }
};

/// out[i] = the sum of `count` pieces in order, ((p_0 + p_1) + p_2) + ..., each sum
/// rounded to T as it is made: piece `self` at own, the others one after another from
/// received, `stride` elements apart (piece q at block q, or q - 1 past self).
/// The order and the roundings of a host engine's reduce-scatter (comm/thread.hpp:
/// rank 0's block, then each rank's added in turn), so the pieces sum to its bits.
template <class T>
struct SumOfPieces {
  const T* received;
  std::int64_t stride;
  const T* own;
  int self;
  int count;
  T* out;
  TESSERA_HD const T* piece(int q) const { return q == self ? own : received + (q < self ? q : q - 1) * stride; }
  TESSERA_HD void operator()(std::int64_t i) const {
    T sum = piece(0)[i];
    for (int q = 1; q < count; ++q) sum = from_accum<T>(to_accum(sum) + to_accum(piece(q)[i]));
    out[i] = sum;
  }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {count * e * sizeof(T), e * sizeof(T), (count - 1) * e, 0};
  }
};

/// y[i] = x[i]
template <class T>
struct Copy {
  const T* x;
  T* y;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] = x[i]; }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(T), e * sizeof(T), 0, 0};
  }
};

/// y[i] = x[i] as To: widened exactly, or rounded once (fp32 to bf16: to nearest even)
template <class From, class To>
struct Convert {
  const From* x;
  To* y;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] = from_accum<To>(static_cast<accum_t<To>>(to_accum(x[i]))); }
  // A change of width and rounding: no arithmetic counted.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(From), e * sizeof(To), 0, 0};
  }
};

/// y[i] += alpha * x[i]
template <class T>
struct Axpy {
  accum_t<T> alpha;
  const T* x;
  T* y;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] = from_accum<T>(to_accum(y[i]) + alpha * to_accum(x[i])); }
  // x and y read, y written; a multiplication and an addition per element.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {2 * e * sizeof(T), e * sizeof(T), 2 * e, 0};
  }
};

/// x[i] *= alpha
template <class T>
struct Scale {
  accum_t<T> alpha;
  T* x;
  TESSERA_HD void operator()(std::int64_t i) const { x[i] = from_accum<T>(to_accum(x[i]) * alpha); }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(T), e * sizeof(T), e, 0};
  }
};

/// x[i] = value (a stored element: no arithmetic, so it is given as T)
template <class T>
struct Fill {
  T value;
  T* x;
  TESSERA_HD void operator()(std::int64_t i) const { x[i] = value; }
  Traffic traffic(std::int64_t n) const { return {0, static_cast<double>(n) * sizeof(T), 0, 0}; }
};

/// Sum of squares of x over chunk c of `chunk` elements, accumulated in double:
/// partial[c]. Summing the partials in order gives a reduction whose result does
/// not depend on the thread count.
template <class T>
struct SquaredNormPartial {
  const T* x;
  std::int64_t n;
  std::int64_t chunk;
  double* partial;
  TESSERA_HD void operator()(std::int64_t c) const {
    std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
    double s = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      const double v = static_cast<double>(to_accum(x[i]));
      s += v * v;
    }
    partial[c] = s;
  }
  // Chunks [0, chunks) cover the elements [0, min(chunks * chunk, n)), each read once
  // (a multiplication and an addition), and write one double each.
  Traffic traffic(std::int64_t chunks) const {
    const double covered = static_cast<double>(chunks) * static_cast<double>(chunk);
    double e = covered < static_cast<double>(n) ? covered : static_cast<double>(n);
    if (e < 0) e = 0;
    Traffic t{e * sizeof(T), static_cast<double>(chunks) * sizeof(double), 2 * e, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

}  // namespace tessera::ops
