// Cross-entropy's row kernels (ops/cross_entropy.hpp): CrossEntropyRow, and the
// vocabulary-parallel CrossEntropyShardMax, CrossEntropyShardExp and CrossEntropyShardGrad.
//
// A row read once (CrossEntropyRow on sm_90, ops::kOneReadMinVocab to kOneReadMaxVocab
// logits, the row 16-byte aligned as row_launch.cuh's rule says): a cluster of
// kOneReadBlocks blocks of kOneReadThreads threads takes a row, each block a contiguous
// slice of its 16-byte vectors, each thread up to E logits (8, 16 or 32, the fewest that
// cover the row) in registers. The block's max goes to its shared memory; after a
// cluster barrier every thread takes the max of the blocks' maxima (distributed shared
// memory); then the exponentials, kept in registers, their block sum, a second barrier,
// and the sum of the blocks' sums in block order; then the gradient is written from the
// registers. Each logit is read from memory once and each output written once: 6 bytes
// a logit for float logits and a bf16 gradient, where the passes below move 14. A
// Llama 3 row (128256) is 8 x 512 threads x 31.3 logits; the cluster's 8 blocks hold
// 513 KB of it at once, two clusters' blocks share an SM, so one waits at a barrier
// while the other loads.
//
// Otherwise one row (or shard of one) per block, sized as row_launch.cuh says: a
// vocabulary row of 128256 gets 1024 threads. The passes are the functors': max, then
// exp and its sum, then the gradient (in place, or into a bf16 buffer read from float
// logits), each reading the row from memory again. A float row holds exp(z - max)
// between passes and a bf16 row its logits, so CrossEntropyShardExp leaves a bf16 row
// holding its logits, and CrossEntropyShardGrad starts from them.
//
// Both give each gradient element the functor's expression, rounded once; they differ
// from the CPU (and from each other) only in the order the row's sum is added, and each
// adds in an order fixed by the row's length, so runs repeat bit for bit.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>

#include "tessera/backend/cuda/kernel_layouts.hpp"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::cuda::detail {

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

/// The gradient over a row of n elements into `out` (z itself, or rows of G): factor * z,
/// and at column t (if in the row) minus `subtract`; with kFromLogits, z is still the
/// logits and factor * exp(z - m) is written instead (each element rounded once).
template <int V, bool kWarp, bool kFromLogits, class T, class G>
__device__ void row_scale(const T* z, G* out, std::int64_t n, float m, float factor, std::int64_t t, float subtract,
                          const RowGroup<kWarp>& g) {
  row_loop<V>(n, g.rank(), g.size(), [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_float<W>(z, j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      // The product rounded on its own (never fused with the target's subtraction), so
      // every instantiation, in place or into rows of G, makes the same float.
      v[k] = ops::mul_rn(kFromLogits ? ops::exp_nonpositive(v[k] - m) : v[k], factor);
      if (j + k == t) v[k] -= subtract;
    }
    store_float<W>(out, j, v);
  });
}

/// What the cross-entropy row bodies share: rows of vocab logits at logits + r ld, each a
/// row per block however short.
template <class T>
struct VocabRows : BlockRows<T> {
  template <class F>
  static std::int64_t length(const F& f) {
    return f.vocab;
  }
  template <class F>
  static bool aligned(const F& f) {
    return rows_aligned16(f.logits, f.ld);
  }
};

/// CrossEntropyRow: in place, or (f.grad set) the gradient into rows of G, the logits
/// only read (their alignment and the gradient's decide the vector loads and stores).
template <class T, class G = T>
struct CrossEntropyRows : VocabRows<T> {
  template <class F>
  static bool aligned(const F& f) {
    return rows_aligned16(f.logits, f.ld) && (f.grad == nullptr || rows_aligned16(f.grad, f.grad_ld));
  }
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyRow<T, G>& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    const float scale = to_float(f.loss_scale());
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      T* z = f.logits + r * f.ld;
      const std::int32_t t = f.targets[r];
      if (f.grad != nullptr) {
        G* d = f.grad + r * f.grad_ld;
        if (t == ops::kIgnoreIndex) {
          if (g.rank() == 0) f.loss[r] = 0;
          if (f.write_grad) zero_row<V>(d, f.vocab, g);
          continue;
        }
        const float zt = to_float(z[t]);
        const float m = row_max<V>(z, f.vocab, g, smem);
        const float sum = row_exp_sum<V, kWarp, false>(z, f.vocab, m, g, smem);
        if (g.rank() == 0) f.loss[r] = static_cast<double>(m + ops::log_(sum) - zt);
        if (f.write_grad) row_scale<V, kWarp, true>(z, d, f.vocab, m, scale / sum, t, scale, g);
        continue;
      }
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
      if (f.write_grad) row_scale<V, kWarp, !kRowHoldsIntermediates<T>>(z, z, f.vocab, m, scale / sum, t, scale, g);
    }
  }
};

