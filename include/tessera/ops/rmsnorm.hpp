// RMSNorm: y = w * x / sqrt(mean(x^2) + eps), per row of a (rows, n) matrix.
//
// Backward, with r = 1/sqrt(mean(x^2) + eps) saved from forward:
//   dx_j = r * w_j * dy_j - r^3 * x_j * (sum_k w_k dy_k x_k) / n
//   dw_j = sum_rows dy_j * x_j * r
//
// Sums, r and dw are in accum_t<T> (float for bf16 storage); x, w, y, dy and dx are
// stored as T, each output rounded once.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

template <class T>
struct RmsNormForward {
  const T* x;  // (rows, n), leading dimension ldx
  std::int64_t ldx;
  const T* w;  // (n)
  T* y;        // (rows, n), leading dimension ldy
  std::int64_t ldy;
  accum_t<T>* rstd;  // (rows)
  std::int64_t n;
  accum_t<T> eps;
  /// (rows) or null: y_amax[r] = max_j |y[r, j]| as stored (a NaN wins), as RowAbsMax
  /// gives it, written by the same pass, for a float8 cast of y (nn::Float8RowAmaxes).
  float* y_amax = nullptr;
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    const T* xr = x + r * ldx;
    T* yr = y + r * ldy;
    A ss = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      const A xj = to_accum(xr[j]);
      ss += xj * xj;
    }
    A rs = A(1) / sqrt_(ss / static_cast<A>(n) + eps);
    rstd[r] = rs;
    for (std::int64_t j = 0; j < n; ++j) yr[j] = from_accum<T>(to_accum(w[j]) * (to_accum(xr[j]) * rs));
    if (y_amax != nullptr) {
      float m = 0;
      for (std::int64_t j = 0; j < n; ++j) m = max_abs(m, static_cast<float>(to_accum(yr[j])));
      y_amax[r] = m;
    }
  }
  // x read once (a row kernel keeps the row on chip between the sum of squares and the
  // scaling pass), w once per launch; 4 flops an element and 3 and a sqrt per row; with
  // y_amax, a comparison an element and a float a row more.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(n), amax = y_amax != nullptr ? 1 : 0;
    Traffic t{e * sizeof(T) + static_cast<double>(n) * sizeof(T),
              e * sizeof(T) + r * sizeof(accum_t<T>) + amax * r * sizeof(float), (4 + amax) * e + 3 * r, r};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// dx for row r, plus `residual` when given: the gradient a residual connection carries
