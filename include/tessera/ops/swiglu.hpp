// SwiGLU gate: g = silu(a) * b, element-wise over the two up-projections.
//
// Backward: with s = sigmoid(a), silu(a) = a s and silu'(a) = s (1 + a (1 - s)):
//   da = dg * b * s * (1 + a (1 - s)),  db = dg * a * s
// computed in accum_t<T> (float for bf16 storage), each output rounded once.
//
// SwiGluForwardRows and SwiGluBackwardRows are the same arithmetic over whole rows (the
// tokens), each also writing its outputs' row amaxes, for the float8 casts that read
// them next (w2's input g; w1's and w3's output gradients da and db): the casts then
// take their scales from these (nn::Float8RowAmaxes) rather than reading the outputs
// again. Each element is the elementwise functor's own call, so the outputs are its bits.
//
// SwiGluForwardPaired and SwiGluBackwardPaired read a and b where w1 and w3, run as one
// GEMM (nn::stacked_forward), wrote them: side by side in each row of one (rows, 2 cols)
// matrix ab, a in the first cols columns. Row r is the elementwise functor pointed at
// that row's a, b and outputs (row(r)), so again each element is its own call and bits.
// The backward writes da and db side by side in the same layout (dab), the gradient of
// the GEMM's output.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

template <class T>
struct SwiGluForward {
  const T* a;
  const T* b;
  T* g;
  TESSERA_HD void operator()(std::int64_t i) const {
    const accum_t<T> ai = to_accum(a[i]);
    const accum_t<T> s = sigmoid(ai);
    g[i] = from_accum<T>(ai * s * to_accum(b[i]));
  }
  // a and b read, g written; the sigmoid is an exp, an addition and a division, then 2
  // multiplications.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {2 * e * sizeof(T), e * sizeof(T), 4 * e, e};
  }
};

/// Writes da and db; may alias nothing.
template <class T>
struct SwiGluBackward {
  const T* a;
  const T* b;
  const T* dg;
  T* da;
  T* db;
  TESSERA_HD void operator()(std::int64_t i) const {
    using A = accum_t<T>;
    const A ai = to_accum(a[i]);
    const A s = sigmoid(ai);
    const A silu = ai * s;
    da[i] = from_accum<T>(to_accum(dg[i]) * to_accum(b[i]) * s * (A(1) + ai * (A(1) - s)));
    db[i] = from_accum<T>(to_accum(dg[i]) * silu);
  }
  // a, b and dg read (dg once: both outputs use the same load), da and db written; the
  // sigmoid (an exp and 2 flops), then 8 flops.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {3 * e * sizeof(T), 2 * e * sizeof(T), 10 * e, e};
  }
};

/// An elementwise functor run over `rows` rows of `cols` contiguous elements (index r:
/// elements [r cols, r cols + cols)), each row's amax of each of its outputs as stored
/// written too. Outputs says which: kCount of them, take(e, i, m), which folds element i's
/// outputs into m[0..kCount) (a NaN wins), and the arrays each row's amaxes go to. The
/// CUDA kernel runs the same functor on registers and Outputs::take on them
/// (backend/cuda/elementwise_kernels.cuh).
template <class E, class Outputs>
struct RowsWithAmaxes {
  E element;
  std::int64_t cols;
  Outputs amax;
  TESSERA_HD void operator()(std::int64_t r) const {
    float m[Outputs::kCount] = {};
    for (std::int64_t i = r * cols, end = i + cols; i < end; ++i) {
      element(i);
      Outputs::take(element, i, m);
    }
    amax.store(r, m);
  }
  // The element functor's over the rows' elements, a comparison an element an output and
  // a float a row an output more.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(cols);
    Traffic t = element.traffic(rows * cols);
    t.bytes_written += Outputs::kCount * r * sizeof(float);
    t.flops += Outputs::kCount * e;
    return t;
  }
};

/// SwiGluForward's output g: amax[r] = max |g| over row r.
struct SwiGluForwardAmax {
  static constexpr int kCount = 1;
  float* g;
  template <class T>
  TESSERA_HD static void take(const SwiGluForward<T>& e, std::int64_t i, float* m) {
    m[0] = max_abs(m[0], static_cast<float>(to_accum(e.g[i])));
  }
  TESSERA_HD void store(std::int64_t r, const float* m) const { g[r] = m[0]; }
};

/// SwiGluBackward's outputs da and db: their amaxes over row r.
struct SwiGluBackwardAmax {
  static constexpr int kCount = 2;
  float* da;
  float* db;
  template <class T>
  TESSERA_HD static void take(const SwiGluBackward<T>& e, std::int64_t i, float* m) {
    m[0] = max_abs(m[0], static_cast<float>(to_accum(e.da[i])));
    m[1] = max_abs(m[1], static_cast<float>(to_accum(e.db[i])));
  }
  TESSERA_HD void store(std::int64_t r, const float* m) const {
    da[r] = m[0];
    db[r] = m[1];
  }
};

/// SwiGluForward by rows of `cols`, with g's row amaxes (as RowAbsMax gives them).
template <class T>
struct SwiGluForwardRows : RowsWithAmaxes<SwiGluForward<T>, SwiGluForwardAmax> {
  SwiGluForwardRows(SwiGluForward<T> e, std::int64_t cols, float* g_amax)
      : RowsWithAmaxes<SwiGluForward<T>, SwiGluForwardAmax>{e, cols, {g_amax}} {}
};
/// SwiGluBackward by rows of `cols`, with da's and db's row amaxes.
template <class T>
struct SwiGluBackwardRows : RowsWithAmaxes<SwiGluBackward<T>, SwiGluBackwardAmax> {
  SwiGluBackwardRows(SwiGluBackward<T> e, std::int64_t cols, float* da_amax, float* db_amax)
      : RowsWithAmaxes<SwiGluBackward<T>, SwiGluBackwardAmax>{e, cols, {da_amax, db_amax}} {}
};

/// SwiGluForward over rows of ab (a | b, leading dimension 2 cols) into g (rows, cols).
template <class T>
struct SwiGluForwardPaired {
  const T* ab;
  T* g;
  std::int64_t cols;
  /// Row r's elementwise functor: its elements 0..cols.
  TESSERA_HD SwiGluForward<T> row(std::int64_t r) const {
    const T* a = ab + 2 * r * cols;
    return {a, a + cols, g + r * cols};
  }
  TESSERA_HD void operator()(std::int64_t r) const {
    const SwiGluForward<T> e = row(r);
    for (std::int64_t j = 0; j < cols; ++j) e(j);
  }
  Traffic traffic(std::int64_t rows) const { return row(0).traffic(rows * cols); }
};

/// SwiGluBackward over rows of ab (a | b) and dg (rows, cols) into dab (da | db, leading
/// dimension 2 cols); dab may alias nothing.
template <class T>
struct SwiGluBackwardPaired {
  const T* ab;
  const T* dg;
  T* dab;
  std::int64_t cols;
  TESSERA_HD SwiGluBackward<T> row(std::int64_t r) const {
    const T* a = ab + 2 * r * cols;
    T* da = dab + 2 * r * cols;
    return {a, a + cols, dg + r * cols, da, da + cols};
  }
  TESSERA_HD void operator()(std::int64_t r) const {
    const SwiGluBackward<T> e = row(r);
    for (std::int64_t j = 0; j < cols; ++j) e(j);
  }
  Traffic traffic(std::int64_t rows) const { return row(0).traffic(rows * cols); }
};

}  // namespace tessera::ops
