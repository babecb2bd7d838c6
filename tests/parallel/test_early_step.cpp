// The early step (optimizer.early_step_in_backward, parallel/model_units.hpp): AdamW
// updates each sharding unit in the last micro-batch's backward as soon as the unit's
// gradient is reduced, and frees the unit's gradient shard. Held here:
// - without clipping, each layout (one rank and tensor parallelism alone as FSDP over
//   themselves, FSDP with one and two micro-batches, HSDP, DDP, TP x FSDP, context
//   parallelism, bf16 parameters with bf16 moments, CPU offload, FSDP's float8
//   all-gather) trains bit for bit the model its step without the early step trains,
//   and reports the same gradient norm (summed unit by unit: to a few ulps);
// - on one rank the step's peak falls by most of the 4 bytes a parameter the whole
//   fp32 gradient took;
// - (test_sharded_checkpoint.cpp: a checkpoint saved under it resumes without it, and back);
// - what it cannot do is refused by key: clipping, a pipeline, a CUDA graph.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "harness.hpp"
#include "with_and_without.hpp"
#include "tessera/comm/thread.hpp"

namespace test_early_step {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

#if TESSERA_SHORT_TESTS
constexpr int kSteps = 2;
#else
constexpr int kSteps = 4;
#endif

const std::vector<std::string> kNoClip = {"--training.max_norm", "0"};
const std::vector<std::string> kEarly = {"--optimizer.early_step_in_backward", "true"};
}  // namespace

TEST_CASE("early step: each layout trains bit for bit the model its step without it trains") {
  const NamedLayout layouts[] = {
      {"one rank (FSDP over itself)", {}, 8, {}},
      {"FSDP 2", {1, 1, 2, 1}, 4, {}},
      {"FSDP 2, two micro-batches (the step in the second's backward)", {1, 1, 2, 1}, 2, {}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, 2, {}},
      {"DDP 2 (the bucket stays, each unit updated as its all-reduce completes)", {1, 2, 1, 1}, 4, {}},
      {"TP 2 (FSDP over one rank beside it)", {1, 1, 1, 2}, 8, {}},
      {"TP 2 x FSDP 2", {1, 1, 2, 2}, 4, {}},
      {"CP 2 (FSDP over the context-parallel ranks)", {1, 1, 1, 1, 2}, 8, {}},
      {"FSDP 2, bf16 parameters and bf16 moments", {1, 1, 2, 1}, 4,
       {"--training.mixed_precision_param", "bfloat16", "--optimizer.state_dtype", "bfloat16"}},
      {"FSDP 2, CPU offload (AdamW on the host, unit by unit)", {1, 1, 2, 1}, 4, {"--training.enable_cpu_offload", "true"}},
      {"FSDP 2, float8 all-gather", {1, 1, 2, 1}, 4,
       {"--training.mixed_precision_param", "bfloat16", "--model.converters", "float8", "--float8.emulate", "true",
        "--float8.enable_fsdp_float8_all_gather", "true"}},
  };
  each_layout_with_and_without(layouts, kNoClip, kEarly, kSteps, [](const RunResult& plain, const RunResult& early) {
    CHECK(early.losses == plain.losses);
    REQUIRE(early.grad_norms.size() == plain.grad_norms.size());
    for (std::size_t s = 0; s < plain.grad_norms.size(); ++s) {
      CAPTURE(s);
      CHECK(plain.grad_norms[s] > 0);
      CHECK(std::abs(early.grad_norms[s] - plain.grad_norms[s]) <= 1e-12 * plain.grad_norms[s]);
    }
  });
}

TEST_CASE("early step: on one rank the whole gradient is never held") {
  const train::JobConfig plain_job = debug_job(8, 8, 2, kNoClip);
  const auto params = static_cast<std::size_t>(plain_job.model.args.num_params());
  // Each run counts its own memory (the process's peak is every earlier test's too).
  struct Measured {
    RunResult run;
    std::size_t gradients_at_peak = 0;
  };
  const auto measured = [](const train::JobConfig& c) {
    MemoryStats stats[kDeviceKinds];
    ScopedMemoryStats scope(stats);
    Measured m;
    m.run = train_layout(comm::Communicator(), {}, c);
    m.gradients_at_peak = stats[static_cast<int>(Device::cpu)].at_peak().by_use[static_cast<std::size_t>(MemoryUse::gradients)];
    return m;
  };
  const Measured plain = measured(plain_job);
  const Measured early = measured(debug_job(8, 8, 2, with(kNoClip, kEarly)));
  CHECK(early.run.losses == plain.run.losses);
  MESSAGE("peak ", plain.run.peak_memory_bytes, " -> ", early.run.peak_memory_bytes, " bytes; gradients at the peak ",
          plain.gradients_at_peak, " -> ", early.gradients_at_peak, "; ", params, " parameters");
  // The fp32 gradient, 4 bytes a parameter, is whole at the plain step's peak; under the
  // early step a unit's gradient lives from its backward to its update (the largest
  // unit, the embedding, is a fifth of the parameters; on one rank its reduction is the
  // gradient itself), so the peak falls by most of it.
  CHECK(plain.gradients_at_peak >= params * sizeof(float));
  CHECK(early.gradients_at_peak <= params * sizeof(float) / 4);
  CHECK(early.run.peak_memory_bytes + params * 3 <= plain.run.peak_memory_bytes);
}

TEST_CASE("early step: clipping, a pipeline and a CUDA graph are refused by key") {
  CHECK_ERROR_CONTAINS(train_layout(comm::Communicator(), {}, debug_job(8, 8, 1, kEarly)), "training.max_norm");
  CHECK_ERROR_CONTAINS(layout_run({2, 1, 1, 1}, with(with(kNoClip, kEarly), {"--parallelism.pipeline_parallel_microbatch_size", "2"}), 4, 1),
                       "optimizer.early_step_in_backward");
  CHECK_ERROR_CONTAINS(train_layout(comm::Communicator(), {}, debug_job(8, 8, 1, with(with(kNoClip, kEarly), {"--training.cuda_graph", "true"}))),
                       "training.cuda_graph");
}

}  // namespace test_early_step
