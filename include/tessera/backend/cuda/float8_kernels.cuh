// The float8 casts' kernels (ops/float8.hpp): RowAbsMax and CastRowsFloat8, a row per
// warp or block; ColumnAbsMax, chunks of rows times 32 columns; MaxOf and
// Float8ScaleFromAmaxes, one block; QuantizeFloat8, rows of vectors or, transposing,
// tiles; Float8Transpose, tiles.
//
// Per index, RowAbsMax walks a whole row in one thread and MaxOf walks every row's amax
// in one thread (a single thread over 8192 values), and a transposing QuantizeFloat8
// (or Float8Transpose) reads x down its columns, one element a thread a row apart. Here:
//   RowAbsMax      the row kernel (row_launch.cuh): the row's elements as vectors over
//                  the warp or block, a reduction in which a NaN wins, as max_abs's
//   MaxOf          one block strides over the n values, the same reduction (and
//                  Float8ScaleFromAmaxes, which then makes the scale of the maximum)
//   RowAbsMaxScale RowAbsMax's row kernel, then the block that finishes last makes the
//                  scale as MaxOf's block does (a tensorwise cast's amax in one launch)
//   CastRowsFloat8 RowAbsMax's row kernel, then each thread makes the row's scale and
//                  casts its share of the row again, read from cache (a cast by rows in
//                  one launch, x read from memory once)
//   QuantizeFloat8 not transposing: a thread per 8 consecutive elements of a row (one
//                  16- or 32-byte load, one 8-byte store) where every row is aligned and
//                  8 divides the columns, else a thread per element; transposing: a
//                  block per 64 x 64 tile, read along x's rows in runs of 8 into shared
//                  memory as float8 bytes, written along out's rows (x's columns) in
//                  words of 4 (kernel_layouts.hpp's TransposeTileLayout), and the runs
//                  also stored as they are where the cast wants both layouts
//   Float8Transpose the same tiles, each run x's 8 bytes as they are (one 8-byte load)
// The conversion itself is one instruction for two elements on Ada and Hopper
// (core/float8.hpp): with it and 32-bit indices the casts are bound by memory, where
// the integer rounding and 64-bit index arithmetic held them to 13-28% of the device
// copy on an H200 (bench-kernels, 2026-12-04).
// A maximum is exact whatever the order, and each cast is the functor's own conversion
// of the same float product, so the results are the per-index kernel's bit for bit (the
// GPU suite checks them against the CPU backend's).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernel_layouts.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/core/float8.hpp"
#include "tessera/ops/float8.hpp"

namespace tessera::cuda::detail {

/// The amax of row xr (cols elements) over the group g, in every thread of it: the row's
/// vectors over the group, a reduction in which a NaN wins, as max_abs's.
template <int V, bool kWarp, class T>
__device__ float row_abs_max(const RowGroup<kWarp>& g, const T* xr, std::int64_t cols, float* smem) {
  float m = 0;
  row_loop<V>(cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_float<W>(xr, j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) m = ops::max_abs(m, v[k]);
  });
  return g.reduce(m, MaxNanOp{}, smem);
}

template <class T>
struct RowAbsMaxRows : WarpRows<T> {
  static std::int64_t length(const ops::RowAbsMax<T>& f) { return f.cols; }
  static bool aligned(const ops::RowAbsMax<T>& f) { return rows_aligned16(f.x, f.ld); }
  template <int V, bool kWarp>
  __device__ static void run(const ops::RowAbsMax<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const float m = row_abs_max<V>(g, f.x + r * f.ld, f.cols, smem);
      if (g.rank() == 0) f.out[r] = m;
    }
  }
};

