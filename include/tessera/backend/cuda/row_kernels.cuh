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
// The kernels, by family, each header with its launch shapes:
//
//   row_launch.cuh             what the families share: conversions, vector loads and
//                              stores, reductions, the row kernel and its launch; the
//                              arithmetic, alignment and determinism rules
//   rmsnorm_kernels.cuh        RmsNormForward, RmsNormBackwardInput, RmsNormBackwardWeight,
//                              RmsNormBackward (both backward passes, x and dy read once)
//   cross_entropy_kernels.cuh  CrossEntropyRow, CrossEntropyShardMax, CrossEntropyShardExp,
//                              CrossEntropyShardGrad
//   softmax_kernels.cuh        CausalSoftmaxForward, CausalSoftmaxRecompute,
//                              CausalSoftmaxBackward, RowDot
//   elementwise_kernels.cuh    SwiGluForward, SwiGluBackward, Add, Copy, Axpy, Scale, Fill;
//                              SwiGluForwardRows, SwiGluBackwardRows, SwiGluForwardPaired,
//                              SwiGluBackwardPaired (row kernels)
//   rope_kernels.cuh           RopeRotate
//   norm_kernels.cuh           SquaredNormChunks, LaneSum
//   adamw_kernels.cuh          AdamWMultiStep
//   float8_kernels.cuh         RowAbsMax, ColumnAbsMax, MaxOf, Float8ScaleFromAmaxes, QuantizeFloat8 (tiles
//                              when transposing), Float8Transpose (tiles)
//
// This header holds the table that gives each of them its OpKernel, checks it against
// backend/kernel_class.hpp, and defines launch_op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "tessera/backend/cuda/adamw_kernels.cuh"
#include "tessera/backend/cuda/cross_entropy_kernels.cuh"
#include "tessera/backend/cuda/elementwise_kernels.cuh"
#include "tessera/backend/cuda/float8_kernels.cuh"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/norm_kernels.cuh"
#include "tessera/backend/cuda/rmsnorm_kernels.cuh"
#include "tessera/backend/cuda/rope_kernels.cuh"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/backend/cuda/softmax_kernels.cuh"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/ops/init.hpp"
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

// ---- The kernels of each lowered functor ------------------------------------------------

// The table: OpKernel<ops::FUNCTOR<T>> for float and bf16 T is the launcher named after
// FUNCTOR (a struct with launch(n, f, stream); it may name T and hold commas).
#define TESSERA_CUDA_OP_KERNEL(FUNCTOR, ...)         \
  template <class T>                                 \
    requires detail::kLoweredElement<T>              \
  struct OpKernel<ops::FUNCTOR<T>> : __VA_ARGS__ {};
TESSERA_CUDA_OP_KERNEL(RmsNormForward, detail::RowKernel<detail::RmsNormForwardRows<T>>)
TESSERA_CUDA_OP_KERNEL(RmsNormBackwardInput, detail::RowKernel<detail::RmsNormBackwardInputRows<T>>)
TESSERA_CUDA_OP_KERNEL(RmsNormBackwardWeight, detail::RmsNormWeightKernel<T>)
TESSERA_CUDA_OP_KERNEL(RmsNormBackward, detail::RmsNormBackwardKernel<T>)
TESSERA_CUDA_OP_KERNEL(CrossEntropyShardMax, detail::RowKernel<detail::CrossEntropyShardMaxRows<T>>)
TESSERA_CUDA_OP_KERNEL(CrossEntropyShardExp, detail::RowKernel<detail::CrossEntropyShardExpRows<T>>)
TESSERA_CUDA_OP_KERNEL(CrossEntropyShardGrad, detail::RowKernel<detail::CrossEntropyShardGradRows<T>>)
TESSERA_CUDA_OP_KERNEL(CausalSoftmaxForward, detail::RowKernel<detail::CausalSoftmaxForwardRows<T>>)
TESSERA_CUDA_OP_KERNEL(CausalSoftmaxRecompute, detail::RowKernel<detail::CausalSoftmaxRecomputeRows<T>>)
TESSERA_CUDA_OP_KERNEL(CausalSoftmaxBackward, detail::RowKernel<detail::CausalSoftmaxBackwardRows<T>>)
TESSERA_CUDA_OP_KERNEL(RowDot, detail::RowKernel<detail::RowDotRows<T>>)
TESSERA_CUDA_OP_KERNEL(SquaredNormChunks, detail::SquaredNormChunksKernel<T>)
TESSERA_CUDA_OP_KERNEL(RopeRotate, detail::RopeKernel<T>)
TESSERA_CUDA_OP_KERNEL(SwiGluForward, detail::ElementwiseKernel<ops::SwiGluForward<T>>)
TESSERA_CUDA_OP_KERNEL(SwiGluBackward, detail::ElementwiseKernel<ops::SwiGluBackward<T>>)
TESSERA_CUDA_OP_KERNEL(SwiGluForwardRows, detail::RowsWithAmaxesKernel<ops::SwiGluForwardRows<T>, ops::SwiGluForward<T>,
                                                                     ops::SwiGluForwardAmax, T>)
