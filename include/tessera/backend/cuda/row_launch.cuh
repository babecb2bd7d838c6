// What the ops' own CUDA kernels (row_kernels.cuh) share: element conversions, 16-byte
// vector loads and stores, warp and block reductions, and the row kernel, which makes a
// row functor's passes (a Body: see RowKernel) over its rows.
//
// Row launch. One row per warp (8 rows in a block of 256) where the functor allows it and
// the row has at most 1024 elements, else one row per block of 64..1024 threads (the
// power of two that gives each thread about 4 vectors; V = 16 / sizeof(T): 4 floats or
// 8 bf16 per load).
//
// Arithmetic. Sums, maxima and the statistics are kept in float whatever T is (bf16 is
// converted on load and rounded once on store, to nearest even as bf16(float) does);
// the per-element expressions are the functors' own. As the functors do, a float row
// keeps exp(z - max) between passes, while a bf16 row keeps its logits until the last
// pass computes the exponentials again, so that each output is rounded once
// (kRowHoldsIntermediates).
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
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::cuda::detail {

// ---- Element types and conversions ------------------------------------------------

/// Element types whose functors are lowered (row_kernels.cuh); others run one index per
/// thread.
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

/// in to elements [j, j + W) of base: whole 16-byte stores, or one store of 8 or 4 bytes
/// where the vector is that narrow (W floats rounded to bf16); base + j aligned to it.
template <int W, class U>
__device__ __forceinline__ void store_elements(U* base, std::int64_t j, const U* in) {
  constexpr std::size_t kBytes = W * sizeof(U);
  if constexpr (W == 1) {
    base[j] = in[0];
  } else if constexpr (kBytes == 8) {
    uint2 word;
    memcpy(&word, in, 8);
    *reinterpret_cast<uint2*>(base + j) = word;
  } else if constexpr (kBytes == 4) {
    unsigned word;
    memcpy(&word, in, 4);
    *reinterpret_cast<unsigned*>(base + j) = word;
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
/// The larger of two magnitudes, a NaN winning (ops::max_nan: amaxes combined). Either
/// order gives a NaN or the same number.
struct MaxNanOp {
  __device__ float operator()(float a, float b) const { return ops::max_nan(a, b); }
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

/// A row body's base: its element type, and whether its rows go one per warp when they
/// have at most kWarpRowMax elements (WarpRows) or always one per block (BlockRows).
template <class T, bool kWarpRows>
struct RowsOf {
  using Element = T;
  static constexpr bool kAllowWarp = kWarpRows;
};
template <class T>
using WarpRows = RowsOf<T, true>;
template <class T>
using BlockRows = RowsOf<T, false>;

/// OpKernel<F> for a row functor F whose passes are Body::run: rows of Body::length(f)
/// elements of Body::Element, vector loads where Body::aligned(f) (the alignment rule),
/// and a row per warp where Body::kAllowWarp and the row is short.
template <class Body>
struct RowKernel {
  template <class F>
  static void launch(std::int64_t rows, const F& f, cudaStream_t stream) {
    constexpr int V = kVectorWidth<typename Body::Element>;
    const bool vectors = Body::aligned(f);
    const RowShape s = row_shape(rows, Body::length(f), vectors ? V : 1, Body::kAllowWarp);
    if (vectors) launch_shape<V>(s, f, rows, stream);
    else launch_shape<1>(s, f, rows, stream);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }

 private:
  template <int V, class F>
  static void launch_shape(const RowShape& s, const F& f, std::int64_t rows, cudaStream_t stream) {
    if constexpr (Body::kAllowWarp)
      if (s.warp) {
        row_kernel<Body, V, true><<<s.blocks, s.threads, 0, stream>>>(f, rows);
        return;
      }
    row_kernel<Body, V, false><<<s.blocks, s.threads, 0, stream>>>(f, rows);
  }
};

}  // namespace tessera::cuda::detail
