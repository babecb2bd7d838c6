// FSDP's CPU offload (training.enable_cpu_offload, parallel/sharding.hpp): each rank's
// flat shards, their gradients and AdamW's state live in host memory (Device::host,
// backend/host.hpp) and the optimizer runs on the host's loops. Held here:
// - each layout (one rank, FSDP with two micro-batches, HSDP, bf16 parameters with
//   their fp32 masters, bf16 moments, tensor and pipeline parallelism beside FSDP, FSDP's
//   float8 all-gather)
//   trains bit for bit the model it trains without offload: the same losses and
//   gradient norms;
// - the shards and the optimizer's state leave the device's count and appear in the
//   host's: on one rank, the device's peak falls by at least the 16 bytes a parameter
//   of fp32 values, gradients and moments less what a step gathers;
// - what it cannot do is refused by key: DDP alone, and a CUDA graph.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "harness.hpp"
#include "with_and_without.hpp"
#include "tessera/comm/thread.hpp"

namespace test_cpu_offload {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

#if TESSERA_SHORT_TESTS
constexpr int kSteps = 2;
#else
constexpr int kSteps = 4;
#endif

const std::vector<std::string> kOffload = {"--training.enable_cpu_offload", "true"};
}  // namespace

TEST_CASE("cpu offload: each layout trains bit for bit the model it trains without offload") {
  const NamedLayout layouts[] = {
      {"one rank (FSDP over itself)", {}, 8, {}},
      {"FSDP 2, two micro-batches (the second gradient added on the host)", {1, 1, 2, 1}, 2, {}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, 2, {}},
      {"FSDP 2, bf16 parameters (fp32 masters on the host)", {1, 1, 2, 1}, 4,
       {"--training.mixed_precision_param", "bfloat16"}},
      {"FSDP 2, bf16 moments", {1, 1, 2, 1}, 4, {"--optimizer.state_dtype", "bfloat16"}},
      {"TP 2 x FSDP 2", {1, 1, 2, 2}, 4, {}},
      {"PP 2 x FSDP 2, 1F1B", {2, 1, 2, 1}, 4, {"--parallelism.pipeline_parallel_microbatch_size", "2"}},
      {"FSDP 2, float8 all-gather (the scales agreed from the staged shards)", {1, 1, 2, 1}, 4,
       {"--training.mixed_precision_param", "bfloat16", "--model.converters", "float8", "--float8.emulate", "true",
        "--float8.enable_fsdp_float8_all_gather", "true"}},
  };
  each_layout_with_and_without(layouts, {}, kOffload, kSteps, [](const RunResult& plain, const RunResult& offloaded) {
    CHECK(offloaded.losses == plain.losses);
    CHECK(offloaded.grad_norms == plain.grad_norms);
  });
}

TEST_CASE("cpu offload: the shards and the optimizer's state leave the device for the host") {
  const train::JobConfig plain_job = debug_job(8, 8, 2);
  const std::int64_t params = plain_job.model.args.num_params();
  std::size_t host_peak = 0;
  RunResult plain, offloaded;
  {
    MemoryStats stats[kDeviceKinds];  // its own count: the process's peak is every earlier test's too
    ScopedMemoryStats scope(stats);
    plain = train_layout(comm::Communicator(), {}, plain_job);
  }
  {
    MemoryStats stats[kDeviceKinds];
    ScopedMemoryStats scope(stats);
    offloaded = train_layout(comm::Communicator(), {}, debug_job(8, 8, 2, kOffload));
    host_peak = stats[static_cast<int>(Device::host)].peak();
    CHECK(stats[static_cast<int>(Device::host)].at_peak().by_use[static_cast<std::size_t>(MemoryUse::optimizer)] >=
          static_cast<std::size_t>(params) * 2 * sizeof(float));
  }
  CHECK(offloaded.losses == plain.losses);
  // fp32 values and gradients (8 bytes a parameter) and two moments (8 more) live on the
  // host; the device holds one unit's gathered values and gradients at a time.
  CHECK(host_peak >= static_cast<std::size_t>(params) * 16);
  CHECK(offloaded.peak_memory_bytes + static_cast<std::size_t>(params) * 12 <= plain.peak_memory_bytes);
}

TEST_CASE("cpu offload: DDP alone and a CUDA graph are refused by key") {
  CHECK_ERROR_CONTAINS(layout_run({1, 2, 1, 1}, kOffload, 4, 1), "training.enable_cpu_offload");
  CHECK_ERROR_CONTAINS(train_layout(comm::Communicator(), {}, debug_job(8, 8, 1, with(kOffload, {"--training.cuda_graph", "true"}))),
                       "training.enable_cpu_offload");
}

}  // namespace test_cpu_offload
