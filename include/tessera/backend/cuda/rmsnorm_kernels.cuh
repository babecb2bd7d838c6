// RMSNorm's kernels (ops/rmsnorm.hpp).
//
//   RmsNormForward, RmsNormBackwardInput  row kernels (row_launch.cuh): a row per warp
//                                         when it has at most 1024 elements, else a row
//                                         per block; the forward's row amax of y (for a
//                                         float8 cast of it), where asked, a reduction
//                                         over the row's threads of the values as stored
//   RmsNormBackwardWeight                 two kernels: blocks of 8 warps, each block a
//                                         chunk of rows times 32 V columns (warp w the
//                                         chunk's rows w, w + 8, ...), writing one
//                                         partial sum per (chunk, column) to scratch;
//                                         then blocks of 8 warps per 32 columns add the
//                                         chunks' partials (warp w chunks w, w + 8, ...)
//                                         and add the total into dw
//
//   RmsNormBackward                       both passes, x and dy read once: a block per
//                                         chunk of 16 rows (ops::RmsNormBackward::
//                                         kRowsPerPartial), each thread up to 2 vectors of
//                                         every row (its columns fixed), the row's dot
//                                         product a block sum, dx written, and the
//                                         thread's column sums kept in registers over the
//                                         chunk's rows in order, then written as the
//                                         chunk's partial sums; RmsNormBackwardWeight's
//                                         second kernel adds them into dw. Rows of at most
//                                         2048 vectors, every row 16-byte aligned and a
//                                         whole number of vectors; other shapes take the
//                                         two launches
//
// RmsNormBackwardWeight's chunks are at least 128 rows, and at most 1024 of them.
//
// Scratch. RmsNormBackwardWeight takes (chunks, n) floats from the device's caching
// allocator (memory.hpp), given back when the launch returns; the allocator reuses
// blocks in compute-stream order, so on any other stream the compute stream is made to
// wait for the launch first.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernel_layouts.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/ops/math.hpp"
#include "tessera/ops/rmsnorm.hpp"

namespace tessera::cuda::detail {

template <class T>
struct RmsNormForwardRows : WarpRows<T> {
  static std::int64_t length(const ops::RmsNormForward<T>& f) { return f.n; }
  static bool aligned(const ops::RmsNormForward<T>& f) {
    return rows_aligned16(f.x, f.ldx) && rows_aligned16(f.y, f.ldy) && aligned16(f.w);
  }
  template <int V, bool kWarp>
  __device__ static void run(const ops::RmsNormForward<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    const float eps = to_float(f.eps);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* xr = f.x + r * f.ldx;
      T* yr = f.y + r * f.ldy;
      float ss = 0;
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float x[W];
        load_float<W>(xr, j, x);
#pragma unroll
        for (int k = 0; k < W; ++k) ss += x[k] * x[k];
      });
      ss = g.reduce(ss, SumOp{}, smem);
      const float rs = 1.0f / ops::sqrt_(ss / static_cast<float>(f.n) + eps);
      if (g.rank() == 0) f.rstd[r] = from_float<pointee_t<decltype(f.rstd)>>(rs);
      float m = 0;  // the row's amax of y as stored, where f.y_amax asks for it
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float x[W], w[W];
        load_float<W>(xr, j, x);
        load_float<W>(f.w, j, w);
        T y[W];
#pragma unroll
        for (int k = 0; k < W; ++k) y[k] = from_float<T>(w[k] * (x[k] * rs));
        store_elements<W>(yr, j, y);
        if (f.y_amax != nullptr) {
#pragma unroll
          for (int k = 0; k < W; ++k) m = ops::max_abs(m, to_float(y[k]));
        }
      });
      if (f.y_amax != nullptr) {  // the same for every thread of the group: all reduce
        m = g.reduce(m, MaxNanOp{}, smem);
        if (g.rank() == 0) f.y_amax[r] = m;
      }
    }
  }
};

