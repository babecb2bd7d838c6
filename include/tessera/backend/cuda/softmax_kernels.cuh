// Causal softmax's row kernels and RowDot (ops/softmax.hpp): CausalSoftmaxForward,
// CausalSoftmaxRecompute, CausalSoftmaxBackward, RowDot.
//
// A row per warp when it has at most 1024 elements, else a row per block (row_launch.cuh).
// Row r sees the keys before causal_end; the softmax kernels write zeros past it. The
// forward keeps exp(s - max) in a float row between passes, and in a bf16 row computes
// the exponentials again in the last pass.
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/ops/math.hpp"
#include "tessera/ops/softmax.hpp"

namespace tessera::cuda::detail {

/// Keys [0, end) of row r are visible: the functors' causal bound.
__device__ __forceinline__ std::int64_t causal_end(std::int64_t r, std::int64_t offset, std::int64_t cols) {
  const std::int64_t i = r + offset;
  return i < cols - 1 ? i + 1 : cols;
}

template <class T>
struct CausalSoftmaxForwardRows : WarpRows<T> {
  static std::int64_t length(const ops::CausalSoftmaxForward<T>& f) { return f.cols; }
  static bool aligned(const ops::CausalSoftmaxForward<T>& f) { return rows_aligned16(f.s, f.ld); }
  template <int V, bool kWarp>
  __device__ static void run(const ops::CausalSoftmaxForward<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    const float sc = to_float(f.scale);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* row = f.s + r * f.ld;
      const std::int64_t end = causal_end(r, f.offset, f.cols);
      float m = -INFINITY;
      row_loop<V>(end, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W];
        load_float<W>(row, j, v);
#pragma unroll
        for (int k = 0; k < W; ++k) m = fmaxf(m, v[k] * sc);
      });
      m = g.reduce(m, MaxOp{}, smem);
      // Exponentials over [0, end), zeros over [end, cols); in float the row keeps them.
      float s = 0;
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W] = {};
        if (j >= end) {
          store_float<W>(row, j, v);
          return;
        }
        load_float<W>(row, j, v);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          v[k] = j + k < end ? ops::exp_nonpositive(v[k] * sc - m) : 0.0f;
          s += v[k];
        }
        if constexpr (kRowHoldsIntermediates<T>) {
          store_float<W>(row, j, v);
        } else if (j + W > end) {  // keep the logits before end for the last pass
          for (int k = 0; k < W; ++k)
            if (j + k >= end) row[j + k] = from_float<T>(0.0f);
        }
      });
      const float sum = g.reduce(s, SumOp{}, smem);  // also the barrier before rereading the row
      const float inv = 1.0f / sum;
      row_loop<V>(end, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W];
        load_float<W>(row, j, v);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          if constexpr (kRowHoldsIntermediates<T>) v[k] *= inv;
          else v[k] = ops::exp_nonpositive(v[k] * sc - m) * inv;
        }
        store_float<W>(row, j, v);
      });
      if (g.rank() == 0) f.lse[r] = from_float<pointee_t<decltype(f.lse)>>(m + ops::log_(sum));
    }
  }
};

template <class T>
struct CausalSoftmaxRecomputeRows : WarpRows<T> {
  static std::int64_t length(const ops::CausalSoftmaxRecompute<T>& f) { return f.cols; }
  static bool aligned(const ops::CausalSoftmaxRecompute<T>& f) { return rows_aligned16(f.s, f.ld); }
  template <int V, bool kWarp>
  __device__ static void run(const ops::CausalSoftmaxRecompute<T>& f, std::int64_t rows, float*) {
    const RowGroup<kWarp> g;
    const float sc = to_float(f.scale);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* row = f.s + r * f.ld;
      const std::int64_t end = causal_end(r, f.offset, f.cols);
      const float l = to_float(f.lse[r]);
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W] = {};
        if (j < end) {
          load_float<W>(row, j, v);
#pragma unroll
          for (int k = 0; k < W; ++k) v[k] = j + k < end ? ops::exp_nonpositive(v[k] * sc - l) : 0.0f;
        }
        store_float<W>(row, j, v);
      });
    }
  }
};

template <class T>
struct CausalSoftmaxBackwardRows : WarpRows<T> {
  static std::int64_t length(const ops::CausalSoftmaxBackward<T>& f) { return f.cols; }
  static bool aligned(const ops::CausalSoftmaxBackward<T>& f) {
    return rows_aligned16(f.p, f.ldp) && rows_aligned16(f.dp, f.lddp);
  }
  template <int V, bool kWarp>
  __device__ static void run(const ops::CausalSoftmaxBackward<T>& f, std::int64_t rows, float*) {
    const RowGroup<kWarp> g;
    const float sc = to_float(f.scale);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* pr = f.p + r * f.ldp;
      T* dr = f.dp + r * f.lddp;
      const std::int64_t end = causal_end(r, f.offset, f.cols);
      const float dd = to_float(f.d[r]);
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W] = {};
        if (j < end) {
          float p[W];
          load_float<W>(pr, j, p);
          load_float<W>(dr, j, v);
#pragma unroll
          for (int k = 0; k < W; ++k) v[k] = j + k < end ? sc * p[k] * (v[k] - dd) : 0.0f;
        }
        store_float<W>(dr, j, v);
      });
    }
  }
};

template <class T>
struct RowDotRows : WarpRows<T> {
  static std::int64_t length(const ops::RowDot<T>& f) { return f.n; }
  static bool aligned(const ops::RowDot<T>& f) { return rows_aligned16(f.a, f.lda) && rows_aligned16(f.b, f.ldb); }
  template <int V, bool kWarp>
  __device__ static void run(const ops::RowDot<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* ar = f.a + r * f.lda;
      const T* br = f.b + r * f.ldb;
      float s = 0;
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float a[W], b[W];
        load_float<W>(ar, j, a);
        load_float<W>(br, j, b);
#pragma unroll
        for (int k = 0; k < W; ++k) s += a[k] * b[k];
      });
      s = g.reduce(s, SumOp{}, smem);
      if (g.rank() == 0) f.out[r] = from_float<pointee_t<decltype(f.out)>>(s);
    }
  }
};

}  // namespace tessera::cuda::detail
