// How the CUDA backend runs each ops/ functor, for pricing a launch without a GPU.
//
// Cuda::for_each (backend/cuda/row_kernels.cuh) gives some functors a kernel of their
// own and runs every other one index per thread. What a launch costs depends on which:
// a lowered kernel streams rows with 16-byte vector loads, while the per-index kernel
// runs the functor's operator() in one thread per index, which coalesces only when each
// index touches a few adjacent bytes. This header says which functors are lowered, as
// host C++ the cost model (plan/) can read; row_kernels.cuh checks at compile time that
// its own kernels and this list agree, so the two cannot drift apart.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tessera/core/dtype.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/norm.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/ops/rope.hpp"
#include "tessera/ops/softmax.hpp"
#include "tessera/ops/swiglu.hpp"

namespace tessera {

enum class KernelClass : std::uint8_t {
  per_index,     // cuda::for_each: one thread per index runs the functor's operator()
  row,           // a row per warp or per block, reductions across its threads, vector loads
  column_sums,   // chunks of rows reduced down columns: RmsNormBackwardWeight's sums, ColumnAbsMax's maxima
  elementwise,   // grid-stride over 16-byte vectors
  multi_tensor,  // AdamWMultiStep: a block per block of the launch's table, 8 elements a thread
  tiles,         // QuantizeFloat8: 64 x 64 tiles through shared memory (transposing casts), else rows of vectors;
                 // Float8Transpose: the same tiles
};

constexpr const char* name_of(KernelClass k) {
  switch (k) {
    case KernelClass::per_index: return "per-index";
    case KernelClass::row: return "row";
    case KernelClass::column_sums: return "column sums";
    case KernelClass::elementwise: return "elementwise";
    case KernelClass::multi_tensor: return "multi-tensor";
    case KernelClass::tiles: return "tiles";
  }
  return "?";
}

namespace detail {
template <class T>
inline constexpr bool kCudaLoweredElement = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

template <class F>
struct cuda_kernel_class_of {
  static constexpr KernelClass value = KernelClass::per_index;
};
#define TESSERA_CUDA_KERNEL_CLASS(FUNCTOR, CLASS)                        \
  template <class T>                                                     \
    requires kCudaLoweredElement<T>                                      \
  struct cuda_kernel_class_of<ops::FUNCTOR<T>> {                          \
    static constexpr KernelClass value = KernelClass::CLASS;             \
  };
TESSERA_CUDA_KERNEL_CLASS(RmsNormForward, row)
TESSERA_CUDA_KERNEL_CLASS(RmsNormBackwardInput, row)
TESSERA_CUDA_KERNEL_CLASS(RmsNormBackwardWeight, column_sums)
TESSERA_CUDA_KERNEL_CLASS(RmsNormBackward, row)
TESSERA_CUDA_KERNEL_CLASS(CrossEntropyShardMax, row)
TESSERA_CUDA_KERNEL_CLASS(CrossEntropyShardExp, row)
TESSERA_CUDA_KERNEL_CLASS(CrossEntropyShardGrad, row)
TESSERA_CUDA_KERNEL_CLASS(CausalSoftmaxForward, row)
TESSERA_CUDA_KERNEL_CLASS(CausalSoftmaxRecompute, row)
TESSERA_CUDA_KERNEL_CLASS(CausalSoftmaxBackward, row)
TESSERA_CUDA_KERNEL_CLASS(RowDot, row)
TESSERA_CUDA_KERNEL_CLASS(SquaredNormChunks, row)
TESSERA_CUDA_KERNEL_CLASS(RopeRotate, elementwise)
TESSERA_CUDA_KERNEL_CLASS(SwiGluForward, elementwise)
TESSERA_CUDA_KERNEL_CLASS(SwiGluBackward, elementwise)
TESSERA_CUDA_KERNEL_CLASS(SwiGluForwardRows, row)
TESSERA_CUDA_KERNEL_CLASS(SwiGluBackwardRows, row)
TESSERA_CUDA_KERNEL_CLASS(SwiGluForwardPaired, row)
TESSERA_CUDA_KERNEL_CLASS(SwiGluBackwardPaired, row)
TESSERA_CUDA_KERNEL_CLASS(Add, elementwise)
TESSERA_CUDA_KERNEL_CLASS(Copy, elementwise)
TESSERA_CUDA_KERNEL_CLASS(Axpy, elementwise)
TESSERA_CUDA_KERNEL_CLASS(Scale, elementwise)
TESSERA_CUDA_KERNEL_CLASS(Fill, elementwise)
#undef TESSERA_CUDA_KERNEL_CLASS
template <class T, class G>
  requires kCudaLoweredElement<T> && kCudaLoweredElement<G>
struct cuda_kernel_class_of<ops::CrossEntropyRow<T, G>> {
  static constexpr KernelClass value = KernelClass::row;
};
template <>
struct cuda_kernel_class_of<ops::LaneSum> {
  static constexpr KernelClass value = KernelClass::row;
};
// Float8 casts (ops/float8.hpp): a row's amax per warp or block, a cast by rows in one
// pass a row the same way, columns' amaxes in chunks of rows, the amaxes' max in one
// block, the cast itself in tiles.
template <class T>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::RowAbsMax<T>> {
  static constexpr KernelClass value = KernelClass::row;
};
template <class T>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::RowAbsMaxScale<T>> {
  static constexpr KernelClass value = KernelClass::row;
};
template <class T, class F>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::CastRowsFloat8<T, F>> {
  static constexpr KernelClass value = KernelClass::row;
};
template <class T>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::ColumnAbsMax<T>> {
  static constexpr KernelClass value = KernelClass::column_sums;
};
template <>
struct cuda_kernel_class_of<ops::MaxOf> {
  static constexpr KernelClass value = KernelClass::row;
};
template <>
struct cuda_kernel_class_of<ops::Float8ScaleFromAmaxes> {
  static constexpr KernelClass value = KernelClass::row;
};
template <class T, class F>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::QuantizeFloat8<T, F>> {
  static constexpr KernelClass value = KernelClass::tiles;
};
template <>
struct cuda_kernel_class_of<ops::Float8Transpose<float8_e4m3>> {
  static constexpr KernelClass value = KernelClass::tiles;
};
template <>
struct cuda_kernel_class_of<ops::Float8Transpose<float8_e5m2>> {
  static constexpr KernelClass value = KernelClass::tiles;
};
template <class T, class M>
  requires kCudaLoweredElement<T>
struct cuda_kernel_class_of<ops::AdamWMultiStep<T, M>> {
  static constexpr KernelClass value = KernelClass::multi_tensor;
};
}  // namespace detail

/// The kernel Cuda::for_each launches for functor F.
template <class F>
inline constexpr KernelClass cuda_kernel_class = detail::cuda_kernel_class_of<F>::value;

}  // namespace tessera
