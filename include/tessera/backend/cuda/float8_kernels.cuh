// The float8 casts' kernels (ops/float8.hpp): RowAbsMax, a row per warp or block;
// MaxOf and Float8ScaleFromAmaxes, one block; QuantizeFloat8, rows of vectors or,
// transposing, tiles.
//
// Per index, RowAbsMax walks a whole row in one thread and MaxOf walks every row's amax
// in one thread (a single thread over 8192 values), and a transposing QuantizeFloat8
// reads x down its columns, one element a thread a row apart. Here:
//   RowAbsMax      the row kernel (row_launch.cuh): the row's elements as vectors over
//                  the warp or block, a reduction in which a NaN wins, as max_abs's
//   MaxOf          one block strides over the n values, the same reduction (and
//                  Float8ScaleFromAmaxes, which then makes the scale of the maximum)
//   QuantizeFloat8 not transposing: a thread per 8 consecutive elements of a row (one
//                  16- or 32-byte load, one 8-byte store) where every row is aligned and
//                  8 divides the columns, else a thread per element; transposing: a
//                  block per 64 x 64 tile, read along x's rows into shared memory as
//                  float8 bytes, written along out's rows (x's columns)
// A maximum is exact whatever the order, and each cast is the functor's own conversion
// of the same float product, so the results are the per-index kernel's bit for bit (the
// GPU suite checks them against the CPU backend's).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/core/float8.hpp"
#include "tessera/ops/float8.hpp"

namespace tessera::cuda::detail {

/// The larger of two magnitudes, a NaN winning (ops::max_abs's rule on values already
/// made non-negative). Either order gives a NaN or the same number.
struct MaxNanOp {
  __device__ float operator()(float a, float b) const { return b > a || b != b ? b : a; }
};

template <class T>
struct RowAbsMaxRows : WarpRows<T> {
  static std::int64_t length(const ops::RowAbsMax<T>& f) { return f.cols; }
  static bool aligned(const ops::RowAbsMax<T>& f) { return rows_aligned16(f.x, f.ld); }
  template <int V, bool kWarp>
  __device__ static void run(const ops::RowAbsMax<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* xr = f.x + r * f.ld;
      float m = 0;
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W];
        load_float<W>(xr, j, v);
#pragma unroll
        for (int k = 0; k < W; ++k) m = ops::max_abs(m, v[k]);
      });
      m = g.reduce(m, MaxNanOp{}, smem);
      if (g.rank() == 0) f.out[r] = m;
    }
  }
};

/// The maximum of F's n values `in`, one block: a thread's share, then the block's, then
/// F's finish (MaxOf stores it, Float8ScaleFromAmaxes makes the scale from it). (A
/// template, as every kernel in a header: each translation unit's instance is the same one.)
template <class F>
__global__ void __launch_bounds__(kMaxRowThreads) max_of_kernel(F f) {
  __shared__ float smem[32];
  float m = 0;
  for (std::int64_t i = threadIdx.x; i < f.n; i += blockDim.x) m = MaxNanOp{}(m, f.in[i]);
  m = block_reduce(m, MaxNanOp{}, smem);
  if (threadIdx.x == 0) f.finish(m);
}

