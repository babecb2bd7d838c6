// RMSNorm: y = w * x / sqrt(mean(x^2) + eps), per row of a (rows, n) matrix.
//
// Backward, with r = 1/sqrt(mean(x^2) + eps) saved from forward:
//   dx_j = r * w_j * dy_j - r^3 * x_j * (sum_k w_k dy_k x_k) / n
//   dw_j = sum_rows dy_j * x_j * r
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::ops {

template <class T>
struct RmsNormForward {
  const T* x;  // (rows, n), leading dimension ldx
  std::int64_t ldx;
  const T* w;  // (n)
  T* y;        // (rows, n), leading dimension ldy
  std::int64_t ldy;
  T* rstd;  // (rows)
  std::int64_t n;
  T eps;
  TESSERA_HD void operator()(std::int64_t r) const {
    const T* xr = x + r * ldx;
    T* yr = y + r * ldy;
    T ss = 0;
    for (std::int64_t j = 0; j < n; ++j) ss += xr[j] * xr[j];
    T rs = T(1) / sqrt_(ss / static_cast<T>(n) + eps);
    rstd[r] = rs;
    for (std::int64_t j = 0; j < n; ++j) yr[j] = w[j] * (xr[j] * rs);
  }
};

/// dx for row r.
template <class T>
struct RmsNormBackwardInput {
  const T* x;
  std::int64_t ldx;
  const T* w;
  const T* rstd;
  const T* dy;
  std::int64_t lddy;
  T* dx;
  std::int64_t lddx;
  std::int64_t n;
  TESSERA_HD void operator()(std::int64_t r) const {
    const T* xr = x + r * ldx;
    const T* dyr = dy + r * lddy;
    T* dxr = dx + r * lddx;
    T rs = rstd[r];
    T dot = 0;
    for (std::int64_t j = 0; j < n; ++j) dot += w[j] * dyr[j] * xr[j];
    T c = rs * rs * rs * dot / static_cast<T>(n);
    for (std::int64_t j = 0; j < n; ++j) dxr[j] = rs * w[j] * dyr[j] - c * xr[j];
  }
};

/// dw[j] += sum over rows, for column j.
template <class T>
struct RmsNormBackwardWeight {
  const T* x;
  std::int64_t ldx;
  const T* rstd;
  const T* dy;
  std::int64_t lddy;
  T* dw;
  std::int64_t rows;
  TESSERA_HD void operator()(std::int64_t j) const {
    T s = 0;
    for (std::int64_t r = 0; r < rows; ++r) s += dy[r * lddy + j] * x[r * ldx + j] * rstd[r];
    dw[j] += s;
  }
};

}  // namespace tessera::ops
