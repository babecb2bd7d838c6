// Attention through cuDNN's fused SDPA (flash attention), reached with the cuDNN
// frontend's C++ graph API: the declarations. The definitions are in
// cudnn_attention_impl.hpp, which ONE translation unit of a program includes (the
// frontend's headers are heavy, so they are compiled once; llama-train and the GPU
// tests link examples/cudnn_attention.cpp). That file compiles with or without the
// frontend's headers: without them (TESSERA_WITH_CUDNN_FRONTEND unset) every entry
// point reports that the build has no frontend, so a program links the same either way.
//
// Use: cudnn_availability() loads libcudnn at run time (the frontend's dynamic loading:
// binaries do not link cuDNN, and a machine without it says so instead of failing to
// start); cudnn_attention_support() builds the graphs of one shape and returns cuDNN's
// reason if it refuses them; set_attention_engine(cudnn_attention_engine(...)) makes
// Cuda::attention_forward/backward<bf16> run through cuDNN (attention_engine.hpp).
//
// What runs: grouped-query SDPA, causal (top-left diagonal) or, for a full call
// (AttentionShape::causal false: a context-parallel block off the diagonal), without a
// mask; or over packed documents as cuDNN's variable-length (ragged) attention, each
// document one entry (the backend stages the layout: ops/ragged_documents.hpp);
// bf16 in and out, fp32 softmax and statistics, scale 1/sqrt(hd). Q, K, V, O and their gradients are read and
// written in the model's own (B*T, heads*hd) layouts through strides, with no permute
// copies; the forward's Stats output is the (B, H, T) log-sum-exp the backend's
// contract names (natural log, of the scaled scores: the project's convention), and
// the backward overwrites dQ, dK and dV. Graphs are built once per (device, direction,
// deterministic, B, T, H, KV, hd, causal, every operand's ld) and cached; each device has one
// cudnnHandle and one workspace from its caching allocator that grows to the largest
// graph's need and is kept. Calls on one device are serialised by a mutex (thread ranks
// sharing a GPU); all work goes to the stream each call names.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/cuda/attention_engine.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera::cuda {

/// The cuDNN frontend version this program was built with ("1.32.0"); empty when the
/// build had no frontend headers.
std::string cudnn_frontend_version();

/// Whether cuDNN can be used at run time: libcudnn.so.9 loaded (once, by dlopen) and
/// its version (9.0 or newer).
struct CudnnAvailability {
  bool ok = false;
  std::string why_not;  // when !ok: what is missing, e.g. "libcudnn.so.9 was not found at run time (...)"
  std::string library;  // when ok: "cuDNN 9.19.0"
  std::int64_t version = 0;  // when ok: cudnnGetVersion()'s 91900
};
CudnnAvailability cudnn_availability();

/// Builds (and caches) the forward and backward graphs of `shape` (its mask included;
/// with document_slots, the variable-length graphs of packed documents, that many a
/// sequence) with packed operands (ld = heads * hd) on the current device. Empty when cuDNN runs them, else cuDNN's
/// reason. Needs cudnn_availability().ok.
std::string cudnn_attention_support(const AttentionShape& shape, bool deterministic_backward);

/// The frontend's own validation of the graphs cudnn_attention_support builds for `shape`,
/// taken for a GPU of compute capability `sm_version` (90: sm_90) with no device at all:
/// every attribute, layout and support rule the frontend checks before it asks the
/// library (against the version of the libcudnn loaded). Empty when the graphs pass, else
/// the frontend's reason. What a machine without a GPU can check of them
/// (tests/gpu/test_cudnn_graphs.cpp); cuDNN's own word on a device is
/// cudnn_attention_support's.
std::string cudnn_attention_validate(const AttentionShape& shape, bool deterministic_backward, int sm_version);

/// The engine that runs attention through cuDNN; `deterministic_backward` asks cuDNN
/// for its deterministic backward (no atomics in dQ; a workspace of B*H*T*T*2 bytes on
/// some GPUs). Needs cudnn_availability().ok.
const AttentionEngine* cudnn_attention_engine(bool deterministic_backward);

}  // namespace tessera::cuda