/// CastRowsFloat8: a row a warp or block, its amax (row_abs_max, or the kept one), the
/// scale made by every thread alike, then the row again (from cache) multiplied and
/// converted, V elements a load and a store where every row of x is 16-byte aligned and
/// V divides the columns (out's rows then start on V-byte boundaries), else one.
template <class T, class F>
struct CastRowsFloat8Rows : WarpRows<T> {
  using Cast = ops::CastRowsFloat8<T, F>;
  static std::int64_t length(const Cast& f) { return f.cols; }
  static bool aligned(const Cast& f) {
    return rows_aligned16(f.x, f.ld) && f.cols % kVectorWidth<T> == 0 && aligned16(f.out);
  }
  template <int V, bool kWarp>
  __device__ static void run(const Cast& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* xr = f.x + r * f.ld;
      const float m = f.known != nullptr ? f.known[r] : row_abs_max<V>(g, xr, f.cols, smem);
      const float s = ops::float8_scale(m, f.format_max, f.power_of_two);
      if (g.rank() == 0) {
        f.scale[r] = s;
        f.inverse[r] = 1.0f / s;
      }
      F* out = f.out + r * f.cols;
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float v[W];
        load_float<W>(xr, j, v);
        F q[W];
#pragma unroll
        for (int k = 0; k < W; ++k) q[k] = F(v[k] * s);
        store_elements<W>(out, j, q);
      });
    }
  }
};

/// Blocks of RowAbsMaxScale kernels that have finished their rows, in this launch. Launches
/// on one stream run one after another (tessera's compute stream, a graph's replay), and
/// the block that finishes last sets it back to 0 for the next.
static __device__ unsigned int row_amax_scale_blocks_done = 0;

/// RowAbsMaxScale: RowAbsMaxRows over the rows; then each block counts itself done (its
/// amaxes made visible to the grid first), and the last reads every row's amax from L2 and
/// makes the scale as max_of_kernel does: the same maximum, the same scale, one launch.
template <class T>
struct RowAbsMaxScaleRows : WarpRows<T> {
  using F = ops::RowAbsMaxScale<T>;
  static std::int64_t length(const F& f) { return RowAbsMaxRows<T>::length(f.rows); }
  static bool aligned(const F& f) { return RowAbsMaxRows<T>::aligned(f.rows); }
  template <int V, bool kWarp>
  __device__ static void run(const F& f, std::int64_t rows, float* smem) {
    RowAbsMaxRows<T>::template run<V, kWarp>(f.rows, rows, smem);
    __shared__ bool last;
    __threadfence();  // this block's amaxes, before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&row_amax_scale_blocks_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    float m = 0;
    for (std::int64_t i = threadIdx.x; i < f.scale.n; i += blockDim.x) m = MaxNanOp{}(m, __ldcg(f.scale.in + i));
    m = block_reduce(m, MaxNanOp{}, smem);
    if (threadIdx.x == 0) {
      f.scale.finish(m);
      row_amax_scale_blocks_done = 0;
    }
  }
};

/// OpKernel for RowAbsMaxScale: the row kernel of RowAbsMaxScaleRows, its scale reading
/// the amaxes its rows write.
template <class T>
struct RowAbsMaxScaleKernel {
  static void launch(std::int64_t rows, const ops::RowAbsMaxScale<T>& f, cudaStream_t stream) {
    TESSERA_CHECK(f.scale.in == f.rows.out && f.scale.n == rows, "RowAbsMaxScale: its scale must read the ", rows,
                  " amaxes its rows write");
    RowKernel<RowAbsMaxScaleRows<T>>::launch(rows, f, stream);
  }
};

/// ColumnAbsMax: blocks of 8 warps, each 32 columns (lane l: column 32 bx + l) of a
/// chunk of 256 rows (warp w: the chunk's rows w, w + 8, ...), a warp reading 32
/// neighbours of a row; the 8 warps' maxima, then one atomic maximum a column on the
/// float's bits, out zeroed first. |x| is never negative, so its bits order as unsigned
/// integers as its values do, and a NaN's bits lie above every number's: a NaN wins, as
/// in max_abs, and the maximum is exact whatever order the chunks arrive in. (Per
/// index, a thread walked its whole column alone: as many threads as columns, each
/// 8192 dependent loads deep, 0.55x the bf16 step at 1B with rowwise scales on an
/// H200, 2026-12-04.)
inline constexpr int kColumnMaxWarps = 8;
inline constexpr std::int64_t kColumnMaxChunk = 256;