template <class T>
struct RmsNormBackwardInputRows : WarpRows<T> {
  static std::int64_t length(const ops::RmsNormBackwardInput<T>& f) { return f.n; }
  static bool aligned(const ops::RmsNormBackwardInput<T>& f) {
    return rows_aligned16(f.x, f.ldx) && rows_aligned16(f.dy, f.lddy) && rows_aligned16(f.dx, f.lddx) &&
           aligned16(f.w) && (f.residual == nullptr || rows_aligned16(f.residual, f.ldres));
  }
  template <int V, bool kWarp>
  __device__ static void run(const ops::RmsNormBackwardInput<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* xr = f.x + r * f.ldx;
      const T* dyr = f.dy + r * f.lddy;
      T* dxr = f.dx + r * f.lddx;
      const T* resr = f.residual != nullptr ? f.residual + r * f.ldres : nullptr;
      const float rs = to_float(f.rstd[r]);
      float dot = 0;
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float x[W], w[W], dy[W];
        load_float<W>(xr, j, x);
        load_float<W>(f.w, j, w);
        load_float<W>(dyr, j, dy);
#pragma unroll
        for (int k = 0; k < W; ++k) dot += w[k] * dy[k] * x[k];
      });
      dot = g.reduce(dot, SumOp{}, smem);
      const float c = rs * rs * rs * dot / static_cast<float>(f.n);
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float x[W], w[W], dy[W], dx[W];
        load_float<W>(xr, j, x);
        load_float<W>(f.w, j, w);
        load_float<W>(dyr, j, dy);
#pragma unroll
        for (int k = 0; k < W; ++k) dx[k] = rs * w[k] * dy[k] - c * x[k];
        if (resr != nullptr) {  // the residual's gradient, added before the one rounding
          float res[W];
          load_float<W>(resr, j, res);
#pragma unroll
          for (int k = 0; k < W; ++k) dx[k] = __fadd_rn(dx[k], res[k]);
        }
        store_float<W>(dxr, j, dx);
      });
    }
  }
};

/// Rows per partial sum of the weight gradient: at least this many, and few enough
/// that there are at most kWeightMaxChunks chunks.
inline constexpr std::int64_t kWeightChunkRows = 128;
inline constexpr std::int64_t kWeightMaxChunks = 1024;
/// Warps of a partial-sum block; warp w takes rows w, w + 8, ... of the chunk.
inline constexpr int kWeightWarps = 8;

/// partial[c * n + j] = sum over the rows of chunk c of dy[r, j] x[r, j] rstd[r], for
/// the columns of the block's tiles of 32 V columns (lane l: columns l V .. l V + V - 1).
/// Each thread adds its rows in order, then the 8 warps' sums are added in warp order.
template <class T, int V>
__global__ void __launch_bounds__(32 * kWeightWarps)
    rmsnorm_weight_partials(ops::RmsNormBackwardWeight<T> f, std::int64_t n, std::int64_t chunk_rows,
                            float* partial) {
  constexpr int kTile = 32 * V;
  __shared__ float sums[kWeightWarps][kTile];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t r0 = chunk * chunk_rows, r1 = f.rows < r0 + chunk_rows ? f.rows : r0 + chunk_rows;
  const std::int64_t tiles = (n + kTile - 1) / kTile;
  for (std::int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const std::int64_t j = tile * kTile + lane * V;
    float acc[V] = {};
    if (j + V <= n) {
#pragma unroll 4
      for (std::int64_t r = r0 + warp; r < r1; r += kWeightWarps) {
        const float rs = to_float(f.rstd[r]);
        float dy[V], x[V];
        load_float<V>(f.dy + r * f.lddy, j, dy);
        load_float<V>(f.x + r * f.ldx, j, x);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += dy[k] * x[k] * rs;
      }
    } else if (j < n) {  // the last columns, fewer than V
      for (std::int64_t r = r0 + warp; r < r1; r += kWeightWarps) {
        const float rs = to_float(f.rstd[r]);
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (j + k < n) acc[k] += to_float(f.dy[r * f.lddy + j + k]) * to_float(f.x[r * f.ldx + j + k]) * rs;
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) sums[warp][lane * V + k] = acc[k];
    __syncthreads();
    for (int c = static_cast<int>(threadIdx.x); c < kTile; c += static_cast<int>(blockDim.x)) {
      float s = sums[0][c];
#pragma unroll
      for (int w = 1; w < kWeightWarps; ++w) s += sums[w][c];
      const std::int64_t col = tile * kTile + c;
      if (col < n) partial[chunk * n + col] = s;
    }
    __syncthreads();  // sums is rewritten by the next tile
  }
}

/// dw[j] += the sum of partial[c * n + j] over the chunks c (dw[j] = it, without f.add): a block of 8 warps per 32
/// columns (lane l: column 32 b + l), warp w adding chunks w, w + 8, ... in order, then
/// the 8 warps' sums added in warp order.
template <class T>
__global__ void __launch_bounds__(32 * kWeightWarps)
    rmsnorm_weight_sum(ops::RmsNormBackwardWeight<T> f, std::int64_t n, std::int64_t chunks,
                       const float* partial) {
  using D = pointee_t<decltype(f.dw)>;
  __shared__ float sums[kWeightWarps][32];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t tiles = (n + 31) / 32;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t j = tile * 32 + lane;
    float s = 0;
    if (j < n) {
#pragma unroll 4
      for (std::int64_t c = warp; c < chunks; c += kWeightWarps) s += partial[c * n + j];
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && j < n) {
      float total = sums[0][lane];
#pragma unroll
      for (int w = 1; w < kWeightWarps; ++w) total += sums[w][lane];
      f.dw[j] = f.add ? from_float<D>(to_float(f.dw[j]) + total) : from_float<D>(total);
    }
    __syncthreads();  // sums is rewritten by the next tile
  }
}

