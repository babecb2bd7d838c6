// The elementwise kernels (ops/elementwise.hpp, ops/swiglu.hpp): SwiGluForward,
// SwiGluBackward, Add, Copy, Axpy, Scale, Fill; and SwiGluForwardRows and
// SwiGluBackwardRows (ops::RowsWithAmaxes), the same by rows with the outputs' row
// amaxes; SwiGluForwardPaired and SwiGluBackwardPaired, the same by rows of a layout of
// their own (at the end).
//
// Grid-stride over V-element vectors (V = 16 / sizeof(T)), 256 threads a block; the last
// n % V elements by the functor itself. Vectors when every pointer is 16-byte aligned,
// else the same kernel with scalar loads. The kernels do not restate the arithmetic: they
// load a vector into registers, point a copy of the functor at those registers and call
// its operator() for each element.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/swiglu.hpp"

namespace tessera::cuda::detail {

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
    apply<W>(f, i, [](const F&) {});
  }
  /// The same, then then(local): the copy of f pointed at the registers, its outputs
  /// there as they are stored (local.g[k], k < W), for a kernel that also reduces them.
  template <int W, class Then>
  __device__ static void apply(const F& f, std::int64_t i, Then&& then) {
    T regs[sizeof...(Fields)][W];
    F local = f;
    int slot = 0;
    // Comma folds run left to right: field k uses regs[k] in both passes.
    (point<Fields, W>(f, local, i, regs[slot++]), ...);
    apply_local<W>(local);
    then(static_cast<const F&>(local));
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

/// OpKernel for an elementwise functor F: elementwise_kernel, on vectors where
/// Elementwise<F>::aligned(f).
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

// ---- Elementwise functors by rows, with their outputs' row amaxes -----------------------
//
// ops::RowsWithAmaxes (SwiGluForwardRows, SwiGluBackwardRows): the row kernel
// (row_launch.cuh), a row (a token's hidden units) per warp or block; each thread's
// vectors through the element functor's own apply, its outputs' magnitudes folded as they
// are stored (the functor's Outputs::take, on the registers), then one reduction a
// output over the row's threads in which a NaN wins. Vectors where the element functor's
// pointers are 16-byte aligned and a row is a whole number of vectors.

template <class F, class E, class O, class T>
struct RowsWithAmaxesBody : WarpRows<T> {
  using Over = Elementwise<E>;
  static std::int64_t length(const F& f) { return f.cols; }
  static bool aligned(const F& f) { return Over::aligned(f.element) && f.cols % kVectorWidth<T> == 0; }
  template <int V, bool kWarp>
  __device__ static void run(const F& f, std::int64_t rows, float* smem) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      float m[O::kCount] = {};
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        constexpr int W = decltype(width)::value;
        Over::template apply<W>(f.element, r * f.cols + j, [&](const E& local) {
#pragma unroll
          for (int k = 0; k < W; ++k) O::take(local, k, m);
        });
      });
#pragma unroll
      for (int o = 0; o < O::kCount; ++o) m[o] = g.reduce(m[o], MaxNanOp{}, smem);
      if (g.rank() == 0) f.amax.store(r, m);
    }
  }
};

/// The row body of ops::RowsWithAmaxes<E, O> (a functor derived from one, as
/// SwiGluForwardRows<T> is).
template <class F, class E, class O, class T>
using RowsWithAmaxesKernel = RowKernel<RowsWithAmaxesBody<F, E, O, T>>;

// ---- Elementwise functors by rows of their own layout -----------------------------------
//
// ops::SwiGluForwardPaired, SwiGluBackwardPaired: the row kernel, a row per warp or block;
// row r's elementwise functor (f.row(r): its arrays pointed at that row) over the row's
// f.cols elements, vectors through the element functor's own apply. Vectors where row 0's
// functor has every pointer 16-byte aligned and cols is a whole number of vectors (then
// every row's is: each array's rows are a multiple of cols apart).

template <class F, class E, class T>
struct PairedRowsBody : WarpRows<T> {
  using Over = Elementwise<E>;
  static std::int64_t length(const F& f) { return f.cols; }
  static bool aligned(const F& f) { return Over::aligned(f.row(0)) && f.cols % kVectorWidth<T> == 0; }
  template <int V, bool kWarp>
  __device__ static void run(const F& f, std::int64_t rows, float*) {
    const RowGroup<kWarp> g;
    for (std::int64_t r = g.first_row(); r < rows; r += g.row_stride()) {
      const E e = f.row(r);
      row_loop<V>(f.cols, g.rank(), g.size(), [&](std::int64_t j, auto width) {
        Over::template apply<decltype(width)::value>(e, j);
      });
    }
  }
};

/// The row kernel of a functor F whose row(r) is the elementwise functor E of row r.
template <class F, class E, class T>
using PairedRowsKernel = RowKernel<PairedRowsBody<F, E, T>>;

}  // namespace tessera::cuda::detail
