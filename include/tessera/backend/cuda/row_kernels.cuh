// The ops/ functors lowered to kernels of their own on CUDA: a row per warp or per
// block with reductions across its threads, elementwise ops with 16-byte vector loads.
//
// A functor's operator()(i) says what one index computes; cuda::for_each (launch.cuh)
// runs it one index per thread. That is right for an elementwise op, but a row functor
// then walks a whole row (up to 128256 logits) in one thread, and RmsNormBackwardWeight
// walks every row for one column. Here each such functor gets a kernel with the same
// semantics as its operator() over all indices. cuda::OpKernel<F> is specialised for
// each lowered functor type; cuda::launch_op(n, f, stream) launches OpKernel<F> where
// one exists and for_each's per-index kernel otherwise (other functors, and element
// types other than float and bf16). Cuda::for_each (cuda.hpp) calls launch_op, so the
// layers get these kernels without knowing.
//
// Lowered, with their launch shapes (V = 16 / sizeof(T): 4 floats or 8 bf16 per load):
//
//   RmsNormForward, RmsNormBackwardInput,     one row per warp (8 rows in a block of 256)
//   CausalSoftmaxForward, CausalSoftmaxRecompute,  when the row has at most 1024
//   CausalSoftmaxBackward, RowDot             elements, else one row per block of
//                                             64..1024 threads (the power of two that
//                                             gives each thread about 4 vectors)
//   CrossEntropyRow, CrossEntropyShardMax,    one row per block, sized as above (a
//   CrossEntropyShardExp, CrossEntropyShardGrad  vocabulary row of 128256 gets 1024)
//   RmsNormBackwardWeight                     two kernels: blocks of 8 warps, each block
//                                             a chunk of rows times 32 V columns (warp w
//                                             the chunk's rows w, w + 8, ...), writing one
//                                             partial sum per (chunk, column) to scratch;
//                                             then blocks of 8 warps per 32 columns add
//                                             the chunks' partials (warp w chunks w, w + 8,
//                                             ...) and add the total into dw
//   SwiGluForward, SwiGluBackward, Add, Copy, grid-stride over V-element vectors, 256
//   Axpy, Scale, Fill                         threads a block; the last n % V elements
//                                             by the functor itself
//   RopeRotate                                grid-stride, one thread per V pairs
//                                             (i, i + head_dim / 2) of one head of a row
//   AdamWMultiStep                            one block of 256 threads per kAdamWBlock
//                                             indices, thread l indices l, l + 256, ...:
//                                             its 8 elements loaded, then updated
//   SquaredNormChunks                         one block of ops::kNormLanes threads per
//                                             chunk of the gradient norm, in the lane
//                                             order ops/norm.hpp defines: the CPU
//                                             backend's sum bit for bit
//
// Arithmetic. Sums, maxima and the statistics are kept in float whatever T is (bf16 is
// converted on load and rounded once on store, to nearest even as bf16(float) does);
// the per-element expressions are the functors' own. The elementwise kernels and RoPE
// do not restate the arithmetic at all: they load a vector into registers, point a copy
// of the functor at those registers and call its operator() for each element. As the
// functors do, the float cross-entropy and softmax kernels keep exp(z - max) in the row
// between passes, while a bf16 row keeps its logits until the last pass computes the
// exponentials again, so that each output is rounded once (CrossEntropyShardExp then
// leaves a bf16 row holding its logits, and CrossEntropyShardGrad starts from them).
//
// Passes. A row kernel makes the functor's passes over the row in the functor's order
// (e.g. cross-entropy: max, then exp and its sum, then the gradient), each pass a strided
// loop of the row's threads over its vectors, each reduction a warp shuffle tree then,
// in block mode, one partial per warp in shared memory added in warp order by every
// thread. Only the order of the additions differs from the functor's sequential loop,
// so results agree with the CPU backend to rounding, not bit for bit.
//
// Alignment rule. The vector path is taken when every row the kernel touches starts on
// a 16-byte boundary: each base pointer 16-byte aligned and each leading dimension
// times sizeof(T) a multiple of 16 (for RoPE also head_dim a multiple of 2 V, for the
// elementwise ops every pointer aligned). The row's last n % V elements then go through
// a scalar tail. Otherwise the same kernel runs with scalar loads (V = 1). The launcher
// decides on the host, per launch.
//
// Determinism. No atomics: every output element and every statistic has one owner that
// adds its terms in a fixed order, and that order follows from the launch shape, which
// is a function of the sizes, the element type and whether the alignment rule holds,
// never of the device or of the scheduling. Two runs on the same inputs give bitwise
// the same results (the same data placed with another alignment may round differently).
// RmsNormBackwardWeight's chunks are at least 128 rows, and at most 1024 of them.
//
// Scratch. RmsNormBackwardWeight takes (chunks, n) floats from the device's caching
// allocator (memory.hpp), given back when the launch returns; the allocator reuses
// blocks in compute-stream order, so on any other stream the compute stream is made to
// wait for the launch first.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/norm.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/ops/rope.hpp"
#include "tessera/ops/softmax.hpp"
#include "tessera/ops/swiglu.hpp"

