// Element-wise functors: sums, copies, scaled accumulation, fills, squared-norm partials.
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"

namespace tessera::ops {

/// out[i] = a[i] + b[i]
template <class T>
struct Add {
  const T* a;
  const T* b;
  T* out;
  TESSERA_HD void operator()(std::int64_t i) const { out[i] = a[i] + b[i]; }
};

/// y[i] = x[i]
template <class T>
struct Copy {
  const T* x;
  T* y;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] = x[i]; }
};

/// y[i] += alpha * x[i]
template <class T>
struct Axpy {
  T alpha;
  const T* x;
  T* y;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] += alpha * x[i]; }
};

/// x[i] *= alpha
template <class T>
struct Scale {
  T alpha;
  T* x;
  TESSERA_HD void operator()(std::int64_t i) const { x[i] *= alpha; }
};

/// x[i] = value
template <class T>
struct Fill {
  T value;
  T* x;
  TESSERA_HD void operator()(std::int64_t i) const { x[i] = value; }
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
    for (std::int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    partial[c] = s;
  }
};

}  // namespace tessera::ops
