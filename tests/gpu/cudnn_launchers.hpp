// Host-side declarations for the cuDNN attention tests (defined in cudnn_launchers.cpp):
// which attention Cuda's bf16 calls run, cuDNN's own verdict on a shape, and one
// attention forward and backward through the backend. No CUDA header: g++ reads it.
#pragma once

#include <string>

#include "flash_launchers.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera::gpu_test {

/// Empty when cuDNN attention can run in this binary on this machine, else why not
/// (no frontend in the build, libcudnn.so.9 missing, ...).
std::string cudnn_unavailable();

/// The cuDNN frontend and library this binary uses, for the test log.
std::string cudnn_description();

/// Which attention Cuda::attention_forward/backward<bf16> run from now on.
enum class GpuAttention { tessera, cudnn, cudnn_deterministic };
void use_attention(GpuAttention a);

/// Puts tessera's kernels back when a test case ends, however it ends.
struct AttentionScope {
  explicit AttentionScope(GpuAttention a) { use_attention(a); }
  AttentionScope(const AttentionScope&) = delete;
  AttentionScope& operator=(const AttentionScope&) = delete;
  ~AttentionScope() { use_attention(GpuAttention::tessera); }
};

/// cuDNN's own verdict on `s` with packed operands: empty, or its reason.
std::string cudnn_support(const AttentionShape& s, bool deterministic);

/// One bf16 Cuda::attention_forward then Cuda::attention_backward (on the forward's o
/// and lse) with the attention use_attention() chose. Host matrices are dense; on the
/// device each row has `run.pad` extra columns. run.dq, dk, dv: the outputs' initial
/// contents in, the results out. run.bf16 must be true. With run.documents, packed
/// documents: a causal call also gets their document table (cuDNN's ragged layout).
void cuda_attention(FlashRun& run);

}  // namespace tessera::gpu_test