namespace tessera::cuda {

/// A functor's own kernel: specialisations have
///   static void launch(std::int64_t n, const F& f, cudaStream_t stream)
/// which computes f(i) for every i in [0, n), n > 0. The primary template has none.
template <class F>
struct OpKernel {};

/// Whether F has a kernel of its own (an OpKernel<F> with launch).
template <class F>
concept HasOpKernel = requires(std::int64_t n, const F& f, cudaStream_t stream) { OpKernel<F>::launch(n, f, stream); };

namespace detail {

// ---- Element types and conversions ------------------------------------------------

/// Element types whose functors are lowered here; others run one index per thread.
template <class T>
inline constexpr bool kLoweredElement = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

/// Whether a row kernel keeps float intermediates in a row of T (float), or recomputes
/// them so that each output is rounded once (bf16): the functors' own rule.
template <class T>
inline constexpr bool kRowHoldsIntermediates = ops::detail::accum_is_storage<T>;

/// Elements of U in one 16-byte vector.
template <class U>
inline constexpr int kVectorWidth = static_cast<int>(16 / sizeof(U));

/// The element type a pointer field points to, without const.
template <class P>
using pointee_t = std::remove_cv_t<std::remove_pointer_t<P>>;

template <class U>
__device__ __forceinline__ float to_float(U v) {
  return static_cast<float>(v);
}

/// v stored as U: rounded to nearest even for bf16.
template <class U>
__device__ __forceinline__ U from_float(float v) {
  if constexpr (std::is_same_v<U, bf16>) return bf16(v);
  else return static_cast<U>(v);
}

// ---- Vector loads and stores --------------------------------------------------------
//
// Every access names a base pointer and an element index j. For W == 1 it is one
// scalar access; otherwise j is a multiple of W, W * sizeof(U) a multiple of 16 and
// base 16-byte aligned (the launcher checked), and the access is W * sizeof(U) / 16
// 16-byte loads or stores. The address is formed in whole 16-byte vectors from base:
// formed as base + j, nvcc splits some of the 16-byte stores into scalar ones.

/// Elements [j, j + W) of base into out.
template <int W, class U>
__device__ __forceinline__ void load_elements(const U* base, std::int64_t j, U* out) {
  if constexpr (W == 1) {
    out[0] = base[j];
  } else {
    static_assert((W * sizeof(U)) % 16 == 0, "load_elements: a vector is whole 16-byte loads");
    constexpr int kLoads = static_cast<int>(W * sizeof(U) / 16);
    const uint4* p = reinterpret_cast<const uint4*>(base) + (j / W) * kLoads;
#pragma unroll
    for (int c = 0; c < kLoads; ++c) {
      const uint4 raw = p[c];
      memcpy(reinterpret_cast<char*>(out) + 16 * c, &raw, 16);
    }
  }
}

/// in to elements [j, j + W) of base.
template <int W, class U>
__device__ __forceinline__ void store_elements(U* base, std::int64_t j, const U* in) {
  if constexpr (W == 1) {
    base[j] = in[0];
  } else {
    static_assert((W * sizeof(U)) % 16 == 0, "store_elements: a vector is whole 16-byte stores");
    constexpr int kStores = static_cast<int>(W * sizeof(U) / 16);
    uint4* p = reinterpret_cast<uint4*>(base) + (j / W) * kStores;
#pragma unroll
    for (int c = 0; c < kStores; ++c) {
      unsigned word[4];
      memcpy(word, reinterpret_cast<const char*>(in) + 16 * c, 16);
      p[c] = make_uint4(word[0], word[1], word[2], word[3]);
    }
  }
}

/// Elements [j, j + W) of base, as float.
template <int W, class U>
__device__ __forceinline__ void load_float(const U* base, std::int64_t j, float (&out)[W]) {
  U raw[W];
  load_elements<W>(base, j, raw);
#pragma unroll
  for (int k = 0; k < W; ++k) out[k] = to_float(raw[k]);
}

/// W floats to elements [j, j + W) of base, each rounded to U.
template <int W, class U>
__device__ __forceinline__ void store_float(U* base, std::int64_t j, const float (&in)[W]) {
  U raw[W];
#pragma unroll
  for (int k = 0; k < W; ++k) raw[k] = from_float<U>(in[k]);
  store_elements<W>(base, j, raw);
}

/// Host side: whether p is 16-byte aligned (nullptr is).
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Host side: whether every row of a matrix at p with leading dimension ld starts on a
/// 16-byte boundary.
template <class U>
bool rows_aligned16(const U* p, std::int64_t ld) {
  return aligned16(p) && (static_cast<std::uint64_t>(ld) * sizeof(U)) % 16 == 0;
}

// ---- Reductions -----------------------------------------------------------------------

struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// The reduction of v over the 32 lanes of a warp, in every lane. A butterfly: each step
/// combines a lane's value with its partner's, a op b in one and b op a in the other,
/// which are the same value for + and max, so every lane ends with the same bits.
template <class Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

/// The reduction of v over the block, in every thread: warp trees, then the warps'
/// results (from shared memory, 32 floats) combined in warp order. A barrier for the
/// block: memory written before it is seen by every thread after it.
template <class Op>
__device__ float block_reduce(float v, Op op, float* smem) {
  v = warp_reduce(v, op);
  const int warp = static_cast<int>(threadIdx.x) / 32, warps = static_cast<int>(blockDim.x) / 32;
  __syncthreads();  // the previous reduction's readers are done with smem
  if (threadIdx.x % 32 == 0) smem[warp] = v;
  __syncthreads();
  float total = smem[0];
  for (int w = 1; w < warps; ++w) total = op(total, smem[w]);
  return total;
}

// ---- Rows -----------------------------------------------------------------------------

/// Rows of at most this many elements go one per warp, longer ones one per block.
inline constexpr std::int64_t kWarpRowMax = 1024;
/// Warps (rows) per block in warp mode.
inline constexpr int kWarpRowsPerBlock = 8;
/// Most threads a block of a row kernel has (one row per block); row_kernel is compiled
/// for it (__launch_bounds__), so its registers never exceed the register file's 64K
/// 32-bit registers per block at this size.
inline constexpr int kMaxRowThreads = 1024;
/// Threads per block of the elementwise kernels.
inline constexpr int kElementwiseThreads = 256;
/// Most blocks in a grid; the kernels stride over the rest.
inline constexpr std::int64_t kMaxBlocks = std::int64_t{1} << 30;

/// The threads that share one row: a warp (kWarp) or the whole block.
template <bool kWarp>
struct RowGroup {
  __device__ int rank() const { return kWarp ? static_cast<int>(threadIdx.x % 32) : static_cast<int>(threadIdx.x); }
  __device__ int size() const { return kWarp ? 32 : static_cast<int>(blockDim.x); }
  __device__ std::int64_t first_row() const {
    return kWarp ? static_cast<std::int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / 32
                 : static_cast<std::int64_t>(blockIdx.x);
  }
  __device__ std::int64_t row_stride() const {
    return static_cast<std::int64_t>(gridDim.x) * (kWarp ? kWarpRowsPerBlock : 1);
  }
  /// Every thread of the group gets op over the group's v; a barrier for the group.
  template <class Op>
  __device__ float reduce(float v, Op op, float* smem) const {
    if constexpr (kWarp) {
      __syncwarp();  // orders the lanes' memory accesses, as the block barrier does
      return warp_reduce(v, op);
    } else {
      return block_reduce(v, op, smem);
    }
  }
  /// A barrier for the group.
  __device__ void sync() const {
    if constexpr (kWarp) __syncwarp();
    else __syncthreads();
  }
};

/// Calls body(j, std::integral_constant<int, W>) for the group's share of [0, n): the
/// vectors of V elements at j = V * (rank + k * size), then (V > 1) the last n % V
/// elements one at a time (W = 1). A thread's share is the same in every pass over a
/// row of the same n, so it may read back what it wrote without a barrier.
template <int V, class Body>
__device__ __forceinline__ void row_loop(std::int64_t n, int rank, int size, Body&& body) {
  const std::int64_t vectors = n / V;
#pragma unroll 4
  for (std::int64_t v = rank; v < vectors; v += size) body(v * V, std::integral_constant<int, V>{});
  if constexpr (V > 1)
    for (std::int64_t j = vectors * V + rank; j < n; j += size) body(j, std::integral_constant<int, 1>{});
}

/// One row kernel: Body::run<V, kWarp>(f, rows, smem) over rows [0, rows).
template <class Body, int V, bool kWarp, class F>
__global__ void __launch_bounds__(kWarp ? 32 * kWarpRowsPerBlock : kMaxRowThreads)
    row_kernel(F f, std::int64_t rows) {
  __shared__ float smem[32];
  Body::template run<V, kWarp>(f, rows, smem);
}

/// How a row kernel is launched.
struct RowShape {
  bool warp;         // a row per warp (kWarpRowsPerBlock rows a block), else per block
  unsigned blocks;
  unsigned threads;
};

/// The launch for `rows` rows of n elements read `width` at a time: rows of at most
/// kWarpRowMax one per warp where allowed, else one per block of the power of two in
/// [64, 1024] threads that gives each thread about 4 vectors.
inline RowShape row_shape(std::int64_t rows, std::int64_t n, int width, bool allow_warp) {
  if (allow_warp && n <= kWarpRowMax) {
    const std::int64_t blocks = (rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock;
    return {true, static_cast<unsigned>(std::min(blocks, kMaxBlocks)), 32u * kWarpRowsPerBlock};
  }
  const std::int64_t vectors = (n + width - 1) / width;
  unsigned threads = 64;
  while (threads < kMaxRowThreads && static_cast<std::int64_t>(threads) * 4 < vectors) threads *= 2;
  return {false, static_cast<unsigned>(std::min(rows, kMaxBlocks)), threads};
}

/// Launches Body over `rows` rows of n elements of T: vector loads when `vectors`
/// (the alignment rule holds), a warp per row when allowed and the row is short.
template <class Body, class T, bool kAllowWarp, class F>
void launch_rows(const F& f, std::int64_t rows, std::int64_t n, bool vectors, cudaStream_t stream) {
  constexpr int V = kVectorWidth<T>;
  const RowShape s = row_shape(rows, n, vectors ? V : 1, kAllowWarp);
  if (vectors) {
    if constexpr (kAllowWarp)
      if (s.warp) {
        row_kernel<Body, V, true><<<s.blocks, s.threads, 0, stream>>>(f, rows);
        TESSERA_CUDA_CHECK(cudaGetLastError());
        return;
      }
    row_kernel<Body, V, false><<<s.blocks, s.threads, 0, stream>>>(f, rows);
  } else {
    if constexpr (kAllowWarp)
      if (s.warp) {
        row_kernel<Body, 1, true><<<s.blocks, s.threads, 0, stream>>>(f, rows);
        TESSERA_CUDA_CHECK(cudaGetLastError());
        return;
      }
    row_kernel<Body, 1, false><<<s.blocks, s.threads, 0, stream>>>(f, rows);
  }
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

// ---- RMSNorm ----------------------------------------------------------------------------

template <class T>
struct RmsNormForwardRows {
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
      row_loop<V>(f.n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        float x[W], w[W], y[W];
        load_float<W>(xr, j, x);
        load_float<W>(f.w, j, w);
#pragma unroll
        for (int k = 0; k < W; ++k) y[k] = w[k] * (x[k] * rs);
        store_float<W>(yr, j, y);
      });
    }
  }
};

template <class T>
struct RmsNormBackwardInputRows {
  template <int V, bool kWarp>
  __device__ static void run(const ops::RmsNormBackwardInput<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const T* xr = f.x + r * f.ldx;
      const T* dyr = f.dy + r * f.lddy;
      T* dxr = f.dx + r * f.lddx;
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

/// dw[j] += the sum of partial[c * n + j] over the chunks c: a block of 8 warps per 32
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
      f.dw[j] = from_float<D>(to_float(f.dw[j]) + total);
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

template <class T>
void launch_rmsnorm_weight(std::int64_t n, const ops::RmsNormBackwardWeight<T>& f, cudaStream_t stream) {
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

// ---- Cross-entropy --------------------------------------------------------------------

/// Writes zeros over the group's share of a row of n elements.
template <int V, bool kWarp, class T>
__device__ void zero_row(T* z, std::int64_t n, const RowGroup<kWarp>& g) {
  row_loop<V>(n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    const float zero[W] = {};
    store_float<W>(z, j, zero);
  });
}

/// The maximum of a row of n elements, in every thread of the group.
template <int V, bool kWarp, class T>
__device__ float row_max(const T* z, std::int64_t n, const RowGroup<kWarp>& g, float* smem) {
  float m = -INFINITY;
  row_loop<V>(n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_float<W>(z, j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) m = fmaxf(m, v[k]);
  });
  return g.reduce(m, MaxOp{}, smem);
}

/// The sum of exp(z - m) over a row of n elements, in every thread of the group. With
/// `keep` the row receives exp(z - m) and the sum is of the stored values.
template <int V, bool kWarp, bool kKeep, class T>
__device__ float row_exp_sum(T* z, std::int64_t n, float m, const RowGroup<kWarp>& g, float* smem) {
  float s = 0;
  row_loop<V>(n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_float<W>(z, j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      v[k] = ops::exp_nonpositive(v[k] - m);
      s += v[k];
    }
    if constexpr (kKeep) store_float<W>(z, j, v);
  });
  return g.reduce(s, SumOp{}, smem);
}

/// The gradient over a row of n elements: z <- factor * z, and at column t (if in the
/// row) minus `subtract`; with kFromLogits, z is still the logits and factor * exp(z - m)
/// is written instead (each element rounded once).
template <int V, bool kWarp, bool kFromLogits, class T>
__device__ void row_scale(T* z, std::int64_t n, float m, float factor, std::int64_t t, float subtract,
                          const RowGroup<kWarp>& g) {
  row_loop<V>(n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_float<W>(z, j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if constexpr (kFromLogits) v[k] = ops::exp_nonpositive(v[k] - m) * factor;
      else v[k] *= factor;
      if (j + k == t) v[k] -= subtract;
    }
    store_float<W>(z, j, v);
  });
}

