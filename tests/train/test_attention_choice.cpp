// training.attention, decided without a GPU: every reason "cudnn" is refused for names
// the key and the reason, "auto" falls back to tessera's kernels saying why, and cuDNN's
// own verdict (the probe) is asked only when nothing else stops it.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "../support/errors.hpp"
#include "tessera/backend/cuda/attention_choice.hpp"

namespace test_attention_choice {  // unity build: this file's names stay in here (tests/meson.build)

using tessera::cuda::AttentionChoice;
using tessera::cuda::AttentionFacts;
using tessera::cuda::choose_attention;

namespace {

/// An H100 with cuDNN 9.19 and the frontend, a bf16 model of head dim 128.
AttentionFacts runnable() {
  AttentionFacts f;
  f.on_gpu = true;
  f.bf16_model = true;
  f.frontend = "1.32.0";
  f.library = "cuDNN 9.19.0";
  f.library_version = 91900;
  f.cc_major = 9;
  f.cc_minor = 0;
  f.head_dim = 128;
  return f;
}

/// A probe that counts its calls and returns `verdict`.
struct Probe {
  std::string verdict;
  int calls = 0;
  std::function<std::string()> fn() {
    return [this] {
      ++calls;
      return verdict;
    };
  }
};

}  // namespace

TEST_CASE("training.attention: cudnn where it runs, with the library and frontend in the start-up line") {
  Probe probe;
  for (const char* requested : {"auto", "cudnn"}) {
    const AttentionChoice c = choose_attention(requested, runnable(), probe.fn());
    CHECK(c.cudnn);
    CHECK(c.text == "cudnn (cuDNN 9.19.0, frontend 1.32.0)");
  }
  CHECK(probe.calls == 2);
  AttentionFacts det = runnable();
  det.deterministic = true;
  CHECK(choose_attention("auto", det, probe.fn()).text == "cudnn (cuDNN 9.19.0, frontend 1.32.0, deterministic backward)");
  // tessera is never refused and never asks cuDNN.
  probe.calls = 0;
  const AttentionChoice own = choose_attention("tessera", runnable(), probe.fn());
  CHECK_FALSE(own.cudnn);
  CHECK(own.text == "tessera (training.attention)");
  CHECK(probe.calls == 0);
}

TEST_CASE("training.attention = cudnn where it cannot run: one error naming the key and the reason") {
  struct Case {
    const char* what;
    AttentionFacts facts;
    const char* reason;
  };
  AttentionFacts cpu = runnable(), fp32 = runnable(), no_frontend = runnable(), no_library = runnable();
  AttentionFacts turing = runnable(), odd_hd = runnable(), big_hd_ampere = runnable();
  AttentionFacts documents_ring = runnable(), documents_old = runnable(), documents_ampere = runnable();
  cpu.on_gpu = false;
  documents_ring.documents = documents_ring.context_parallel = true;
  documents_old.documents = true;
  documents_old.library = "cuDNN 9.5.1";
  documents_old.library_version = 90501;
  documents_ampere.documents = true;
  documents_ampere.cc_major = 8;
  documents_ampere.cc_minor = 6;
  fp32.bf16_model = false;
  no_frontend.frontend.clear();
  no_library.library_error = "libcudnn.so.9 was not found at run time (libcudnn.so.9: cannot open shared object file)";
  turing.cc_major = 7;
  turing.cc_minor = 5;
  odd_hd.head_dim = 12;
  big_hd_ampere.cc_major = 8;
  big_hd_ampere.head_dim = 256;
  const Case cases[] = {
      {"the CPU", cpu, "this run trains on the CPU (training.device); cuDNN attention runs on a GPU"},
      {"an fp32 model", fp32,
       "the model is float32 (training.mixed_precision_param = \"float32\"); cuDNN attention runs bf16 models"},
      {"no frontend in the build", no_frontend,
       "this build has no cuDNN frontend headers (run tools/install-deps.sh and rebuild)"},
      {"no cuDNN library at run time", no_library, "libcudnn.so.9 was not found at run time"},
      {"a GPU before sm_80", turing, "the GPU is sm_75; cuDNN attention needs sm_80 or newer"},
      {"a head dim that is no multiple of 8", odd_hd,
       "head dim 12 is not one cuDNN accepts on sm_90 (a multiple of 8, at most 256)"},
      {"head dim 256 on sm_80", big_hd_ampere, "head dim 256 is not one cuDNN accepts on sm_80 (a multiple of 8, at most 128)"},
      {"packed documents under context parallelism", documents_ring,
       "packed documents (training.document_mask) under context parallelism: the ring's blocks are not whole "
       "documents, which cuDNN's variable-length attention takes; tessera's kernels mask them"},
      {"packed documents before cuDNN 9.6", documents_old,
       "packed documents (training.document_mask) run as cuDNN's variable-length attention, which needs cuDNN 9.6 "
       "or newer (this is cuDNN 9.5.1)"},
      {"packed documents on sm_86", documents_ampere,
       "packed documents (training.document_mask) run as cuDNN's variable-length attention, whose backward reads "
       "token-major statistics on sm_90 and sm_100 only (this is sm_86)"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    Probe probe;
    CHECK_ERROR_CONTAINS(choose_attention("cudnn", c.facts, probe.fn()),
                         std::string("training.attention = \"cudnn\": ") + c.reason);
    const AttentionChoice fallback = choose_attention("auto", c.facts, probe.fn());
    CHECK_FALSE(fallback.cudnn);
    CHECK(fallback.text.rfind(std::string("tessera (auto: ") + c.reason, 0) == 0);
    CHECK(probe.calls == 0);  // refused before cuDNN is asked
  }
}

TEST_CASE("training.attention: packed documents run on cuDNN's variable-length attention where it can") {
  Probe probe;
  AttentionFacts hopper = runnable(), blackwell = runnable(), context_parallel = runnable();
  hopper.documents = blackwell.documents = true;
  blackwell.cc_major = 10;
  context_parallel.context_parallel = true;  // without documents the ring's blocks are cuDNN's
  for (const AttentionFacts& f : {hopper, blackwell, context_parallel}) {
    CHECK(choose_attention("cudnn", f, probe.fn()).cudnn);
    CHECK(choose_attention("auto", f, probe.fn()).cudnn);
  }
  CHECK(probe.calls == 6);  // each asked cuDNN's own word on the graphs
  AttentionFacts consumer_blackwell = runnable();  // sm_120: cuDNN refuses token-major statistics there
  consumer_blackwell.documents = true;
  consumer_blackwell.cc_major = 12;
  CHECK_FALSE(choose_attention("auto", consumer_blackwell, probe.fn()).cudnn);
}

TEST_CASE("training.attention: cuDNN's own refusal of the model's graphs, as an error or a fallback") {
  Probe probe{"cuDNN attention forward (batch 1, seq 64, 2 heads (1 kv), head dim 40): check_support: no engine"};
  CHECK_ERROR_CONTAINS(choose_attention("cudnn", runnable(), probe.fn()),
                       "training.attention = \"cudnn\": cuDNN refuses the model's attention graphs: cuDNN attention "
                       "forward (batch 1, seq 64, 2 heads (1 kv), head dim 40): check_support: no engine");
  const AttentionChoice c = choose_attention("auto", runnable(), probe.fn());
  CHECK_FALSE(c.cudnn);
  CHECK(c.text.rfind("tessera (auto: cuDNN refuses the model's attention graphs: ", 0) == 0);
  CHECK_ERROR_CONTAINS(choose_attention("flash", runnable(), probe.fn()),
                       "training.attention must be one of auto, cudnn, tessera; got \"flash\"");
}

}  // namespace test_attention_choice