template <class T>
struct CrossEntropyShardMaxRows : VocabRows<T> {
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
struct CrossEntropyShardExpRows : VocabRows<T> {
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
struct CrossEntropyShardGradRows : VocabRows<T> {
  template <int V, bool kWarp>
  __device__ static void run(const ops::CrossEntropyShardGrad<T>& f, std::int64_t rows, float*) {
    const RowGroup<kWarp> g;
    const float scale = to_float(f.loss_scale());
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
      row_scale<V, kWarp, !kRowHoldsIntermediates<T>>(z, z, f.vocab, to_float(f.max[r]), scale / sum, t - f.lo, scale,
                                                     g);
    }
  }
};

// ---- A row read once: a cluster of blocks per row (sm_90) ------------------------------

/// Blocks in a row's cluster, and threads in each (ops::kOneReadMaxVocab is their product
/// times the most logits a thread holds, 32).
inline constexpr int kOneReadBlocks = 8;
inline constexpr int kOneReadThreads = 512;
static_assert(ops::kOneReadMaxVocab == std::int64_t{kOneReadBlocks} * kOneReadThreads * 32,
              "ops::kOneReadMaxVocab is the cluster's capacity at 32 logits a thread");

/// One row per cluster of kOneReadBlocks blocks (blockIdx.x / kOneReadBlocks is the row),
/// E logits a thread at most, in vectors of V (16 bytes of T). The launcher has checked
/// that the row fits (vocab <= kOneReadBlocks * kOneReadThreads * E) and that every row
/// is 16-byte aligned (logits, and grad when set).
template <class T, class G, int E>
__global__ void __launch_bounds__(kOneReadThreads, 2) cross_entropy_one_read_kernel(ops::CrossEntropyRow<T, G> f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int V = kVectorWidth<T>;
  static_assert(E % V == 0, "a thread holds whole vectors");
  constexpr int kVectors = E / V;
  __shared__ float smem[32];
  __shared__ float block_max, block_sum;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const std::int64_t r = blockIdx.x / kOneReadBlocks;
  const int tid = static_cast<int>(threadIdx.x);
  T* z = f.logits + r * f.ld;
  const std::int32_t t = f.targets[r];
  G* out_grad = f.grad != nullptr ? f.grad + r * f.grad_ld : nullptr;

  // This block's vectors: a contiguous slice of the row's ceil(vocab / V), the last maybe
  // short; its columns end at `end`. Vector k of this thread starts at column(k)
  // (kernel_layouts.hpp, whose coverage the CPU tests check). The row fits
  // (vocab <= kOneReadMaxVocab), so columns are ints.
  const OneReadLayout layout{static_cast<int>(f.vocab), V, kOneReadBlocks, kOneReadThreads};
  const int end = layout.end(rank), column0 = layout.column(rank, tid, 0);
  auto column = [&](int k) { return column0 + k * layout.stride(); };  // layout.column(rank, tid, k)
  auto whole = [&](int k) { return column(k) + V <= end; };           // layout.whole(rank, tid, k)
  auto present = [&](int k, int w) { return column(k) + w < end; };   // layout.present(rank, tid, k, w)

  if (t == ops::kIgnoreIndex) {  // the whole cluster takes this branch: no barrier
    if (rank == 0 && tid == 0) f.loss[r] = 0;
    if (f.write_grad) {
      const float zero[V] = {};
#pragma unroll
      for (int k = 0; k < kVectors; ++k) {
        if (whole(k)) {
          if (out_grad != nullptr) store_float<V>(out_grad, column(k), zero);
          else store_float<V>(z, column(k), zero);
        } else {
#pragma unroll
          for (int w = 0; w < V; ++w)
            if (present(k, w)) {
              if (out_grad != nullptr) out_grad[column(k) + w] = from_float<G>(0.0f);
              else z[column(k) + w] = from_float<T>(0.0f);
            }
        }
      }
    }
    return;
  }
  const float zt = rank == 0 && tid == 0 ? to_float(z[t]) : 0.0f;  // before any block writes the row

  float x[kVectors][V];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kVectors; ++k) {
    if (whole(k)) {
      load_float<V>(z, column(k), x[k]);
    } else {
#pragma unroll
      for (int w = 0; w < V; ++w) x[k][w] = present(k, w) ? to_float(z[column(k) + w]) : -INFINITY;
    }
#pragma unroll
    for (int w = 0; w < V; ++w) m = fmaxf(m, x[k][w]);
  }
  m = block_reduce(m, MaxOp{}, smem);
  if (tid == 0) block_max = m;
  cluster.sync();  // every block's max in its shared memory
  m = *cluster.map_shared_rank(&block_max, 0);
#pragma unroll
  for (int b = 1; b < kOneReadBlocks; ++b) m = fmaxf(m, *cluster.map_shared_rank(&block_max, b));

