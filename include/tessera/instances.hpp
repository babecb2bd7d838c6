// The model types tessera's own binaries, tests and benchmarks train, named once so that a
// build can compile them once.
//
// A file that trains a model compiles all of its code: the layers, the collectives, the
// pipeline runner, the trainer, the checkpoints; about ten seconds of the compiler at -O1
// for each model type, three times that under the sanitizers. A build with many such
// files can compile the common types once:
//
//   - every file is compiled with TESSERA_EXTERN_INSTANCES defined and includes this
//     header (or, for the dry run, tessera/plan/dry_run.hpp): its `extern template`
//     declarations keep the file from compiling the types' members itself;
//   - one file defines them, and is linked into every binary of the build:
//
//         #include "tessera/instances.hpp"
//         namespace tessera { TESSERA_CPU_MODEL_INSTANCES(template) }
//
// tessera's own build does this (examples/instances/, docs/testing.md). Nothing changes
// for a user who only includes the headers: without TESSERA_EXTERN_INSTANCES this header
// declares nothing, and the library stays header-only. Only members defined outside
// their class are kept out by an `extern template` (a member defined in its class is
// inline, and C++ lets every file instantiate those): nn::Transformer and
// train::Trainer define the members that reach the whole model that way.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/hf.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/evaluate.hpp"
#include "tessera/train/trainer.hpp"

/// The Llama model over the CPU in fp32: as a plain stack of Llama blocks (what
/// llama-eval, llama-generate and llama-checkpoint load, and what llama-train samples
/// from) with what those binaries call of it, and as the DynamicModel llama-train trains
/// (train/dynamic_model.hpp) with its trainer. `X` is `template` in the one file that
/// defines them, `extern template` elsewhere.
#define TESSERA_CPU_MODEL_INSTANCES(X)                                                                                 \
  X class nn::Transformer<float, Cpu>;                                                                                 \
  X void train::load_saved_model(nn::Transformer<float, Cpu>&, const std::string&, std::optional<std::uint64_t>);     \
  X void train::save_model(nn::Transformer<float, Cpu>&, const std::string&, DType);                                   \
  X void train::save_hf_model(nn::Transformer<float, Cpu>&, const std::string&, const train::HfSaveOptions&);          \
  X train::EvalResult train::evaluate(nn::Transformer<float, Cpu>&, std::span<const std::uint32_t>, std::int64_t,       \
                                      std::int64_t, const std::string&,                                                \
                                      const std::function<void(std::int64_t, std::int64_t)>&);                         \
  X std::string nn::generate_text(nn::Transformer<float, Cpu>&, const io::Tokenizer&, std::string_view,                \
                                  nn::SampleOptions);
#define TESSERA_CPU_DYNAMIC_MODEL_INSTANCES(X)                                                                         \
  X class nn::Transformer<float, Cpu, DynamicBlock<float, Cpu>>;                                                       \
  X class train::Trainer<DynamicModel<float, Cpu>>;

#if defined(TESSERA_EXTERN_INSTANCES)
namespace tessera {
TESSERA_CPU_MODEL_INSTANCES(extern template)
TESSERA_CPU_DYNAMIC_MODEL_INSTANCES(extern template)
}  // namespace tessera
#endif