/// Makes the compute stream wait for the work issued so far to `stream`, so that a
/// scratch block freed now (the allocator reuses blocks in compute-stream order) is
/// not handed to compute work that could run before that work has read it.
inline void order_compute_after(cudaStream_t stream) {
  if (stream == compute_stream()) return;
  cudaEvent_t done = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  TESSERA_CUDA_CHECK(cudaEventRecord(done, stream));
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), done, 0));
  TESSERA_CUDA_CHECK(cudaEventDestroy(done));  // released once it has completed
}

/// OpKernel for RmsNormBackwardWeight: the partial sums into scratch, then their sum into dw.
template <class T>
struct RmsNormWeightKernel {
  static void launch(std::int64_t n, const ops::RmsNormBackwardWeight<T>& f, cudaStream_t stream) {
    const std::int64_t rows = f.rows > 0 ? f.rows : 0;
    const std::int64_t chunk_rows =
        std::max(kWeightChunkRows, (rows + kWeightMaxChunks - 1) / kWeightMaxChunks);
    const std::int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
    Buffer<float> partial = device_buffer<float>(static_cast<std::size_t>(chunks * n),
                                                 "the RMSNorm weight gradient's partial sums");
    if (chunks > 0) {
      constexpr int V = kVectorWidth<T>;
      const bool vectors = rows_aligned16(f.x, f.ldx) && rows_aligned16(f.dy, f.lddy);
      const std::int64_t tiles = (n + 32 * (vectors ? V : 1) - 1) / (32 * (vectors ? V : 1));
      const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<std::int64_t>(tiles, 65535)));
      if (vectors)
        rmsnorm_weight_partials<T, V><<<grid, 32 * kWeightWarps, 0, stream>>>(f, n, chunk_rows, partial.data());
      else
        rmsnorm_weight_partials<T, 1><<<grid, 32 * kWeightWarps, 0, stream>>>(f, n, chunk_rows, partial.data());
      TESSERA_CUDA_CHECK(cudaGetLastError());
    }
    const std::int64_t blocks = std::min<std::int64_t>((n + 31) / 32, kMaxBlocks);
    rmsnorm_weight_sum<T><<<static_cast<unsigned>(blocks), 32 * kWeightWarps, 0, stream>>>(f, n, chunks,
                                                                                        partial.data());
    TESSERA_CUDA_CHECK(cudaGetLastError());
    order_compute_after(stream);
  }
};

/// ops::RmsNormBackward on rows [blockIdx.x R, + R) (R = rows_per_block): thread t
/// holds vectors t, t + blockDim.x, ... (K of them at most) of each row, all whole.
template <class T, int V, int K>
__global__ void __launch_bounds__(kMaxRowThreads)
    rmsnorm_backward_fused(ops::RmsNormBackward<T> f, std::int64_t rows_per_block, float* partial) {
  __shared__ float smem[32];
  const ops::RmsNormBackwardInput<T>& in = f.input;
  const std::int64_t n = in.n, rows = f.weight.rows;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * rows_per_block;
  const std::int64_t r1 = rows < r0 + rows_per_block ? rows : r0 + rows_per_block;
  // Thread t's vectors (kernel_layouts.hpp, whose coverage the CPU tests check).
  const FusedNormLayout layout{n / V, static_cast<int>(blockDim.x), K};
  const int tid = static_cast<int>(threadIdx.x);
  auto column = [&](int k) { return layout.vector(tid, k) * V; };
  auto mine = [&](int k) { return layout.mine(tid, k); };
  float w[K][V], acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) acc[k][v] = 0.0f;
    if (mine(k)) load_float<V>(in.w, column(k), w[k]);
  }
  for (std::int64_t r = r0; r < r1; ++r) {
    const T* xr = in.x + r * in.ldx;
    const T* dyr = in.dy + r * in.lddy;
    float x[K][V], dy[K][V];
    float dot = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!mine(k)) continue;
      load_float<V>(xr, column(k), x[k]);
      load_float<V>(dyr, column(k), dy[k]);
