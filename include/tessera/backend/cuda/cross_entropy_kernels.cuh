// Cross-entropy's row kernels (ops/cross_entropy.hpp): CrossEntropyRow, and the
// vocabulary-parallel CrossEntropyShardMax, CrossEntropyShardExp and CrossEntropyShardGrad.
//
// One row (or shard of one) per block, sized as row_launch.cuh says: a vocabulary row of
// 128256 gets 1024 threads. The passes are the functors': max, then exp and its sum, then
// the gradient (in place, or into a bf16 buffer read from float logits). A float row holds exp(z - max) between passes and a bf16 row its logits,
// so CrossEntropyShardExp leaves a bf16 row holding its logits, and CrossEntropyShardGrad
// starts from them.
#pragma once

#include <cmath>
#include <cstdint>

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
      if constexpr (kFromLogits) v[k] = ops::exp_nonpositive(v[k] - m) * factor;
      else v[k] *= factor;
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
    const float scale = to_float(f.scale);
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
      row_scale<V, kWarp, !kRowHoldsIntermediates<T>>(z, z, f.vocab, to_float(f.max[r]), scale / sum, t - f.lo, scale,
                                                     g);
    }
  }
};

}  // namespace tessera::cuda::detail
