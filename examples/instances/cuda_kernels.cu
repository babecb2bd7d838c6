// The kernels tessera's models launch over the CUDA backend, compiled once for the whole
// build (backend/cuda/kernels.hpp): llama-train, the GPU tests and bench-train are C++
// that g++ compiles against tessera/backend/cuda/cuda.hpp, and they link these
// definitions. Float and bf16, the element types the CUDA backend trains in.
//
// A functor a model starts launching and this list leaves out is a link error naming
// tessera::cuda::launch_op<F>: add it here.
#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/backend/cuda/cuda.cuh"
#include "tessera/core/dtype.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/attention_merge.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/flash_attention.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/positions.hpp"
#include "tessera/ops/ragged_documents.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/ops/rope.hpp"
#include "tessera/ops/softmax.hpp"
#include "tessera/ops/swiglu.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/parallel/sharding.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera {

// One explicit instantiation of launch_op per functor type (the type may hold commas).
#define TESSERA_LAUNCH_OP(...) template void cuda::launch_op(std::int64_t, const __VA_ARGS__&, cudaStream_t);

// What the layers, the loss, the optimizer, the parallel policies and the backend's own
// GEMM and collective helpers launch, for element type T.
#define TESSERA_MODEL_KERNELS(T)                                                                                      \
  TESSERA_LAUNCH_OP(ops::Fill<T>)                                                                                     \
  TESSERA_LAUNCH_OP(ops::Copy<T>)                                                                                     \
  TESSERA_LAUNCH_OP(ops::Add<T>)                                                                                      \
  TESSERA_LAUNCH_OP(ops::SumOfPieces<T>)                                                                              \
  TESSERA_LAUNCH_OP(ops::Axpy<T>)                                                                                     \
  TESSERA_LAUNCH_OP(ops::Scale<T>)                                                                                    \
  TESSERA_LAUNCH_OP(ops::InitValues<T>)                                                                               \
  TESSERA_LAUNCH_OP(ops::EmbeddingForward<T>)                                                                         \
  TESSERA_LAUNCH_OP(ops::EmbeddingBackward<T>)                                                                        \
  TESSERA_LAUNCH_OP(ops::RmsNormForward<T>)                                                                           \
  TESSERA_LAUNCH_OP(ops::RmsNormBackwardInput<T>)                                                                     \
  TESSERA_LAUNCH_OP(ops::RmsNormBackwardWeight<T>)                                                                    \
  TESSERA_LAUNCH_OP(ops::RmsNormBackward<T>)                                                                          \
  TESSERA_LAUNCH_OP(ops::RopeRotate<T>)                                                                               \
  TESSERA_LAUNCH_OP(ops::SwiGluForward<T>)                                                                            \
  TESSERA_LAUNCH_OP(ops::SwiGluBackward<T>)                                                                           \
  TESSERA_LAUNCH_OP(ops::SwiGluForwardRows<T>)                                                                        \
  TESSERA_LAUNCH_OP(ops::SwiGluBackwardRows<T>)                                                                       \
  TESSERA_LAUNCH_OP(ops::SwiGluForwardPaired<T>)                                                                      \
  TESSERA_LAUNCH_OP(ops::SwiGluBackwardPaired<T>)                                                                     \
  TESSERA_LAUNCH_OP(ops::CausalSoftmaxForward<T>)                                                                     \
  TESSERA_LAUNCH_OP(ops::CausalSoftmaxRecompute<T>)                                                                   \
  TESSERA_LAUNCH_OP(ops::CausalSoftmaxBackward<T>)                                                                    \
  TESSERA_LAUNCH_OP(ops::RowDot<T>)                                                                                   \
  TESSERA_LAUNCH_OP(ops::CrossEntropyRow<T>)                                                                          \
  TESSERA_LAUNCH_OP(ops::CrossEntropyShardMax<T>)                                                                     \
  TESSERA_LAUNCH_OP(ops::CrossEntropyShardExp<T>)                                                                     \
  TESSERA_LAUNCH_OP(ops::CrossEntropyShardGrad<T>)                                                                    \
  TESSERA_LAUNCH_OP(ops::SquaredNormChunks<T>)                                                                        \
  TESSERA_LAUNCH_OP(ops::AdamWMultiStep<T, float>)                                                                    \
  TESSERA_LAUNCH_OP(ops::AdamWMultiStep<T, bf16>)                                                                     \
  TESSERA_LAUNCH_OP(nn::detail::InterleaveColumns<T>)                                                                 \
  TESSERA_LAUNCH_OP(parallel::detail::CopyPieceRow<T>)                                                                \
  TESSERA_LAUNCH_OP(cuda::detail::ScaleMatrix<T>)                                                                     \
  TESSERA_LAUNCH_OP(cuda::detail::ReduceInto<T>)                                                                      \
  TESSERA_LAUNCH_OP(ops::RowAbsMax<T>)                                                                                \
  TESSERA_LAUNCH_OP(ops::RowAbsMaxScale<T>)                                                                           \
  TESSERA_LAUNCH_OP(ops::ColumnAbsMax<T>)                                                                             \
  TESSERA_LAUNCH_OP(ops::QuantizeFloat8<T, float8_e4m3>)                                                              \
  TESSERA_LAUNCH_OP(ops::QuantizeFloat8<T, float8_e5m2>)                                                              \
  TESSERA_LAUNCH_OP(ops::CastRowsFloat8<T, float8_e4m3>)                                                              \
  TESSERA_LAUNCH_OP(ops::CastRowsFloat8<T, float8_e5m2>)                                                              \
  TESSERA_LAUNCH_OP(ops::Float8GemmScale<T>)                                                                          \
  TESSERA_LAUNCH_OP(ops::MergeAttention<T>)                                                                           \
  TESSERA_LAUNCH_OP(ops::AccumulateInto<T>)                                                                           \
  template void cuda::flash_attention_forward(const AttentionShape&, TensorView<const T>, TensorView<const T>,        \
                                              TensorView<const T>, TensorView<T>, float*, cudaStream_t, float*);      \
  template void cuda::flash_attention_backward(const AttentionShape&, TensorView<const T>, TensorView<const T>,       \
                                               TensorView<const T>, TensorView<const T>, const float*,                \
                                               TensorView<const T>, TensorView<T>, TensorView<T>, TensorView<T>,      \
                                               float*, cudaStream_t);