#pragma unroll
      for (int v = 0; v < V; ++v) dot += w[k][v] * dy[k][v] * x[k][v];
    }
    dot = block_reduce(dot, SumOp{}, smem);
    const float rs = to_float(in.rstd[r]);
    const float c = rs * rs * rs * dot / static_cast<float>(n);
    T* dxr = in.dx + r * in.lddx;
    const T* resr = in.residual != nullptr ? in.residual + r * in.ldres : nullptr;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!mine(k)) continue;
      float dx[V];
#pragma unroll
      for (int v = 0; v < V; ++v) dx[v] = rs * w[k][v] * dy[k][v] - c * x[k][v];
      if (resr != nullptr) {  // the residual's gradient, added before the one rounding
        float res[V];
        load_float<V>(resr, column(k), res);
#pragma unroll
        for (int v = 0; v < V; ++v) dx[v] = __fadd_rn(dx[v], res[v]);
      }
      store_float<V>(dxr, column(k), dx);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[k][v] += dy[k][v] * x[k][v] * rs;
    }
  }
  float* out = partial + static_cast<std::int64_t>(blockIdx.x) * n;
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (mine(k))
#pragma unroll
      for (int v = 0; v < V; ++v) out[column(k) + v] = acc[k][v];
}

/// OpKernel for RmsNormBackward: the fused kernel where the rows allow it (see the top
/// of this file), then RmsNormBackwardWeight's sum of the chunks' partials into dw;
/// otherwise the two functors' own launches.
template <class T>
struct RmsNormBackwardKernel {
  static void launch(std::int64_t indices, const ops::RmsNormBackward<T>& f, cudaStream_t stream) {
    constexpr int V = kVectorWidth<T>;
    const ops::RmsNormBackwardInput<T>& in = f.input;
    const std::int64_t n = in.n, rows = f.weight.rows > 0 ? f.weight.rows : 0, cols = indices - rows;
    const std::int64_t per = ops::RmsNormBackward<T>::kRowsPerPartial;
    const std::int64_t chunks = (rows + per - 1) / per;
    const std::optional<FusedNormLayout> layout = fused_norm_layout(n / V, kMaxRowThreads);
    const bool fused = layout && rows > 0 && cols == n && n % V == 0 && chunks <= kMaxBlocks &&
                       RmsNormBackwardInputRows<T>::aligned(in) && f.weight.x == in.x && f.weight.dy == in.dy &&
                       f.weight.ldx == in.ldx && f.weight.lddy == in.lddy && f.weight.rstd == in.rstd;
    if (!fused) {
      if (rows > 0) RowKernel<RmsNormBackwardInputRows<T>>::launch(rows, in, stream);
      if (cols > 0) RmsNormWeightKernel<T>::launch(cols, f.weight, stream);
      return;
    }
    const int k = layout->per_thread;
    const auto threads = static_cast<unsigned>(layout->threads);
    Buffer<float> partial = device_buffer<float>(static_cast<std::size_t>(chunks * n),
                                                 "the RMSNorm weight gradient's partial sums");
    const auto grid = static_cast<unsigned>(chunks);
    if (k == 1) rmsnorm_backward_fused<T, V, 1><<<grid, threads, 0, stream>>>(f, per, partial.data());
    else rmsnorm_backward_fused<T, V, 2><<<grid, threads, 0, stream>>>(f, per, partial.data());
    TESSERA_CUDA_CHECK(cudaGetLastError());
    const std::int64_t blocks = std::min<std::int64_t>((n + 31) / 32, kMaxBlocks);
    rmsnorm_weight_sum<T><<<static_cast<unsigned>(blocks), 32 * kWeightWarps, 0, stream>>>(f.weight, n, chunks,
                                                                                        partial.data());
    TESSERA_CUDA_CHECK(cudaGetLastError());
    order_compute_after(stream);
  }
};

}  // namespace tessera::cuda::detail
