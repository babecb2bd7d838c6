// SwiGLU gate: g = silu(a) * b, element-wise over the two up-projections.
//
// Backward: with s = sigmoid(a), silu(a) = a s and silu'(a) = s (1 + a (1 - s)):
//   da = dg * b * s * (1 + a (1 - s)),  db = dg * a * s
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::ops {

template <class T>
struct SwiGluForward {
  const T* a;
  const T* b;
  T* g;
  TESSERA_HD void operator()(std::int64_t i) const {
    T s = sigmoid(a[i]);
    g[i] = a[i] * s * b[i];
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
    T s = sigmoid(a[i]);
    T silu = a[i] * s;
    da[i] = dg[i] * b[i] * s * (T(1) + a[i] * (T(1) - s));
    db[i] = dg[i] * silu;
  }
};

}  // namespace tessera::ops
