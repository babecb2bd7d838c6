// training.attention: which attention a run on the GPU uses, decided once at start-up.
//
//   "tessera"  the project's flash kernels (any model, any GPU the build targets)
//   "cudnn"    cuDNN's fused SDPA through its frontend; refused, naming the key and the
//              reason, where it cannot run
//   "auto"     cuDNN where it can run, else the project's kernels, saying why
//
// cuDNN runs a bf16 model on sm_80 or newer, in a build that has the frontend's headers,
// where libcudnn.so.9 loads at run time, for head dims cuDNN accepts (a multiple of 8, at
// most 128 before sm_90 and 256 from it), and only when cuDNN itself builds the model's
// graphs (the probe: cuDNN's own word on the shape, the GPU and the library version).
// Packed documents masked apart (training.document_mask) run as cuDNN's variable-length
// (ragged) attention, each document one entry (ops/ragged_documents.hpp): that needs
// cuDNN 9.6 or newer, sm_90 or sm_100 (elsewhere its backward does not read the
// token-major statistics the graphs keep), and whole sequences: the
// blocks of context parallelism's ring are not whole documents, so a run with both masks
// them with tessera's kernels.
// The facts are gathered by the trainer (examples/llama/llama_train_cuda.cpp); the rule
// is here, host C++ with no CUDA header, so every refusal and fallback is tested without
// a GPU and llama-plan prices the attention a run would choose (plan/cost.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "tessera/core/error.hpp"

namespace tessera::cuda {

/// What decides training.attention for one run.
struct AttentionFacts {
  bool on_gpu = false;              // training.device resolved to cuda
  bool bf16_model = false;          // training.mixed_precision_param = "bfloat16"
  std::string frontend;             // the cuDNN frontend version built in; empty: none
  std::string library;              // "cuDNN 9.19.0" when libcudnn loaded
  std::string library_error;        // why libcudnn cannot be used; empty: it loaded
  int cc_major = 0, cc_minor = 0;   // the GPU's compute capability
  std::int64_t head_dim = 0;
  bool deterministic = false;       // training.deterministic: cuDNN's deterministic backward
  std::int64_t library_version = 0;  // cudnnGetVersion()'s 91900 when libcudnn loaded
  bool documents = false;           // training.document_mask: packed documents masked apart
  bool context_parallel = false;    // parallelism.context_parallel_degree > 1: attention runs in ring blocks
};

/// The decision and how the start-up line reports it.
struct AttentionChoice {
  bool cudnn = false;
  std::string text;  // "cudnn (cuDNN 9.19.0, frontend 1.32.0)", "tessera (auto: <why not cudnn>)", ...
};

/// Why cuDNN cannot run this job, from the facts alone; empty when nothing stops it.
inline std::string cudnn_refusal(const AttentionFacts& f) {
  using tessera::detail::concat;
  if (!f.on_gpu) return "this run trains on the CPU (training.device); cuDNN attention runs on a GPU";
  if (f.documents && f.context_parallel)
    return "packed documents (training.document_mask) under context parallelism: the ring's blocks are not whole "
           "documents, which cuDNN's variable-length attention takes; tessera's kernels mask them";
  if (!f.bf16_model)
    return "the model is float32 (training.mixed_precision_param = \"float32\"); cuDNN attention runs bf16 models";
  if (f.frontend.empty()) return "this build has no cuDNN frontend headers (run tools/install-deps.sh and rebuild)";
  if (!f.library_error.empty()) return f.library_error;
  if (f.cc_major < 8)
    return concat("the GPU is sm_", f.cc_major, f.cc_minor, "; cuDNN attention needs sm_80 or newer");
  const std::int64_t max_hd = f.cc_major >= 9 ? 256 : 128;
  if (f.head_dim % 8 != 0 || f.head_dim > max_hd)
    return concat("head dim ", f.head_dim, " is not one cuDNN accepts on sm_", f.cc_major, f.cc_minor,
                  " (a multiple of 8, at most ", max_hd, ")");
  if (f.documents && f.library_version < 90600)
    return concat("packed documents (training.document_mask) run as cuDNN's variable-length attention, which needs "
                  "cuDNN 9.6 or newer (this is ", f.library, ")");
  if (f.documents && f.cc_major != 9 && f.cc_major != 10)
    return concat("packed documents (training.document_mask) run as cuDNN's variable-length attention, whose backward "
                  "reads token-major statistics on sm_90 and sm_100 only (this is sm_", f.cc_major, f.cc_minor, ")");
  return {};
}

/// Decides training.attention = `requested` ("auto", "cudnn" or "tessera"). `probe`
/// (called only when every fact allows cuDNN) builds cuDNN's graphs for the model's
/// shape and returns cuDNN's reason when it refuses them, empty when it accepts.
/// "cudnn" that cannot run throws, naming the key and the reason.
inline AttentionChoice choose_attention(const std::string& requested, const AttentionFacts& f,
                                        const std::function<std::string()>& probe) {
  using tessera::detail::concat;
  if (requested == "tessera") return {false, "tessera (training.attention)"};
  TESSERA_CHECK(requested == "auto" || requested == "cudnn", "training.attention must be one of auto, cudnn, tessera; got \"",
                requested, "\"");
  std::string why = cudnn_refusal(f);
  if (why.empty() && probe) {
    why = probe();
    if (!why.empty()) why = concat("cuDNN refuses the model's attention graphs: ", why);
  }
  if (why.empty())
    return {true, concat("cudnn (", f.library, ", frontend ", f.frontend,
                         f.deterministic ? ", deterministic backward" : "", ")")};
  TESSERA_CHECK(requested != "cudnn", "training.attention = \"cudnn\": ", why);
  return {false, concat("tessera (auto: ", why, ")")};
}

}  // namespace tessera::cuda
