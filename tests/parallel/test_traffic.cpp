// Bytes sent per step, measured at the Communicator, against the analytic count of
// plan/traffic.hpp: the sharding schedule issues exactly the collectives it
// should (gathers per reshard policy, bf16 gathers, reductions per micro-batch;
// tensor parallelism's row gathers and reduce-scatters, loss-parallel reductions and
// recomputed forwards), and parameter memory per rank falls with the shard degree.
#include <doctest/doctest.h>

#include <vector>

#include "harness.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/plan/traffic.hpp"

namespace test_traffic {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

struct Case {
  const char* name;
  comm::MeshShape shape;
  std::int64_t micro_batches;
  std::vector<std::string> keys;
  std::int64_t local = 1;  // sequences per pass on a data-parallel rank
};

/// Every rank's bytes sent in one step (the second: the first has nothing special either).
std::vector<std::uint64_t> measured(const Case& k) {
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(k.shape.world()));
  const std::int64_t local = k.local;
  comm::run_thread_ranks(k.shape.world(), [&](comm::Communicator& world) {
    const train::JobConfig c = debug_job(local, local * k.shape.dp() * k.micro_batches, 2, k.keys);
    bytes[static_cast<std::size_t>(world.rank())] = train_layout(world, k.shape, c).comm_bytes;
  }, nccl_rules());
  return bytes;
}

}  // namespace

TEST_CASE("traffic: every rank sends what the analytic count says, for each sharding and reshard policy") {
  const Case cases[] = {
      {"FSDP 4, default", {1, 1, 4, 1}, 1, {}},
      {"FSDP 4, always", {1, 1, 4, 1}, 1, {"--parallelism.fsdp_reshard_after_forward", "always"}},
      {"FSDP 4, never", {1, 1, 4, 1}, 1, {"--parallelism.fsdp_reshard_after_forward", "never"}},
      {"FSDP 2, bf16 parameters, 2 micro-batches",
       {1, 1, 2, 1},
       2,
       {"--training.mixed_precision_param", "bfloat16"}},
      {"FSDP 3 (shards padded)", {1, 1, 3, 1}, 1, {}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, 1, {}},
      {"DDP 4, 2 micro-batches", {1, 4, 1, 1}, 2, {}},
      {"TP 4", {1, 1, 1, 4}, 1, {}},
      {"TP 4 over 2 kv heads, full checkpointing",
       {1, 1, 1, 4},
       1,
       {"--model.n_kv_heads", "2", "--activation_checkpoint.mode", "full"}},
      {"TP 2, no loss parallel, every 2nd layer checkpointed",
       {1, 1, 1, 2},
       1,
       {"--parallelism.disable_loss_parallel", "true", "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "2"}},
      {"TP 4 without sequence parallelism, full checkpointing",
       {1, 1, 1, 4},
       1,
       {"--parallelism.disable_sequence_parallel", "true", "--activation_checkpoint.mode", "full"}},
      {"TP 2, neither sequence nor loss parallel",
       {1, 1, 1, 2},
       1,
       {"--parallelism.disable_sequence_parallel", "true", "--parallelism.disable_loss_parallel", "true"}},
      {"FSDP 2 x TP 2 x PP 2 without sequence parallelism, 1F1B",
       {2, 1, 2, 2},
       2,
       {"--parallelism.disable_sequence_parallel", "true", "--parallelism.pipeline_parallel_schedule", "1F1B"},
       2},
      {"FSDP 2 x TP 2, selective op, 2 micro-batches",
       {1, 1, 2, 2},
       2,
       {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}},
      {"HSDP 2 x 2 x TP 2", {1, 2, 2, 2}, 1, {}},
      {"PP 2, 1F1B, 2 micro-batches", {2, 1, 1, 1}, 2, {"--parallelism.pipeline_parallel_schedule", "1F1B"}, 2},
      {"FSDP 2 x TP 2 x PP 2, InterleavedZeroBubble, full",
       {2, 1, 2, 2},
       1,
       {"--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble", "--activation_checkpoint.mode", "full"},
       2},
      {"HSDP 2 x 2 x PP 2, GPipe, microbatches of 2",
       {2, 2, 2, 1},
       1,
       {"--parallelism.pipeline_parallel_schedule", "GPipe", "--parallelism.pipeline_parallel_microbatch_size", "2"},
       4},
      {"DDP 2 x PP 4, Interleaved1F1B", {4, 2, 1, 1}, 1, {"--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"}, 4},
      // The V placement: the middle two stages share pipeline rank P-1, whose hand-over
      // sends nothing.
      {"FSDP 2 x PP 4, ZBVZeroBubble", {4, 1, 2, 1}, 1, {"--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"}, 4},
  };
  for (const Case& k : cases) {
    const std::string name = k.name;  // doctest prints a const char* as an address
    CAPTURE(name);
    const train::JobConfig c = debug_job(k.local, k.local * k.shape.dp() * k.micro_batches, 1, k.keys);
    const std::vector<std::uint64_t> sent = measured(k);
    const int per_stage = k.shape.world() / k.shape.pp;  // world ranks are pp-major
    for (std::size_t r = 0; r < sent.size(); ++r) {
      const int pp_rank = static_cast<int>(r) / per_stage;
      CAPTURE(pp_rank);
      CHECK(sent[r] == plan::expected_step_bytes(plan::step_layout(c, k.shape, pp_rank)));
    }
  }
}

TEST_CASE("traffic: the gathers of default and never differ by the blocks freed after their forward") {
  const train::JobConfig c = debug_job(1, 4, 1);
  const comm::MeshShape shape{1, 1, 4, 1};
  plan::StepLayout l = plan::step_layout(c, shape);
  const auto def = plan::expected_step_bytes(l);
  l.reshard = parallel::Reshard::never;
  const auto never = plan::expected_step_bytes(l);
  const auto units = plan::llama_units(l);
  // The embedding and the first n_layers - 1 blocks are gathered once more under default.
  std::uint64_t regathered = 3 * ((units[0].numel + 3) / 4) * 4;
  for (std::int64_t i = 1; i < c.model.args.n_layers; ++i) regathered += 3 * ((units[1].numel + 3) / 4) * 4;
  CHECK(def - never == regathered);
}

TEST_CASE("memory: under FSDP each rank holds its share of parameters and optimizer state") {
  // Peak memory per rank over a step falls as the shard degree grows (parameters,
  // gradients and AdamW moments are all sharded).
  std::vector<std::size_t> peak;
  for (int s : {1, 2, 4}) {
    std::vector<std::size_t> per_rank(static_cast<std::size_t>(s));
    comm::run_thread_ranks(s, [&](comm::Communicator& world) {
      const train::JobConfig c = debug_job(8 / s, 8, 1);
      per_rank[static_cast<std::size_t>(world.rank())] = train_layout(world, comm::MeshShape{1, 1, s, 1}, c).peak_memory_bytes;
    }, nccl_rules());
    peak.push_back(per_rank[0]);
    MESSAGE("FSDP ", s, ": peak memory per rank ", per_rank[0] / 1024, " KiB");
  }
  CHECK(peak[1] < peak[0]);
  CHECK(peak[2] < peak[1]);
}

}  // namespace test_traffic