  float s = 0;
#pragma unroll
  for (int k = 0; k < kVectors; ++k)
#pragma unroll
    for (int w = 0; w < V; ++w) {
      x[k][w] = present(k, w) ? ops::exp_nonpositive(x[k][w] - m) : 0.0f;
      s += x[k][w];
    }
  s = block_reduce(s, SumOp{}, smem);
  if (tid == 0) block_sum = s;
  cluster.sync();  // every block's sum
  float sum = *cluster.map_shared_rank(&block_sum, 0);
#pragma unroll
  for (int b = 1; b < kOneReadBlocks; ++b) sum += *cluster.map_shared_rank(&block_sum, b);
  // No block may leave (its shared memory gone) before every block has read it.
  auto read_all = cluster.barrier_arrive();

  if (rank == 0 && tid == 0) f.loss[r] = static_cast<double>(m + ops::log_(sum) - zt);
  const bool keep = kRowHoldsIntermediates<T> && out_grad == nullptr;  // the functor's float row: exp(z - max)
  if (f.write_grad || keep) {
    const float scale = to_float(f.loss_scale()), factor = f.write_grad ? scale / sum : 1.0f;
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
#pragma unroll
      for (int w = 0; w < V; ++w) {
        if (!f.write_grad) continue;  // exp(z - max) as it is
        x[k][w] = ops::mul_rn(x[k][w], factor);  // as row_scale: never fused with the subtraction
        if (column(k) + w == t) x[k][w] -= scale;
      }
      if (whole(k)) {
        if (out_grad != nullptr) store_float<V>(out_grad, column(k), x[k]);
        else store_float<V>(z, column(k), x[k]);
      } else {
#pragma unroll
        for (int w = 0; w < V; ++w)
          if (present(k, w)) {
            if (out_grad != nullptr) out_grad[column(k) + w] = from_float<G>(x[k][w]);
            else z[column(k) + w] = from_float<T>(x[k][w]);
          }
      }
    }
  }
  cluster.barrier_wait(std::move(read_all));
#elif defined(__CUDA_ARCH__)
  __trap();  // never launched: the launcher asks for sm_90 code first
#endif
}

/// Host side: whether the current device runs the one-read kernel for <T, G, E>: the
/// code it would run is sm_90 or newer (not a JIT of older PTX, where the body is empty).
/// Asked once per device.
template <class T, class G, int E>
bool one_read_runs_here() {
  static std::array<std::atomic<int>, 64> known{};  // 0: not asked, 1: no, 2: yes
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= static_cast<int>(known.size())) return false;
  int k = known[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  if (k == 0) {
    cudaFuncAttributes a{};
    TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&a, cross_entropy_one_read_kernel<T, G, E>));
    k = a.binaryVersion >= 90 ? 2 : 1;
    known[static_cast<std::size_t>(device)].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

/// OpKernel<CrossEntropyRow<T, G>>: the row read once where the row fits a cluster, is
/// long enough to gain by it, is aligned, and the GPU has clusters; the passes otherwise.
template <class T, class G>
struct CrossEntropyRowKernel {
  template <class F>
  static void launch(std::int64_t rows, const F& f, cudaStream_t stream) {
    const bool fits = f.vocab >= ops::kOneReadMinVocab && f.vocab <= ops::kOneReadMaxVocab &&
                      CrossEntropyRows<T, G>::aligned(f) && rows <= (std::int64_t{1} << 31) / kOneReadBlocks - 1;
    if (fits) {
      const std::optional<int> e = one_read_logits_per_thread(f.vocab, kOneReadBlocks, kOneReadThreads);
      if (e == 8 && try_launch<8>(rows, f, stream)) return;
      if (e == 16 && try_launch<16>(rows, f, stream)) return;
      if (e == 32 && try_launch<32>(rows, f, stream)) return;
    }
    RowKernel<CrossEntropyRows<T, G>>::launch(rows, f, stream);
  }

 private:
  template <int E, class F>
  static bool try_launch(std::int64_t rows, const F& f, cudaStream_t stream) {
    if (!one_read_runs_here<T, G, E>()) return false;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(rows * kOneReadBlocks));
    config.blockDim = dim3(kOneReadThreads);
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kOneReadBlocks;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&config, cross_entropy_one_read_kernel<T, G, E>, f));
    return true;
  }
};

}  // namespace tessera::cuda::detail
