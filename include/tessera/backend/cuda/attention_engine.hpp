// Which attention the CUDA backend runs on bf16 tensors: the project's flash kernels
// (flash_attention.cuh, the default) or an engine a program installs once at start-up,
// such as cuDNN's fused SDPA (cudnn_attention.hpp).
//
// The seam is one process-wide pointer to a table of plain functions, null unless a
// program sets it. Cuda::attention_forward/backward<bf16> read it on every call and pass
// the engine the views, the stream, and the device's caching allocator (for its
// workspace), so an engine is host C++ that never includes the backend's kernels, and a
// program that installs none links nothing of it. float tensors always run the
// project's kernels (cuDNN's SDPA has no fp32 path).
//
// The engine's contract is the backend's: q, o (B*T, H*hd), k, v (B*T, KV*hd), row-major
// with an ld each; causal, or no mask when shape.causal is false; head h reads kv head
// h / (H/KV); scale 1/sqrt(hd); lse (B, H, T) fp32, the natural-log log-sum-exp of the
// scaled scores; the backward overwrites dq, dk and dv. The backward takes the o and lse
// it is given, which need not be its own forward's: a context-parallel block is given
// the merged attention's, and P = exp(S - lse), D = rowsum(dO * O) of those are its share
// of the gradients. Over packed documents (shape.documents with its document table) an
// engine that takes them ragged (AttentionEngine::ragged) is given the call's
// RaggedDocuments; the backend runs every other call over documents on its own kernels.
// An engine throws a tessera::Error naming itself and the shape when it cannot run a
// call.
//
// Host C++ only (g++ compiles it): the engine's own translation unit includes it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera::cuda {

/// A call over packed documents in cuDNN's variable-length ("ragged") layout
/// (ops/ragged_documents.hpp), staged by the backend on the call's stream from the
/// shape's document table: `entries` = batch x document_slots documents, each tensor's
/// offsets (ops::RaggedTensor order, entries + 1 int64 elements each) and the documents'
/// lengths (entries); the log-sum-exp token-major, (rows, H) in `stats`, which a forward
/// writes and a backward reads in place of lse (the backend moves it to and from lse).
struct RaggedDocuments {
  std::int64_t entries = 0;
  const std::int64_t* offsets = nullptr;
  const std::int32_t* lengths = nullptr;
  float* stats = nullptr;
};

/// One attention forward call: o and lse from q, k, v.
struct AttentionForwardCall {
  AttentionShape shape;
  TensorView<const bf16> q, k, v;
  TensorView<bf16> o;
  float* lse;  // (B, H, T)
  cudaStream_t stream;
  int device;                   // the current device
  CachingAllocator* allocator;  // that device's, for workspace
  const RaggedDocuments* ragged = nullptr;  // packed documents (shape.documents); nullptr: none
};

/// One attention backward call: dq, dk, dv (all overwritten) from the forward's
/// inputs, o, lse and d_o.
struct AttentionBackwardCall {
  AttentionShape shape;
  TensorView<const bf16> q, k, v, o;
  const float* lse;  // (B, H, T)
  TensorView<const bf16> d_o;
  TensorView<bf16> dq, dk, dv;
  cudaStream_t stream;
  int device;
  CachingAllocator* allocator;
  const RaggedDocuments* ragged = nullptr;
};

/// An attention implementation for bf16 tensors.
struct AttentionEngine {
  const char* name;  // "cudnn"
  void (*forward)(const AttentionForwardCall&);
  void (*backward)(const AttentionBackwardCall&);
  bool ragged = false;  // takes packed documents as RaggedDocuments (else the project's kernels run them)
};

namespace detail {
inline std::atomic<const AttentionEngine*>& attention_engine_slot() {
  static std::atomic<const AttentionEngine*> slot{nullptr};
  return slot;
}
}  // namespace detail

/// The engine bf16 attention runs on; nullptr: the project's flash kernels.
inline const AttentionEngine* attention_engine() {
  return detail::attention_engine_slot().load(std::memory_order_acquire);
}

/// Installs `engine` (nullptr: back to the project's kernels) for every later call in
/// this process. A program sets it once at start-up, before the first step; the GPU
/// tests switch it between cases.
inline void set_attention_engine(const AttentionEngine* engine) {
  detail::attention_engine_slot().store(engine, std::memory_order_release);
}

}  // namespace tessera::cuda