TESSERA_CUDA_OP_KERNEL(SwiGluBackwardRows, detail::RowsWithAmaxesKernel<ops::SwiGluBackwardRows<T>, ops::SwiGluBackward<T>,
                                                                      ops::SwiGluBackwardAmax, T>)
TESSERA_CUDA_OP_KERNEL(SwiGluForwardPaired, detail::PairedRowsKernel<ops::SwiGluForwardPaired<T>, ops::SwiGluForward<T>, T>)
TESSERA_CUDA_OP_KERNEL(SwiGluBackwardPaired,
                       detail::PairedRowsKernel<ops::SwiGluBackwardPaired<T>, ops::SwiGluBackward<T>, T>)
TESSERA_CUDA_OP_KERNEL(Add, detail::ElementwiseKernel<ops::Add<T>>)
TESSERA_CUDA_OP_KERNEL(Copy, detail::ElementwiseKernel<ops::Copy<T>>)
TESSERA_CUDA_OP_KERNEL(Axpy, detail::ElementwiseKernel<ops::Axpy<T>>)
TESSERA_CUDA_OP_KERNEL(Scale, detail::ElementwiseKernel<ops::Scale<T>>)
TESSERA_CUDA_OP_KERNEL(Fill, detail::ElementwiseKernel<ops::Fill<T>>)
#undef TESSERA_CUDA_OP_KERNEL
template <class T, class G>
  requires detail::kLoweredElement<T> && detail::kLoweredElement<G>