/// OpKernel for MaxOf and Float8ScaleFromAmaxes (launched with n = 1, their one index).
template <class F>
struct MaxOfKernel {
  static void launch(std::int64_t, const F& f, cudaStream_t stream) {
    max_of_kernel<F><<<1, kMaxRowThreads, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

/// Elements a thread casts in the row-vector kernel.
inline constexpr int kQuantizeRun = 8;

/// Not transposing, rows of vectors: thread t casts elements [8 u, 8 u + 8) of row r,
/// u = t mod (cols / 8), r = t / (cols / 8); every row 16-byte aligned, 8 | cols.
template <class T, class F>
__global__ void __launch_bounds__(kElementwiseThreads) quantize_rows_kernel(ops::QuantizeFloat8<T, F> f) {
  const std::int64_t runs = f.cols / kQuantizeRun, total = f.rows * runs;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < total; t += stride) {
    const std::int64_t r = t / runs, c = (t - r * runs) * kQuantizeRun;
    float v[kQuantizeRun];
    load_float<kQuantizeRun>(f.x + r * f.ld, c, v);
    F q[kQuantizeRun];
#pragma unroll
    for (int k = 0; k < kQuantizeRun; ++k) q[k] = F(v[k] * f.scale[ops::float8_scale_index(f.axis, r, c + k)]);
    store_elements<kQuantizeRun>(f.out + r * f.cols, c, q);
  }
}

/// Transposing tiles: TILE x TILE elements of x a block.
inline constexpr int kQuantizeTile = 64;
inline constexpr int kQuantizeTileThreads = 256;

/// Block (bx, by) casts x's rows [64 by, +64) and columns [64 bx, +64): each thread
/// reads 16 elements along x's rows (a warp: 32 neighbours of one row) and keeps their
/// float8 bytes in shared memory, then writes 16 along out's rows (a warp: 32
/// neighbouring bytes of one of x's columns). Tiles past the edge skip what lies outside.
template <class T, class F>
__global__ void __launch_bounds__(kQuantizeTileThreads) quantize_transposed_kernel(ops::QuantizeFloat8<T, F> f) {
  constexpr int kTile = kQuantizeTile, kPerThread = kTile * kTile / kQuantizeTileThreads;
  // A row of the tile padded by 4 bytes: a warp reading down a column touches 32 banks.
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile, c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll 4
  for (int k = 0; k < kPerThread; ++k) {
    const int e = k * kQuantizeTileThreads + t, rr = e / kTile, cc = e % kTile;
    const std::int64_t r = r0 + rr, c = c0 + cc;
    if (r < f.rows && c < f.cols)
      tile[rr][cc] = F(static_cast<float>(to_accum(f.x[r * f.ld + c])) * f.scale[ops::float8_scale_index(f.axis, r, c)]).bits;
  }
  __syncthreads();
#pragma unroll 4
  for (int k = 0; k < kPerThread; ++k) {
    const int e = k * kQuantizeTileThreads + t, cc = e / kTile, rr = e % kTile;
    const std::int64_t r = r0 + rr, c = c0 + cc;
    if (r < f.rows && c < f.cols) f.out[c * f.rows + r] = F::from_bits(tile[rr][cc]);
  }
}

/// OpKernel for QuantizeFloat8: the tiles when transposing, else rows of vectors where
/// they fit, else a thread per element.
template <class T, class F>
struct QuantizeFloat8Kernel {
  static void launch(std::int64_t n, const ops::QuantizeFloat8<T, F>& f, cudaStream_t stream) {
    if (f.transpose) {
      const std::int64_t bx = (f.cols + kQuantizeTile - 1) / kQuantizeTile, by = (f.rows + kQuantizeTile - 1) / kQuantizeTile;
      TESSERA_CHECK(by <= 65535 && bx <= 2147483647, "QuantizeFloat8: ", f.rows, " x ", f.cols,
                    " is past the tiled cast's grid");
      quantize_transposed_kernel<T, F><<<dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by)),
                                         kQuantizeTileThreads, 0, stream>>>(f);
    } else if (f.cols % kQuantizeRun == 0 && rows_aligned16(f.x, f.ld) && aligned16(f.out)) {
      const std::int64_t threads = f.rows * (f.cols / kQuantizeRun);
      const auto blocks = static_cast<unsigned>(
          std::min<std::int64_t>((threads + kElementwiseThreads - 1) / kElementwiseThreads, 65535));
      quantize_rows_kernel<T, F><<<blocks, kElementwiseThreads, 0, stream>>>(f);
    } else {
      for_each(n, f, stream);
      return;
    }
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