template <class T>
struct CrossEntropyRows {
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyRow<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    const float scale = to_float(f.scale);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* z = f.logits + r * f.ld;
      const std::int32_t t = f.targets[r];
      if (t == ops::kIgnoreIndex) {
        if (g.rank() == 0) f.loss[r] = 0;
        if (f.write_grad) zero_row<V>(z, f.vocab, g);
        continue;
      }
      const float zt = to_float(z[t]);  // read before the barrier in row_max, so before any write
      const float m = row_max<V>(z, f.vocab, g, smem);
      const float sum = row_exp_sum<V, kWarp, kRowHoldsIntermediates<T>>(z, f.vocab, m, g, smem);
      if (g.rank() == 0) f.loss[r] = static_cast<double>(m + ops::log_(sum) - zt);
      // Without write_grad a float row holds exp(z - max), a bf16 row its logits.
      if (f.write_grad) row_scale<V, kWarp, !kRowHoldsIntermediates<T>>(z, f.vocab, m, scale / sum, t, scale, g);
    }
  }
};

template <class T>
struct CrossEntropyShardMaxRows {
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyShardMax<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    using M = pointee_t<decltype(f.max)>;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      if (f.targets[r] == ops::kIgnoreIndex) {
        if (g.rank() == 0) f.max[r] = from_float<M>(0.0f);
        continue;
      }
      const float m = row_max<V>(f.logits + r * f.ld, f.vocab, g, smem);
      if (g.rank() == 0) f.max[r] = from_float<M>(m);
    }
  }
};

