// training.attention on the GPU, decided and installed in one call: the facts of this
// build, library and device gathered, the rule of attention_choice.hpp applied, cuDNN's
// own word asked on the run's shape, and the chosen engine set for every attention call
// that follows. llama-train and bench-train both start this way, so a benchmark measures
// the attention a training run would use.
//
// Needs the CUDA runtime and a program that links the cuDNN attention library
// (examples/cudnn_attention.cpp), as every binary that includes this header does.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "tessera/backend/cuda/attention_choice.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/cudnn_attention.hpp"
#include "tessera/backend/cuda/memory.hpp"

namespace tessera::cuda {

/// Decides training.attention = `requested` for a model whose one-rank attention call
/// is `shape` (heads already divided by tensor parallelism, one micro-batch), in bf16 or
/// not, on the current device, and installs the choice (cuDNN's engine, or none: the
/// project's flash kernels). `full_blocks`: the run also calls `shape` without a mask
/// (context parallelism's blocks off the diagonal), so cuDNN is asked about those graphs
/// too. `documents`: the run masks packed documents apart (training.document_mask), so
/// cuDNN is asked about its variable-length graphs (one document slot a sequence: the
/// graphs of more slots are built as batches need them). Returns the decision and its
/// start-up text; a "cudnn" that cannot run throws, naming the key and the reason.
inline AttentionChoice select_attention(const std::string& requested, bool bf16_model, const AttentionShape& shape,
                                        bool deterministic, bool full_blocks = false, bool documents = false) {
  AttentionFacts f;
  f.on_gpu = true;
  f.bf16_model = bf16_model;
  f.frontend = cuda::cudnn_frontend_version();
  const int device = cuda::current_device();
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&f.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  f.head_dim = shape.head_dim;
  f.deterministic = deterministic;
  f.documents = documents;
  f.context_parallel = full_blocks;
  // libcudnn is loaded only where it could be used.
  if (requested != "tessera" && f.bf16_model && !f.frontend.empty()) {
    const cuda::CudnnAvailability lib = cuda::cudnn_availability();
    f.library = lib.library;
    f.library_version = lib.version;
    f.library_error = lib.why_not;
  }
  // cuDNN's own word: the graphs of the shape, built now and kept for the first step.
  const AttentionChoice choice = choose_attention(requested, f, [&] {
    AttentionShape whole = shape;
    if (documents) whole.document_slots = 1;
    std::string why = cuda::cudnn_attention_support(whole, deterministic);
    if (why.empty() && full_blocks) {
      AttentionShape full = shape;
      full.causal = false;
      why = cuda::cudnn_attention_support(full, deterministic);
    }
    return why;
  });
  cuda::set_attention_engine(choice.cudnn ? cuda::cudnn_attention_engine(deterministic) : nullptr);
  return choice;
}

}  // namespace tessera::cuda