TESSERA_MODEL_KERNELS(float)
TESSERA_MODEL_KERNELS(bf16)

// Not per model element type: one tensor's AdamW in fp32, conversions between fp32 and
// bf16, the bf16 rounding of fp32 master weights and the bf16 packing of FSDP's gathers,
// and the collectives' other reductions.
TESSERA_LAUNCH_OP(ops::AdamWStep<float>)
TESSERA_LAUNCH_OP(ops::Convert<float, float>)
TESSERA_LAUNCH_OP(ops::Convert<float, bf16>)
TESSERA_LAUNCH_OP(ops::CrossEntropyRow<float, bf16>)  // the bf16 model's loss head: fp32 logits, bf16 gradient
TESSERA_LAUNCH_OP(ops::Convert<bf16, float>)
TESSERA_LAUNCH_OP(optim::detail::RoundToBf16)
TESSERA_LAUNCH_OP(parallel::detail::PackBf16)
TESSERA_LAUNCH_OP(parallel::detail::UnpackBf16)
TESSERA_LAUNCH_OP(cuda::detail::ReduceInto<double>)
TESSERA_LAUNCH_OP(ops::LaneSum)  // a step's loss sum and gradient norm, added on the device
TESSERA_LAUNCH_OP(ops::ClipScale<float>)
TESSERA_LAUNCH_OP(ops::BlockDocuments)  // the context-parallel ring's bounds of packed documents
TESSERA_LAUNCH_OP(ops::RaggedOffsets)   // packed documents as cuDNN's variable-length attention takes them
TESSERA_LAUNCH_OP(ops::StatsLayout)
TESSERA_LAUNCH_OP(cuda::detail::ReduceInto<std::int32_t>)
TESSERA_LAUNCH_OP(cuda::detail::ReduceInto<std::int64_t>)
// Float8 GEMMs (nn/float8.hpp): the tensor amax, the scales, one scale given to every row,
// the float8 values widened.
TESSERA_LAUNCH_OP(ops::MaxOf)
TESSERA_LAUNCH_OP(ops::Float8ScaleFromAmaxes)
TESSERA_LAUNCH_OP(ops::Float8ScaleFromAmax)
TESSERA_LAUNCH_OP(ops::Float8ScaleBroadcast)
TESSERA_LAUNCH_OP(ops::Float8Transpose<float8_e4m3>)  // a weight (FSDP) or an input (TP) gathered in float8
TESSERA_LAUNCH_OP(ops::Float8Transpose<float8_e5m2>)  // an output gradient gathered in float8 (TP)
TESSERA_LAUNCH_OP(ops::Copy<float8_e4m3>)  // a rank's own rows into a gather in float8 cut by peer (asynchronous TP)
TESSERA_LAUNCH_OP(ops::Copy<float8_e5m2>)
TESSERA_LAUNCH_OP(ops::Float8ToFloat<float8_e4m3>)
TESSERA_LAUNCH_OP(ops::Float8ToFloat<float8_e5m2>)

#undef TESSERA_MODEL_KERNELS
#undef TESSERA_LAUNCH_OP

}  // namespace tessera
