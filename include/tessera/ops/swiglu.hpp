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

/// SwiGluForward over `rows` rows of `cols` elements (index r: elements [r cols, r cols +
/// cols) of a, b and g, contiguous), and g_amax[r] = max |g| over the row as stored (a
/// NaN wins), as RowAbsMax gives it.
template <class T>
struct SwiGluForwardRows {
  SwiGluForward<T> element;
  std::int64_t cols;
  float* g_amax;
  TESSERA_HD void operator()(std::int64_t r) const {
    float m = 0;
    for (std::int64_t i = r * cols, end = i + cols; i < end; ++i) {
      element(i);
      m = max_abs(m, static_cast<float>(to_accum(element.g[i])));
    }
    g_amax[r] = m;
  }
  // SwiGluForward's over the rows' elements, a comparison an element and a float a row more.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(cols);
    Traffic t = element.traffic(rows * cols);
    t.bytes_written += r * sizeof(float);
    t.flops += e;
    return t;
  }
};

/// SwiGluBackward over `rows` rows of `cols` elements (index r: elements [r cols, r cols +
/// cols), contiguous), and da_amax[r], db_amax[r] = max |da|, max |db| over the row as
/// stored (a NaN wins), as RowAbsMax gives them.
template <class T>
struct SwiGluBackwardRows {
  SwiGluBackward<T> element;
  std::int64_t cols;
  float* da_amax;
  float* db_amax;
  TESSERA_HD void operator()(std::int64_t r) const {
    float ma = 0, mb = 0;
    for (std::int64_t i = r * cols, end = i + cols; i < end; ++i) {
      element(i);
      ma = max_abs(ma, static_cast<float>(to_accum(element.da[i])));
      mb = max_abs(mb, static_cast<float>(to_accum(element.db[i])));
    }
    da_amax[r] = ma;
    db_amax[r] = mb;
  }
  // SwiGluBackward's over the rows' elements, two comparisons an element and two floats a row more.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(cols);
    Traffic t = element.traffic(rows * cols);
    t.bytes_written += 2 * r * sizeof(float);
    t.flops += 2 * e;
    return t;
  }
};

}  // namespace tessera::ops
