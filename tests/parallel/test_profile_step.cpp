// A training step recorded on every rank (core/profile.hpp, profiling.enable_profiling):
// under FSDP 2 x PP 2 on thread ranks each rank's timeline holds its own layers' forward
// and backward for every microbatch, its pipeline actions in its schedule's order, the
// collectives with their payloads and group sizes and their waits, the optimizer, and the
// loss head on the last stage only; every span lies within the one it is nested in; and
// recording leaves the losses bit for bit as they were.
#include <doctest/doctest.h>

#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include "harness.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/parallel/schedule.hpp"

namespace test_profile_step {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

struct RankProfile {
  std::vector<profile::Event> events;
  std::vector<profile::MemorySample> memory;
  std::vector<double> losses;
};

/// Every span lies within its parent: the last span opened before it one level up.
bool nested(const std::vector<profile::Event>& events) {
  for (std::size_t i = 0; i < events.size(); ++i) {
    const profile::Event& e = events[i];
    if (e.end_ns < e.begin_ns) return false;
    if (e.depth == 0) continue;
    std::size_t p = i;
    while (p-- > 0 && events[p].depth != e.depth - 1) {
    }
    if (p >= i || events[p].begin_ns > e.begin_ns || events[p].end_ns < e.end_ns) return false;
  }
  return true;
}

std::size_t count(const std::vector<profile::Event>& events, const std::string& pattern) {
  const std::regex re(pattern);
  std::size_t n = 0;
  for (const auto& e : events) n += std::regex_match(e.name, re) ? 1 : 0;
  return n;
}

/// Two steps of FSDP 2 x PP 2 (1F1B, microbatches of one sequence) on 4 thread ranks, the
/// second recorded on every rank where `record`.
std::vector<RankProfile> two_steps(const train::JobConfig& c, bool record) {
  std::vector<RankProfile> ranks(4);
  comm::run_thread_ranks(4, [&](comm::Communicator& world) {
    omp_set_num_threads(1);
    comm::DeviceMesh mesh(world, {2, 1, 2, 1});  // pp 2 x dp_shard 2: rank r on pipeline rank r / 2
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    model.init_weights(static_cast<std::uint64_t>(c.training.seed));
    data::DataLoader loader(debug_tokens(), c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                            mesh.dp_degree());
    train::Trainer<CpuDynamicModel> trainer(model, train::trainer_options(c), std::move(loader));
    RankProfile& mine = ranks[static_cast<std::size_t>(world.rank())];
    mine.losses.push_back(trainer.step().loss);  // the first step, never recorded
    profile::Recorder recorder([] { return memory_stats(Cpu::device).now(); });
    {
      const profile::Recording on(record ? &recorder : nullptr);
      mine.losses.push_back(trainer.step().loss);
    }
    mine.events = recorder.events();
    mine.memory = recorder.memory();
  }, nccl_rules());
  return ranks;
}

}  // namespace

TEST_CASE("profile: a step of FSDP 2 x PP 2 recorded on every rank, and the losses unchanged") {
  const train::JobConfig c = debug_job(kParityBatch / 2, kParityBatch, 2,
                                       {"--parallelism.pipeline_parallel_schedule", "1F1B",
                                        "--parallelism.pipeline_parallel_microbatch_size", "1"});
  const std::vector<RankProfile> ranks = two_steps(c, true), plain = two_steps(c, false);
  CHECK(plain[0].events.empty());
  const int M = static_cast<int>(kParityBatch / 2);  // microbatches of one sequence a pass
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const RankProfile& p = ranks[static_cast<std::size_t>(r)];
    const int pp_rank = r / 2;
    CHECK(p.losses == plain[static_cast<std::size_t>(r)].losses);  // bit for bit
    CHECK(nested(p.events));
    // The memory track: the rank's parameter shards, gradients and optimizer state held
    // throughout, saved activations coming and going.
    REQUIRE_FALSE(p.memory.empty());
    std::size_t most_saved = 0;
    for (const auto& m : p.memory) {
      CHECK(m.held[MemoryUse::parameters] > 0);
      CHECK(m.held[MemoryUse::optimizer] > 0);
      most_saved = std::max(most_saved, m.held.saved_activations);
    }
    CHECK(most_saved > 0);
    CHECK(p.memory.back().held.saved_activations == 0);
    // The pipeline actions, in 1F1B's order for this pipeline rank.
    std::vector<std::string> actions;
    for (const auto& e : p.events)
      if (std::string(e.category) == "pipeline" && e.name != "pipeline wait") actions.push_back(e.name);
    const parallel::Schedule s = parallel::make_schedule(parallel::ScheduleKind::one_f_one_b, 2, 1, M);
    std::vector<std::string> expected;
    for (const auto& a : s.per_rank[static_cast<std::size_t>(pp_rank)])
      expected.push_back(std::to_string(a.stage) + "FBIW"[static_cast<int>(a.op)] + std::to_string(a.microbatch));
    CHECK(actions == expected);
    // Each of the rank's three blocks forward and backward once a microbatch; no other block.
    const std::string mine = pp_rank == 0 ? "[0-2]" : "[3-5]", other = pp_rank == 0 ? "[3-5]" : "[0-2]";
    CHECK(count(p.events, "layers\\." + mine + " forward") == static_cast<std::size_t>(3 * M));
    CHECK(count(p.events, "layers\\." + mine + " backward") == static_cast<std::size_t>(3 * M));
    CHECK(count(p.events, "layers\\." + other + " .*") == 0);
    CHECK(count(p.events, "tok_embeddings forward") == static_cast<std::size_t>(pp_rank == 0 ? M : 0));
    // FSDP's gathers over the two shard ranks, with their payloads, and their waits; the
    // pipeline's transfers; the optimizer; the loss head on the last stage only.
    bool gather_seen = false;
    for (const auto& e : p.events)
      if (e.name == "all_gather" && e.ranks == 2 && e.bytes > 0) gather_seen = true;
    CHECK(gather_seen);
    CHECK(count(p.events, "wait all_gather") > 0);
    CHECK(count(p.events, "reduce_scatter") > 0);
    CHECK(count(p.events, "send_recv") > 0);
    CHECK(count(p.events, "optimizer") == 1);
    CHECK((count(p.events, "loss head") > 0) == (pp_rank == 1));
    CHECK(count(p.events, "micro-batch 0") == 1);
  }
}

}  // namespace test_profile_step