template <class T>
struct CrossEntropyShardExpRows {
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyShardExp<T>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    using S = pointee_t<decltype(f.sums)>;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* z = f.logits + r * f.ld;
      const std::int64_t t = f.targets[r];
      if (t == ops::kIgnoreIndex) {
        if (g.rank() == 0) f.sums[2 * r] = f.sums[2 * r + 1] = from_float<S>(0.0f);
        continue;
      }
      const bool holds_target = t >= f.lo && t < f.lo + f.vocab;
      const float zt = holds_target ? to_float(z[t - f.lo]) : 0.0f;
      g.sync();  // every read of the target logit before the row is overwritten
      // A float row keeps exp(z - max) for the gradient pass; a bf16 row keeps its logits.
      const float sum = row_exp_sum<V, kWarp, kRowHoldsIntermediates<T>>(z, f.vocab, to_float(f.max[r]), g, smem);
      if (g.rank() == 0) {
        f.sums[2 * r] = from_float<S>(sum);
        f.sums[2 * r + 1] = holds_target ? from_float<S>(zt) : from_float<S>(0.0f);
      }
    }
  }
};

template <class T>
struct CrossEntropyShardGradRows {
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyShardGrad<T>& f, std::int64_t rows, float*) {
    const RowGroup<kWarp> g;
    const float scale = to_float(f.scale);
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* z = f.logits + r * f.ld;
      const std::int64_t t = f.targets[r];
      if (t == ops::kIgnoreIndex) {
        if (g.rank() == 0) f.loss[r] = 0;
        if (f.write_grad) zero_row<V>(z, f.vocab, g);
        continue;
      }
      const float sum = to_float(f.sums[2 * r]);
      if (g.rank() == 0)
        f.loss[r] = static_cast<double>(to_float(f.max[r]) + ops::log_(sum) - to_float(f.sums[2 * r + 1]));
      if (!f.write_grad) continue;
      // From the exponentials a float row holds, or from a bf16 row's logits and the max.
      row_scale<V, kWarp, !kRowHoldsIntermediates<T>>(z, f.vocab, to_float(f.max[r]), scale / sum, t - f.lo, scale,
                                                     g);
    }
  }
};