/// past the norm (the block's dy into dh), added in accum_t<T> before dx is rounded
/// once, so that no pass of its own adds it afterwards.
template <class T>
struct RmsNormBackwardInput {
  const T* x;
  std::int64_t ldx;
  const T* w;
  const accum_t<T>* rstd;
  const T* dy;
  std::int64_t lddy;
  T* dx;
  std::int64_t lddx;
  std::int64_t n;
  const T* residual = nullptr;  // added to dx, or null
  std::int64_t ldres = 0;
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    const T* xr = x + r * ldx;
    const T* dyr = dy + r * lddy;
    T* dxr = dx + r * lddx;
    const T* resr = residual != nullptr ? residual + r * ldres : nullptr;
    A rs = rstd[r];
    A dot = 0;
    for (std::int64_t j = 0; j < n; ++j) dot += to_accum(w[j]) * to_accum(dyr[j]) * to_accum(xr[j]);
    A c = rs * rs * rs * dot / static_cast<A>(n);
    for (std::int64_t j = 0; j < n; ++j) {
      A v = rs * to_accum(w[j]) * to_accum(dyr[j]) - c * to_accum(xr[j]);
      if (resr != nullptr) v = v + to_accum(resr[j]);
      dxr[j] = from_accum<T>(v);
    }
  }
  // x and dy (and the residual) read once (a row kernel keeps them on chip between the
  // dot product and the output pass), w once per launch; 7 flops an element (8 with the
  // residual) and 4 per row.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(n), res = residual != nullptr ? 1 : 0;
    Traffic t{(2 + res) * e * sizeof(T) + static_cast<double>(n) * sizeof(T) + r * sizeof(accum_t<T>), e * sizeof(T),
              (7 + res) * e + 4 * r, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// dw[j] += sum over rows, for column j; or, without `add`, dw[j] = that sum (the step's
/// first write of the gradient: nothing zeroes dw before it).
template <class T>
struct RmsNormBackwardWeight {
  const T* x;
  std::int64_t ldx;
  const accum_t<T>* rstd;
  const T* dy;
  std::int64_t lddy;
  accum_t<T>* dw;
  std::int64_t rows;
  bool add = true;
  TESSERA_HD void operator()(std::int64_t j) const {
    using A = accum_t<T>;
    A s = 0;
    for (std::int64_t r = 0; r < rows; ++r) s += to_accum(dy[r * lddy + j]) * to_accum(x[r * ldx + j]) * rstd[r];
    dw[j] = add ? dw[j] + s : s;
  }
  // Columns [0, cols) of dy and x over every row, rstd once per launch, dw read (when
  // added to) and written; 3 flops a (row, column) and 1 per column.
  Traffic traffic(std::int64_t cols) const {
    const double c = static_cast<double>(cols), e = c * static_cast<double>(rows);
    return {2 * e * sizeof(T) + static_cast<double>(rows) * sizeof(accum_t<T>) + (add ? c * sizeof(accum_t<T>) : 0),
            c * sizeof(accum_t<T>), 3 * e + (add ? c : 0), 0};
  }
};

/// Both backward passes in one launch of rows + n indices: index r < rows is
/// input(r), row r's dx; index rows + j is weight(j), column j's dw. The two write
/// apart and read only x, dy, rstd, w and the residual, so the indices may run in any
/// order; input and weight describe the same rows (weight.rows of them, n = input.n
/// columns). The CPU backend runs the two loops (parts()); the CUDA kernel reads each row
/// of x and dy once for both (backend/cuda/rmsnorm_kernels.cuh).
template <class T>
struct RmsNormBackward {
  RmsNormBackwardInput<T> input;
  RmsNormBackwardWeight<T> weight;

  /// Rows in the chunk whose weight-gradient partial sums the CUDA kernel keeps
  /// together (one block's): cuda_traffic() counts them.
  static constexpr std::int64_t kRowsPerPartial = 16;

  TESSERA_HD void operator()(std::int64_t i) const {
    if (i < weight.rows) input(i);
    else weight(i - weight.rows);
  }
  // The two functors' own traffic, each over its indices.
  Traffic traffic(std::int64_t indices) const {
    Traffic t = input.traffic(weight.rows);
    t += weight.traffic(indices - weight.rows);
    return t;
  }
  // One kernel: the input pass's bytes, then per chunk of kRowsPerPartial rows a float
  // partial sum of each column written and read back, and dw read (when added to) and
  // written; the weight pass's arithmetic.
  Traffic cuda_traffic(std::int64_t indices) const {
    const std::int64_t cols = indices - weight.rows;
    Traffic t = input.traffic(weight.rows);
    const double c = static_cast<double>(cols);
    const double chunks = static_cast<double>((weight.rows + kRowsPerPartial - 1) / kRowsPerPartial);
    const double a = sizeof(accum_t<T>);
    t.bytes_read += chunks * c * a + (weight.add ? c * a : 0);
    t.bytes_written += chunks * c * a + c * a;
    t.flops += 3 * c * static_cast<double>(weight.rows) + (weight.add ? c : 0);
    t.walk_bytes = 0;
    return t;
  }

  /// Its two passes (ops::FusesParts): a trace records them by the functors the plan's
  /// rewrites of other runtimes know, the CUDA kernel's bytes on the first, the second's
  /// none (it reads nothing the first has not); the CPU backend runs them as two loops,
  /// each spread evenly over the threads.
  static constexpr bool kFusesParts = true;
  template <class Record>
  void parts(std::int64_t indices, Record&& record) const {
    record(input, weight.rows, cuda_traffic(indices), true);
    record(weight, indices - weight.rows, Traffic{}, true);  // the partial sums' reduction, a kernel of its own
  }
};

}  // namespace tessera::ops
