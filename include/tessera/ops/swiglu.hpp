// SwiGLU gate: g = silu(a) * b, element-wise over the two up-projections.
//
// Backward: with s = sigmoid(a), silu(a) = a s and silu'(a) = s (1 + a (1 - s)):
//   da = dg * b * s * (1 + a (1 - s)),  db = dg * a * s
// computed in accum_t<T> (float for bf16 storage), each output rounded once.
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

}  // namespace tessera::ops