template <class T>
__global__ void __launch_bounds__(32 * kColumnMaxWarps) column_abs_max_kernel(ops::ColumnAbsMax<T> f, std::int64_t cols) {
  __shared__ float maxima[kColumnMaxWarps][32];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + lane;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kColumnMaxChunk;
  const std::int64_t r1 = f.rows < r0 + kColumnMaxChunk ? f.rows : r0 + kColumnMaxChunk;
  float m = 0;
  if (c < cols) {
#pragma unroll 8
    for (std::int64_t r = r0 + warp; r < r1; r += kColumnMaxWarps)
      m = ops::max_abs(m, static_cast<float>(to_accum(f.x[r * f.ld + c])));
  }
  maxima[warp][lane] = m;
  __syncthreads();
  if (warp == 0 && c < cols) {
#pragma unroll
    for (int w = 1; w < kColumnMaxWarps; ++w) m = MaxNanOp{}(m, maxima[w][lane]);
    atomicMax(reinterpret_cast<unsigned*>(f.out) + c, __float_as_uint(m));
  }
}

/// OpKernel for ColumnAbsMax (n: the columns).
template <class T>
struct ColumnAbsMaxKernel {
  static void launch(std::int64_t cols, const ops::ColumnAbsMax<T>& f, cudaStream_t stream) {
    if (cols <= 0) return;
    TESSERA_CUDA_CHECK(cudaMemsetAsync(f.out, 0, static_cast<std::size_t>(cols) * sizeof(float), stream));
    if (f.rows <= 0) return;
    const std::int64_t chunks = (f.rows + kColumnMaxChunk - 1) / kColumnMaxChunk, groups = (cols + 31) / 32;
    TESSERA_CHECK(chunks <= 65535 && groups <= 2147483647, "ColumnAbsMax: ", f.rows, " x ", cols,
                  " is past the column maxima's grid");
    column_abs_max_kernel<T><<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(chunks)),
                               32 * kColumnMaxWarps, 0, stream>>>(f, cols);
    TESSERA_CUDA_CHECK(cudaGetLastError());
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

/// Elements a thread casts in the row-vector kernel, and reads at once in the tiles.
inline constexpr int kQuantizeRun = 8;

/// Not transposing, rows of vectors: thread t casts elements [8 u, 8 u + 8) of row r,
/// u = t mod (cols / 8), r = t / (cols / 8); every row 16-byte aligned, 8 | cols. I, the
/// index type: 32 bits where the runs and the grid's stride fit (a 64-bit division per
/// run cost as much as the cast of its 8 elements).
template <class T, class F, class I>
__global__ void __launch_bounds__(kElementwiseThreads) quantize_rows_kernel(ops::QuantizeFloat8<T, F> f) {
  const I runs = static_cast<I>(f.cols / kQuantizeRun), total = static_cast<I>(f.rows) * runs;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I t = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const I r = t / runs, c = (t - r * runs) * kQuantizeRun;
    float v[kQuantizeRun];
    load_float<kQuantizeRun>(f.x + static_cast<std::int64_t>(r) * f.ld, c, v);
    F q[kQuantizeRun];
#pragma unroll
    for (int k = 0; k < kQuantizeRun; ++k) q[k] = F(v[k] * f.scale[ops::float8_scale_index(f.axis, r, c + k)]);
    store_elements<kQuantizeRun>(f.out + static_cast<std::int64_t>(r) * f.cols, c, q);
  }
}

/// Transposing tiles: TILE x TILE elements of x a block.
inline constexpr int kQuantizeTile = 64;
inline constexpr int kQuantizeTileThreads = 256;
/// Bytes of a row of the tile in shared memory: padded by one word, so that the 32
/// lanes reading down a column (rows 4 apart) touch 8 banks each once, twice at most.
inline constexpr int kQuantizeTilePitch = kQuantizeTile + 4;