struct OpKernel<ops::CrossEntropyRow<T, G>> : detail::CrossEntropyRowKernel<T, G> {};
template <class T, class M>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::AdamWMultiStep<T, M>> : detail::AdamWMultiKernel<T, M> {};
template <>
struct OpKernel<ops::LaneSum> : detail::LaneSumKernel {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RowAbsMax<T>> : detail::RowKernel<detail::RowAbsMaxRows<T>> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::ColumnAbsMax<T>> : detail::ColumnAbsMaxKernel<T> {};
template <>
struct OpKernel<ops::MaxOf> : detail::MaxOfKernel<ops::MaxOf> {};
template <>
struct OpKernel<ops::Float8ScaleFromAmaxes> : detail::MaxOfKernel<ops::Float8ScaleFromAmaxes> {};
template <class T>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::RowAbsMaxScale<T>> : detail::RowAbsMaxScaleKernel<T> {};
template <class T, class F>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::QuantizeFloat8<T, F>> : detail::QuantizeFloat8Kernel<T, F> {};
template <class T, class F>
  requires detail::kLoweredElement<T>
struct OpKernel<ops::CastRowsFloat8<T, F>> : detail::RowKernel<detail::CastRowsFloat8Rows<T, F>> {};
template <>
struct OpKernel<ops::Float8Transpose<float8_e4m3>> : detail::Float8TransposeKernel<float8_e4m3> {};
template <>
struct OpKernel<ops::Float8Transpose<float8_e5m2>> : detail::Float8TransposeKernel<float8_e5m2> {};

namespace detail {
/// The host-side list the cost model prices launches by (backend/kernel_class.hpp) names
/// exactly the functors lowered here.
template <class F>
inline constexpr bool kKernelClassAgrees = HasOpKernel<F> == (cuda_kernel_class<F> != KernelClass::per_index);
template <class T>
constexpr bool kernel_classes_agree() {
  return kKernelClassAgrees<ops::RmsNormForward<T>> && kKernelClassAgrees<ops::RmsNormBackwardInput<T>> &&
         kKernelClassAgrees<ops::RmsNormBackwardWeight<T>> && kKernelClassAgrees<ops::RmsNormBackward<T>> && kKernelClassAgrees<ops::CrossEntropyRow<T>> && kKernelClassAgrees<ops::CrossEntropyRow<T, bf16>> &&
         kKernelClassAgrees<ops::CrossEntropyShardMax<T>> && kKernelClassAgrees<ops::CrossEntropyShardExp<T>> &&
         kKernelClassAgrees<ops::CrossEntropyShardGrad<T>> && kKernelClassAgrees<ops::CausalSoftmaxForward<T>> &&
         kKernelClassAgrees<ops::CausalSoftmaxRecompute<T>> && kKernelClassAgrees<ops::CausalSoftmaxBackward<T>> &&
         kKernelClassAgrees<ops::RowDot<T>> && kKernelClassAgrees<ops::RopeRotate<T>> &&
         kKernelClassAgrees<ops::SwiGluForward<T>> && kKernelClassAgrees<ops::SwiGluBackward<T>> &&
         kKernelClassAgrees<ops::SwiGluForwardRows<T>> && kKernelClassAgrees<ops::SwiGluBackwardRows<T>> &&
         kKernelClassAgrees<ops::SwiGluForwardPaired<T>> && kKernelClassAgrees<ops::SwiGluBackwardPaired<T>> &&
         kKernelClassAgrees<ops::Add<T>> && kKernelClassAgrees<ops::Copy<T>> && kKernelClassAgrees<ops::Axpy<T>> &&
         kKernelClassAgrees<ops::Scale<T>> && kKernelClassAgrees<ops::Fill<T>> &&
         kKernelClassAgrees<ops::Convert<T, float>> && kKernelClassAgrees<ops::EmbeddingForward<T>> &&
         kKernelClassAgrees<ops::EmbeddingBackward<T>> && kKernelClassAgrees<ops::AdamWMultiStep<T>> &&
         (!std::is_same_v<accum_t<T>, float> || kKernelClassAgrees<ops::AdamWMultiStep<T, bf16>>) &&
         kKernelClassAgrees<ops::InitValues<T>> && kKernelClassAgrees<ops::SquaredNormChunks<T>> &&
         kKernelClassAgrees<ops::RowAbsMax<T>> && kKernelClassAgrees<ops::RowAbsMaxScale<T>> &&
         kKernelClassAgrees<ops::QuantizeFloat8<T, float8_e4m3>> &&
         kKernelClassAgrees<ops::QuantizeFloat8<T, float8_e5m2>> &&
         kKernelClassAgrees<ops::CastRowsFloat8<T, float8_e4m3>> &&
         kKernelClassAgrees<ops::CastRowsFloat8<T, float8_e5m2>> && kKernelClassAgrees<ops::ColumnAbsMax<T>>;
}
static_assert(kernel_classes_agree<float>() && kernel_classes_agree<bf16>() && kernel_classes_agree<double>() &&
                  kKernelClassAgrees<ops::LaneSum> && kKernelClassAgrees<ops::MaxOf> &&
                  kKernelClassAgrees<ops::Float8ScaleFromAmaxes> &&
                  kKernelClassAgrees<ops::Float8Transpose<float8_e4m3>> &&
                  kKernelClassAgrees<ops::Float8Transpose<float8_e5m2>>,
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