// ---- Softmax rows -----------------------------------------------------------------------

/// Keys [0, end) of row r are visible: the functors' causal bound.
__device__ __forceinline__ std::int64_t causal_end(std::int64_t r, std::int64_t offset, std::int64_t cols) {
  const std::int64_t i = r + offset;
  return i < cols - 1 ? i + 1 : cols;
}

template <class T>
struct CausalSoftmaxForwardRows {
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
struct CausalSoftmaxRecomputeRows {
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
struct CausalSoftmaxBackwardRows {
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
struct RowDotRows {
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

// ---- Elementwise --------------------------------------------------------------------------

/// Calls f(k) for k in [0, W): f is a copy of a functor pointed at registers.
template <int W, class F>
__device__ __forceinline__ void apply_local(const F& f) {
#pragma unroll
  for (int k = 0; k < W; ++k) f(k);
}

/// One array field of an elementwise functor (a pointer member) and what the functor
/// does with it: reads it (In), writes it (Out), or both (InOut).
template <auto Member, bool kRead, bool kWrite>
struct Field {
  static constexpr auto member = Member;
  static constexpr bool read = kRead, write = kWrite;
};
template <auto Member>
using In = Field<Member, true, false>;
template <auto Member>
using Out = Field<Member, false, true>;
template <auto Member>
using InOut = Field<Member, true, true>;

/// An elementwise functor F whose arrays of T are Fields...: whether they are all
/// 16-byte aligned, and apply<W>(f, i), the functor over elements [i, i + W) through
/// registers: one W-element array per field, the read fields loaded as vectors, a copy
/// of f pointed at the arrays run element by element, the written fields stored.
template <class F, class T, class... Fields>
struct ElementwiseOver {
  using Element = T;
  static bool aligned(const F& f) { return (aligned16(f.*Fields::member) && ...); }
  template <int W>
  __device__ static void apply(const F& f, std::int64_t i) {
    T regs[sizeof...(Fields)][W];
    F local = f;
    int slot = 0;
    // Comma folds run left to right: field k uses regs[k] in both passes.
    (point<Fields, W>(f, local, i, regs[slot++]), ...);
    apply_local<W>(local);
    slot = 0;
    (store<Fields, W>(f, i, regs[slot++]), ...);
  }