/// One 64 x 64 tile of a transposing kernel, block (bx, by): x's rows [64 by, +64) and
/// columns [64 bx, +64) (x: rows x cols) as TransposeTileLayout says. Each thread takes
/// runs of 8 elements along x's rows as their float8 bytes (`run(r, c, bytes)`, columns
/// past the edge as 0) and keeps them in shared memory, then writes words of 4 bytes along
/// out's rows (x's columns: out is cols x rows; one 4-byte store where kWords: 4 | rows,
/// out 4-byte aligned). Tiles past the edge skip what lies outside.
template <bool kWords, class Run>
__device__ void transposed_tile(const Run& run, std::int64_t rows, std::int64_t cols, std::uint8_t* out) {
  constexpr int kTile = kQuantizeTile, kPitch = kQuantizeTilePitch, kRun = kQuantizeRun;
  constexpr TransposeTileLayout kLayout{kTile, kQuantizeTileThreads, kRun};
  __shared__ __align__(16) std::uint8_t tile[kTile * kPitch];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile, c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int k = 0; k < kLayout.reads(); ++k) {
    const int rr = kLayout.read_row(t, k), cc = kLayout.read_column(t, k);
    const std::int64_t r = r0 + rr, c = c0 + cc;
    if (r >= rows || c >= cols) continue;
    std::uint8_t b[kRun];
    run(r, c, b);
    std::uint32_t word[kRun / 4];
    memcpy(word, b, kRun);
#pragma unroll
    for (int i = 0; i < kRun / 4; ++i) reinterpret_cast<std::uint32_t*>(tile + rr * kPitch + cc)[i] = word[i];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kLayout.writes(); ++k) {
    const int cc = kLayout.write_column(t, k), rr = kLayout.write_row(t, k);
    const std::int64_t c = c0 + cc, r = r0 + rr;
    if (c >= cols || r >= rows) continue;
    std::uint8_t b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = tile[(rr + i) * kPitch + cc];
    std::uint8_t* o = out + c * rows + r;
    if (kWords && r + 4 <= rows) {
      std::uint32_t word;
      memcpy(&word, b, 4);
      *reinterpret_cast<std::uint32_t*>(o) = word;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (r + i < rows) o[i] = b[i];
    }
  }
}

/// The transposing cast: each run of x cast to float8 (one 16- or 32-byte load where
/// kVectors: every row 16-byte aligned, 8 | cols), by transposed_tile; where f.straight,
/// the run's bytes also stored there as x lies (one 8-byte store where kVectors: straight
/// 8-byte aligned too), the 8 threads along a tile's row writing 64 neighbouring bytes.
template <class T, class F, bool kVectors, bool kWords>
__global__ void __launch_bounds__(kQuantizeTileThreads) quantize_transposed_kernel(ops::QuantizeFloat8<T, F> f) {
  constexpr int kRun = kQuantizeRun;
  auto* straight = reinterpret_cast<std::uint8_t*>(f.straight);
  const auto run = [&f, straight](std::int64_t r, std::int64_t c, std::uint8_t* b) {
    if constexpr (kVectors) {  // 8 | cols: the run is whole
      float v[kRun];
      load_float<kRun>(f.x + r * f.ld, c, v);
#pragma unroll
      for (int w = 0; w < kRun; ++w) b[w] = F(v[w] * f.scale[ops::float8_scale_index(f.axis, r, c + w)]).bits;
      if (straight != nullptr) {
        std::uint64_t word;
        memcpy(&word, b, kRun);
        *reinterpret_cast<std::uint64_t*>(straight + r * f.cols + c) = word;
      }
    } else {
#pragma unroll
      for (int w = 0; w < kRun; ++w) b[w] = c + w < f.cols ? f.element(r, c + w).bits : std::uint8_t{0};
      if (straight != nullptr)
#pragma unroll
        for (int w = 0; w < kRun; ++w)
          if (c + w < f.cols) straight[r * f.cols + c + w] = b[w];
    }
  };
  static_assert(sizeof(F) == 1, "a float8 value is its byte");
  transposed_tile<kWords>(run, f.rows, f.cols, reinterpret_cast<std::uint8_t*>(f.out));
}

/// Float8Transpose: each run of x's bytes copied (one 8-byte load where kVectors: x
/// 8-byte aligned, 8 | cols), by transposed_tile.
template <class F, bool kVectors, bool kWords>
__global__ void __launch_bounds__(kQuantizeTileThreads) float8_transpose_kernel(ops::Float8Transpose<F> f) {
  static_assert(sizeof(F) == 1, "a float8 value is its byte");
  constexpr int kRun = kQuantizeRun;
  const auto* in = reinterpret_cast<const std::uint8_t*>(f.in);
  const auto run = [&f, in](std::int64_t r, std::int64_t c, std::uint8_t* b) {
    const std::uint8_t* row = in + r * f.cols;
    if constexpr (kVectors) {  // 8 | cols: the run is whole, and 8-byte aligned
      const std::uint64_t v = *reinterpret_cast<const std::uint64_t*>(row + c);
      memcpy(b, &v, kRun);
    } else {
#pragma unroll
      for (int w = 0; w < kRun; ++w) b[w] = c + w < f.cols ? row[c + w] : std::uint8_t{0};
    }
  };
  transposed_tile<kWords>(run, f.rows, f.cols, reinterpret_cast<std::uint8_t*>(f.out));
}

