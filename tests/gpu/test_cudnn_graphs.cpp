// cuDNN's attention graphs checked without a GPU: the graphs the cuDNN engine builds
// (backend/cuda/cudnn_attention_impl.hpp), dense and variable-length over packed
// documents, put through the frontend's own validation for a Hopper and an Ampere GPU,
// against the libcudnn this machine loads (cuda::cudnn_attention_validate). That is
// every attribute, layout and support rule the frontend checks before it asks the
// library: what a machine without a device can say of a graph before its first run.
// The GPU suite (test_gpu_cudnn.cpp) then runs them. Where the build has no frontend or
// the machine no libcudnn, the cases say why and check nothing else.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "tessera/backend/cuda/cudnn_attention.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace {

using tessera::AttentionShape;
using tessera::cuda::cudnn_attention_validate;

bool cudnn_here() {
  if (tessera::cuda::cudnn_frontend_version().empty()) {
    MESSAGE("cuDNN graphs not checked: this build has no cuDNN frontend");
    return false;
  }
  const tessera::cuda::CudnnAvailability a = tessera::cuda::cudnn_availability();
  if (!a.ok) MESSAGE("cuDNN graphs not checked: " << a.why_not);
  else MESSAGE("cuDNN graphs checked against " << a.library << ", frontend " << tessera::cuda::cudnn_frontend_version());
  return a.ok;
}

AttentionShape with_documents(AttentionShape s, std::int64_t slots) {
  s.document_slots = slots;
  return s;
}

}  // namespace

TEST_CASE("cuDNN's attention graphs pass the frontend's validation on sm_90: dense, full and variable-length") {
  if (!cudnn_here()) return;
  for (bool deterministic : {false, true})
    for (std::int64_t kv : {1, 2, 8}) {
      CAPTURE(deterministic);
      CAPTURE(kv);
      const AttentionShape causal{2, 150, 8, kv, 128};
      CHECK(cudnn_attention_validate(causal, deterministic, 90) == "");
      AttentionShape full = causal;
      full.causal = false;
      CHECK(cudnn_attention_validate(full, deterministic, 90) == "");
      // Packed documents: one slot a sequence (the start-up probe's) and 64 (Llama 3's
      // 8192-token windows of short documents), at 8B's head dim and grouping.
      CHECK(cudnn_attention_validate(with_documents(causal, 1), deterministic, 90) == "");
      CHECK(cudnn_attention_validate(with_documents(AttentionShape{1, 8192, 32, 8, 128}, 64), deterministic, 90) ==
            "");
    }
}

TEST_CASE("cuDNN's variable-length graphs are refused on sm_80, as attention_choice.hpp's rule says, and bad shapes") {
  if (!cudnn_here()) return;
  const AttentionShape documents = with_documents(AttentionShape{2, 150, 8, 2, 64}, 4);
  // The backward reads token-major statistics on sm_90 and sm_100 only, so llama-train
  // runs tessera's kernels over packed documents on an A100 (the dense graphs run there).
  CHECK(cudnn_attention_validate(AttentionShape{2, 150, 8, 2, 64}, false, 80) == "");
  for (bool deterministic : {false, true}) {
    const std::string why = cudnn_attention_validate(documents, deterministic, 80);
    CAPTURE(why);
    CHECK(why.find("cuDNN attention backward (batch 2, seq 150, 8 heads (2 kv), head dim 64, packed documents "
                   "(4 slots a sequence)): validate: ") == 0);
  }
  // A head dim no multiple of 8: the shape named, the frontend's reason after it.
  const std::string odd = cudnn_attention_validate(AttentionShape{1, 64, 2, 1, 12}, false, 90);
  CAPTURE(odd);
  CHECK(odd.find("cuDNN attention forward (batch 1, seq 64, 2 heads (1 kv), head dim 12): validate: ") == 0);
}