 private:
  template <class Fd, int W>
  __device__ static void point(const F& f, F& local, std::int64_t i, T* reg) {
    if constexpr (Fd::read) load_elements<W>(f.*Fd::member, i, reg);
    local.*Fd::member = reg;
  }
  template <class Fd, int W>
  __device__ static void store(const F& f, std::int64_t i, const T* reg) {
    if constexpr (Fd::write) store_elements<W>(f.*Fd::member, i, reg);
  }
};

/// The lowered elementwise functors and their fields.
template <class F>
struct Elementwise;

template <class T>
struct Elementwise<ops::SwiGluForward<T>>
    : ElementwiseOver<ops::SwiGluForward<T>, T, In<&ops::SwiGluForward<T>::a>, In<&ops::SwiGluForward<T>::b>,
                      Out<&ops::SwiGluForward<T>::g>> {};
template <class T>
struct Elementwise<ops::SwiGluBackward<T>>
    : ElementwiseOver<ops::SwiGluBackward<T>, T, In<&ops::SwiGluBackward<T>::a>, In<&ops::SwiGluBackward<T>::b>,
                      In<&ops::SwiGluBackward<T>::dg>, Out<&ops::SwiGluBackward<T>::da>,
                      Out<&ops::SwiGluBackward<T>::db>> {};
template <class T>
struct Elementwise<ops::Add<T>>
    : ElementwiseOver<ops::Add<T>, T, In<&ops::Add<T>::a>, In<&ops::Add<T>::b>, Out<&ops::Add<T>::out>> {};
template <class T>
struct Elementwise<ops::Copy<T>> : ElementwiseOver<ops::Copy<T>, T, In<&ops::Copy<T>::x>, Out<&ops::Copy<T>::y>> {};
template <class T>
struct Elementwise<ops::Axpy<T>> : ElementwiseOver<ops::Axpy<T>, T, In<&ops::Axpy<T>::x>, InOut<&ops::Axpy<T>::y>> {};
template <class T>
struct Elementwise<ops::Scale<T>> : ElementwiseOver<ops::Scale<T>, T, InOut<&ops::Scale<T>::x>> {};
template <class T>
struct Elementwise<ops::Fill<T>> : ElementwiseOver<ops::Fill<T>, T, Out<&ops::Fill<T>::x>> {};

/// Elements [0, n / W * W) as W-element vectors through Elementwise<F>::apply, the rest
/// by f itself; grid-stride.
template <class F, int W>
__global__ void __launch_bounds__(kElementwiseThreads) elementwise_kernel(std::int64_t n, F f) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t vectors = n / W;
  for (std::int64_t v = first; v < vectors; v += stride) Elementwise<F>::template apply<W>(f, v * W);
  if constexpr (W > 1)
    for (std::int64_t i = vectors * W + first; i < n; i += stride) f(i);
}

template <class F>
struct ElementwiseKernel {
  static void launch(std::int64_t n, const F& f, cudaStream_t stream) {
    constexpr int V = kVectorWidth<typename Elementwise<F>::Element>;
    const bool vectors = Elementwise<F>::aligned(f);
    const std::int64_t items = vectors ? (n + V - 1) / V : n;
    const auto blocks = static_cast<unsigned>(
        std::min<std::int64_t>((items + kElementwiseThreads - 1) / kElementwiseThreads, 65535));
    if (vectors) elementwise_kernel<F, V><<<blocks, kElementwiseThreads, 0, stream>>>(n, f);
    else elementwise_kernel<F, 1><<<blocks, kElementwiseThreads, 0, stream>>>(n, f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

// ---- RoPE -------------------------------------------------------------------------------

/// RopeRotate over rows [0, rows): one item per W pairs (i, i + half) of one head of
/// one row, i a multiple of W. The item's inputs and its cos and sin go to registers,
/// and a copy of f describing one head of 2 W elements at position 0 rotates them.
template <class T, int W>
__global__ void __launch_bounds__(kElementwiseThreads) rope_kernel(ops::RopeRotate<T> f, std::int64_t rows) {
  using C = pointee_t<decltype(f.cos)>;
  const std::int64_t half = f.head_dim / 2, per_head = half / W, per_row = f.n_heads * per_head;
  const std::int64_t items = rows * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  // Each array is addressed from a 16-byte aligned start (a row's head, its half, the
  // table row of its position) at element iv * W.
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; item < items;
       item += stride) {
    const std::int64_t r = item / per_row, h = (item % per_row) / per_head, iv = item % per_head;
    const std::int64_t pos = r % f.seq_len;
    T* out = f.x + r * f.ld + h * f.head_dim;
    const T* in = f.src ? f.src + r * f.ld + h * f.head_dim : out;
    T u[2 * W], v[2 * W];
    C c[W], s[W];
    load_elements<W>(in, iv * W, u);
    load_elements<W>(in + half, iv * W, u + W);
    load_elements<W>(f.cos + pos * half, iv * W, c);
    load_elements<W>(f.sin + pos * half, iv * W, s);
    ops::RopeRotate<T> l = f;
    l.x = v;
    l.ld = 0;
    l.n_heads = 1;
    l.head_dim = 2 * W;
    l.seq_len = 1;
    l.cos = c;
    l.sin = s;
    l.src = u;
    l(0);
    store_elements<W>(out, iv * W, v);
    store_elements<W>(out + half, iv * W, v + W);
  }
}

template <class T>
void launch_rope(std::int64_t rows, const ops::RopeRotate<T>& f, cudaStream_t stream) {
  using C = pointee_t<decltype(f.cos)>;
  constexpr int V = kVectorWidth<T>;
  const bool vectors = f.head_dim % (2 * V) == 0 && (V * sizeof(C)) % 16 == 0 && rows_aligned16(f.x, f.ld) &&
                       rows_aligned16(f.src, f.ld) && aligned16(f.cos) && aligned16(f.sin);
  const int w = vectors ? V : 1;
  const std::int64_t items = rows * f.n_heads * (f.head_dim / 2 / w);
  if (items <= 0) return;
  const auto blocks = static_cast<unsigned>(
      std::min<std::int64_t>((items + kElementwiseThreads - 1) / kElementwiseThreads, 65535));
  if (vectors) rope_kernel<T, V><<<blocks, kElementwiseThreads, 0, stream>>>(f, rows);
  else rope_kernel<T, 1><<<blocks, kElementwiseThreads, 0, stream>>>(f, rows);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

// ---- Sums of squares by chunk (the gradient norm) ------------------------------------

/// One block per chunk, thread l its lane (ops/norm.hpp): elements l, l + kNormLanes, ...
/// loaded by the warp side by side and added in turn, then the lanes added by halves in
/// shared memory, the order SquaredNormChunks' operator() follows on the CPU.
template <class T>
__global__ void __launch_bounds__(ops::kNormLanes) squared_norm_chunks_kernel(ops::SquaredNormChunks<T> f) {
  __shared__ double lane[ops::kNormLanes];
  const std::int64_t c = blockIdx.x;
  const auto [x, n] = f.chunk(c);
  const int l = static_cast<int>(threadIdx.x);
  double s = 0;
#pragma unroll 8
  for (std::int64_t i = l; i < n; i += ops::kNormLanes) s += ops::SquaredNormChunks<T>::square(x[i]);
  lane[l] = s;
  __syncthreads();
  for (int h = ops::kNormLanes / 2; h >= 1; h /= 2) {
    if (l < h) lane[l] += lane[l + h];
    __syncthreads();
  }
  if (l == 0) f.partial[c] = lane[0];
}

// ---- AdamW over every tensor (the multi-tensor launch) ---------------------------------

inline constexpr int kAdamWThreads = 256;

/// One block per kAdamWBlock indices (all one tensor's), thread l the indices l, l + 256,
/// ... of it: a warp's loads side by side, and each thread's 8 elements all loaded before
/// any is updated and stored, so 8 loads of each array are in flight per thread where
/// the per-index kernel has one (its stores may alias its next loads, so it waits). The
/// arithmetic is the functor's own (load, update_and_store).
template <class T, class M>
__global__ void __launch_bounds__(kAdamWThreads) adamw_multi_kernel(ops::AdamWMultiStep<T, M> f) {
  constexpr int kPerThread = static_cast<int>(ops::kAdamWBlock / kAdamWThreads);
  using Element = typename ops::AdamWMultiStep<T, M>::Element;
  const std::int64_t b = blockIdx.x;
  const ops::AdamWTensor<T, M> t = f.tensors[f.block_tensor[b]];
  const std::int64_t j0 = b * ops::kAdamWBlock - t.begin + threadIdx.x;
  Element e[kPerThread] = {};
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (const std::int64_t j = j0 + k * kAdamWThreads; j < t.numel) e[k] = f.load(t, j);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (const std::int64_t j = j0 + k * kAdamWThreads; j < t.numel) f.update_and_store(t, j, e[k]);
}

}  // namespace detail

// ---- The kernels of each lowered functor ------------------------------------------------

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RmsNormForward<T>> {
  static void launch(std::int64_t rows, const ops::RmsNormForward<T>& f, cudaStream_t stream) {
    const bool vectors = detail::rows_aligned16(f.x, f.ldx) && detail::rows_aligned16(f.y, f.ldy) &&
                         detail::aligned16(f.w);
    detail::launch_rows<detail::RmsNormForwardRows<T>, T, true>(f, rows, f.n, vectors, stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RmsNormBackwardInput<T>> {
  static void launch(std::int64_t rows, const ops::RmsNormBackwardInput<T>& f, cudaStream_t stream) {
    const bool vectors = detail::rows_aligned16(f.x, f.ldx) && detail::rows_aligned16(f.dy, f.lddy) &&
                         detail::rows_aligned16(f.dx, f.lddx) && detail::aligned16(f.w);
    detail::launch_rows<detail::RmsNormBackwardInputRows<T>, T, true>(f, rows, f.n, vectors, stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RmsNormBackwardWeight<T>> {
  static void launch(std::int64_t n, const ops::RmsNormBackwardWeight<T>& f, cudaStream_t stream) {
    detail::launch_rmsnorm_weight(n, f, stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CrossEntropyRow<T>> {
  static void launch(std::int64_t rows, const ops::CrossEntropyRow<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CrossEntropyRows<T>, T, false>(f, rows, f.vocab,
                                                               detail::rows_aligned16(f.logits, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CrossEntropyShardMax<T>> {
  static void launch(std::int64_t rows, const ops::CrossEntropyShardMax<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CrossEntropyShardMaxRows<T>, T, false>(
        f, rows, f.vocab, detail::rows_aligned16(f.logits, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CrossEntropyShardExp<T>> {
  static void launch(std::int64_t rows, const ops::CrossEntropyShardExp<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CrossEntropyShardExpRows<T>, T, false>(
        f, rows, f.vocab, detail::rows_aligned16(f.logits, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CrossEntropyShardGrad<T>> {
  static void launch(std::int64_t rows, const ops::CrossEntropyShardGrad<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CrossEntropyShardGradRows<T>, T, false>(
        f, rows, f.vocab, detail::rows_aligned16(f.logits, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CausalSoftmaxForward<T>> {
  static void launch(std::int64_t rows, const ops::CausalSoftmaxForward<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CausalSoftmaxForwardRows<T>, T, true>(f, rows, f.cols,
                                                                      detail::rows_aligned16(f.s, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CausalSoftmaxRecompute<T>> {
  static void launch(std::int64_t rows, const ops::CausalSoftmaxRecompute<T>& f, cudaStream_t stream) {
    detail::launch_rows<detail::CausalSoftmaxRecomputeRows<T>, T, true>(f, rows, f.cols,
                                                                        detail::rows_aligned16(f.s, f.ld), stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CausalSoftmaxBackward<T>> {
  static void launch(std::int64_t rows, const ops::CausalSoftmaxBackward<T>& f, cudaStream_t stream) {
    const bool vectors = detail::rows_aligned16(f.p, f.ldp) && detail::rows_aligned16(f.dp, f.lddp);
    detail::launch_rows<detail::CausalSoftmaxBackwardRows<T>, T, true>(f, rows, f.cols, vectors, stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RowDot<T>> {
  static void launch(std::int64_t rows, const ops::RowDot<T>& f, cudaStream_t stream) {
    const bool vectors = detail::rows_aligned16(f.a, f.lda) && detail::rows_aligned16(f.b, f.ldb);
    detail::launch_rows<detail::RowDotRows<T>, T, true>(f, rows, f.n, vectors, stream);
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RopeRotate<T>> {
  static void launch(std::int64_t rows, const ops::RopeRotate<T>& f, cudaStream_t stream) {
    detail::launch_rope(rows, f, stream);
  }
};

template <class T, class M>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::AdamWMultiStep<T, M>> {
  static void launch(std::int64_t n, const ops::AdamWMultiStep<T, M>& f, cudaStream_t stream) {
    static_assert(ops::kAdamWBlock % detail::kAdamWThreads == 0);
    TESSERA_CHECK(n % ops::kAdamWBlock == 0, "AdamWMultiStep: ", n, " indices is not whole blocks of ",
                  ops::kAdamWBlock);
    const std::int64_t blocks = n / ops::kAdamWBlock;
    TESSERA_CHECK(blocks <= std::int64_t{0x7fffffff}, "AdamWMultiStep: ", blocks,
                  " blocks is past a grid's 2^31 - 1");
    detail::adamw_multi_kernel<T, M><<<static_cast<unsigned>(blocks), detail::kAdamWThreads, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::SquaredNormChunks<T>> {
  static void launch(std::int64_t chunks, const ops::SquaredNormChunks<T>& f, cudaStream_t stream) {
    TESSERA_CHECK(chunks <= std::int64_t{0x7fffffff}, "SquaredNormChunks: ", chunks,
                  " chunks is past a grid's 2^31 - 1 blocks");
    detail::squared_norm_chunks_kernel<T><<<static_cast<unsigned>(chunks), ops::kNormLanes, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::SwiGluForward<T>> : detail::ElementwiseKernel<ops::SwiGluForward<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::SwiGluBackward<T>> : detail::ElementwiseKernel<ops::SwiGluBackward<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::Add<T>> : detail::ElementwiseKernel<ops::Add<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::Copy<T>> : detail::ElementwiseKernel<ops::Copy<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::Axpy<T>> : detail::ElementwiseKernel<ops::Axpy<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::Scale<T>> : detail::ElementwiseKernel<ops::Scale<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::Fill<T>> : detail::ElementwiseKernel<ops::Fill<T>> {};

namespace detail {
/// The host-side list the cost model prices launches by (backend/kernel_class.hpp) names
/// exactly the functors lowered here.
template <class F>
inline constexpr bool kKernelClassAgrees = HasOpKernel<F> == (cuda_kernel_class<F> != KernelClass::per_index);
template <class T>
constexpr bool kernel_classes_agree() {
  return kKernelClassAgrees<ops::RmsNormForward<T>> && kKernelClassAgrees<ops::RmsNormBackwardInput<T>> &&
         kKernelClassAgrees<ops::RmsNormBackwardWeight<T>> && kKernelClassAgrees<ops::CrossEntropyRow<T>> &&
         kKernelClassAgrees<ops::CrossEntropyShardMax<T>> && kKernelClassAgrees<ops::CrossEntropyShardExp<T>> &&
         kKernelClassAgrees<ops::CrossEntropyShardGrad<T>> && kKernelClassAgrees<ops::CausalSoftmaxForward<T>> &&
         kKernelClassAgrees<ops::CausalSoftmaxRecompute<T>> && kKernelClassAgrees<ops::CausalSoftmaxBackward<T>> &&
         kKernelClassAgrees<ops::RowDot<T>> && kKernelClassAgrees<ops::RopeRotate<T>> &&
         kKernelClassAgrees<ops::SwiGluForward<T>> && kKernelClassAgrees<ops::SwiGluBackward<T>> &&
         kKernelClassAgrees<ops::Add<T>> && kKernelClassAgrees<ops::Copy<T>> && kKernelClassAgrees<ops::Axpy<T>> &&
         kKernelClassAgrees<ops::Scale<T>> && kKernelClassAgrees<ops::Fill<T>> &&
         kKernelClassAgrees<ops::Convert<T, float>> && kKernelClassAgrees<ops::EmbeddingForward<T>> &&
         kKernelClassAgrees<ops::EmbeddingBackward<T>> && kKernelClassAgrees<ops::AdamWMultiStep<T>> &&
         (!std::is_same_v<accum_t<T>, float> || kKernelClassAgrees<ops::AdamWMultiStep<T, bf16>>) &&
         kKernelClassAgrees<ops::InitValues<T>> && kKernelClassAgrees<ops::SquaredNormChunks<T>>;
}
static_assert(kernel_classes_agree<float>() && kernel_classes_agree<bf16>() && kernel_classes_agree<double>(),
              "tessera: backend/kernel_class.hpp must list exactly the functors row_kernels.cuh lowers");
}  // namespace detail

/// launch_op (declared in kernels.hpp, with its default stream): OpKernel<F>'s kernel
/// where F has one, else one index per thread (for_each).
template <class F>
void launch_op(std::int64_t n, const F& f, cudaStream_t stream) {
  if (n <= 0) return;
  if constexpr (HasOpKernel<F>) OpKernel<F>::launch(n, f, stream);
  else for_each(n, f, stream);
}

}  // namespace tessera::cuda