/// The grid of transposed_tile's blocks over rows x cols (`what` names the kernel).
inline dim3 transposed_tiles_grid(std::int64_t rows, std::int64_t cols, const char* what) {
  const std::int64_t bx = (cols + kQuantizeTile - 1) / kQuantizeTile, by = (rows + kQuantizeTile - 1) / kQuantizeTile;
  TESSERA_CHECK(by <= 65535 && bx <= 2147483647, what, ": ", rows, " x ", cols, " is past the tiled transpose's grid");
  return dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by));
}

/// OpKernel for QuantizeFloat8: the tiles when transposing, else rows of vectors where
/// they fit, else a thread per element.
template <class T, class F>
struct QuantizeFloat8Kernel {
  template <bool kVectors, bool kWords>
  static void tiles(const ops::QuantizeFloat8<T, F>& f, dim3 grid, cudaStream_t stream) {
    quantize_transposed_kernel<T, F, kVectors, kWords><<<grid, kQuantizeTileThreads, 0, stream>>>(f);
  }
  static void launch(std::int64_t n, const ops::QuantizeFloat8<T, F>& f, cudaStream_t stream) {
    TESSERA_CHECK(f.straight == nullptr || f.transpose,
                  "QuantizeFloat8: the values written in x's own layout as well need a transposing cast");
    if (f.transpose) {
      const dim3 grid = transposed_tiles_grid(f.rows, f.cols, "QuantizeFloat8");
      const bool vectors = f.cols % kQuantizeRun == 0 && rows_aligned16(f.x, f.ld) &&
                           reinterpret_cast<std::uintptr_t>(f.straight) % 8 == 0;
      const bool words = f.rows % 4 == 0 && reinterpret_cast<std::uintptr_t>(f.out) % 4 == 0;
      if (vectors && words) tiles<true, true>(f, grid, stream);
      else if (vectors) tiles<true, false>(f, grid, stream);
      else if (words) tiles<false, true>(f, grid, stream);
      else tiles<false, false>(f, grid, stream);
    } else if (f.cols % kQuantizeRun == 0 && rows_aligned16(f.x, f.ld) && aligned16(f.out)) {
      const std::int64_t runs = f.rows * (f.cols / kQuantizeRun);
      const auto blocks = static_cast<unsigned>(
          std::min<std::int64_t>((runs + kElementwiseThreads - 1) / kElementwiseThreads, 65535));
      // 32-bit indices where the last run plus the grid's stride stays under 2^31.
      if (runs + std::int64_t{blocks} * kElementwiseThreads < (std::int64_t{1} << 31))
        quantize_rows_kernel<T, F, std::uint32_t><<<blocks, kElementwiseThreads, 0, stream>>>(f);
      else
        quantize_rows_kernel<T, F, std::int64_t><<<blocks, kElementwiseThreads, 0, stream>>>(f);
    } else {
      for_each(n, f, stream);
      return;
    }
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

/// OpKernel for Float8Transpose: transposed_tile's blocks, as the transposing cast's.
template <class F>
struct Float8TransposeKernel {
  template <bool kVectors, bool kWords>
  static void tiles(const ops::Float8Transpose<F>& f, dim3 grid, cudaStream_t stream) {
    float8_transpose_kernel<F, kVectors, kWords><<<grid, kQuantizeTileThreads, 0, stream>>>(f);
  }
  static void launch(std::int64_t, const ops::Float8Transpose<F>& f, cudaStream_t stream) {
    const dim3 grid = transposed_tiles_grid(f.rows, f.cols, "Float8Transpose");
    const bool vectors = f.cols % kQuantizeRun == 0 && reinterpret_cast<std::uintptr_t>(f.in) % 8 == 0;
    const bool words = f.rows % 4 == 0 && reinterpret_cast<std::uintptr_t>(f.out) % 4 == 0;
    if (vectors && words) tiles<true, true>(f, grid, stream);
    else if (vectors) tiles<true, false>(f, grid, stream);
    else if (words) tiles<false, true>(f, grid, stream);
    else tiles<false, false>(f, grid, stream);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
