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
};

}  // namespace tessera::ops
