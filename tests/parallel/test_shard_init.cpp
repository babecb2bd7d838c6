// Shard-only initialisation: on a parallel plan the model allocates and initialises
// this rank's share of every parameter only (its stages, its tensor-parallel pieces,
// its data-parallel shards), with bitwise the values a one-rank model gets, and no
// rank ever holds the whole model, not even for a moment.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "harness.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/train/job_config.hpp"

namespace test_shard_init {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

using Values = std::vector<float>;

bool same_bits(const Values& a, const Values& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

constexpr std::uint64_t kSeed = 11;

/// Every parameter of the one-rank model, initialised whole, by name.
const std::map<std::string, Values>& one_rank_values(const train::JobConfig& c) {
  static std::map<std::string, std::map<std::string, Values>> cache;
  const std::string key = std::to_string(c.model.args.n_kv_heads);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  std::map<std::string, Values> values;
  CpuDynamicModel model(c.model.args);
  model.init_weights(kSeed);
  model.for_each_parameter(
      [&](nn::Parameter<float>& p) { values[p.name] = Values(p.value.data(), p.value.data() + p.numel()); });
  return cache.emplace(key, std::move(values)).first->second;
}

struct Layout {
  const char* name;
  comm::MeshShape shape;
  std::vector<std::string> keys;
  double share;  // the most of the model one rank may hold, as a fraction of it
};

void check_layout(const Layout& l) {
  const std::string layout = l.name;  // doctest prints a const char* as an address
  CAPTURE(layout);
  const train::JobConfig c = debug_job(1, l.shape.dp(), 1, l.keys);
  const std::map<std::string, Values>& reference = one_rank_values(c);
  std::size_t whole_bytes = 0;  // value and gradient of every parameter, float32
  for (const auto& [name, v] : reference) whole_bytes += 2 * v.size() * sizeof(float);

  comm::run_thread_ranks(l.shape.world(), [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, l.shape);
    const parallel::Plan plan = train::make_plan(c, &mesh);
    MemoryStats& memory = memory_stats(Device::cpu);  // this rank's own (thread ranks count apart)

    // Shard-only: made without storage, then this rank's share allocated and filled.
    memory.reset_peak();
    const std::size_t before = memory.current();
    CpuDynamicModel shard_only(c.model.args, plan);
    shard_only.init_weights(kSeed);
    CHECK(shard_only.sharded());
    const std::size_t held = memory.current() - before, peak = memory.peak() - before;
    CHECK_MESSAGE(peak == held, "rank ", world.rank(), ": a transient of ", peak - held, " bytes during initialisation");
    CHECK_MESSAGE(static_cast<double>(held) <= l.share * static_cast<double>(whole_bytes), "rank ", world.rank(),
                  " holds ", held, " bytes of a model of ", whole_bytes);

    // The same values as the model made whole, initialised whole and sharded after, bitwise.
    {
      memory.reset_peak();
      const std::size_t start = memory.current();
      CpuDynamicModel made_whole(c.model.args, plan);
      made_whole.for_each_parameter([](nn::Parameter<float>&) {});  // whole, zeroed: the path of a load
      // The measure above would have seen this: the whole of this rank's stages, at once.
      if (l.shape.world() == l.shape.dp() * l.shape.tp)
        CHECK(memory.peak() - start >= whole_bytes);
      made_whole.init_weights(kSeed);
      made_whole.shard();
      std::vector<Values> a, b;
      shard_only.for_each_local_parameter(
          [&](nn::Parameter<float>& p) { a.emplace_back(p.value.data(), p.value.data() + p.numel()); });
      made_whole.for_each_local_parameter(
          [&](nn::Parameter<float>& p) { b.emplace_back(p.value.data(), p.value.data() + p.numel()); });
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) CHECK(same_bits(a[i], b[i]));
    }

    // Gathered whole, every parameter is the one-rank model's, bitwise.
    std::size_t seen = 0;
    shard_only.with_whole_parameters([&] {
      shard_only.for_each_parameter([&](nn::Parameter<float>& p) {
        CAPTURE(p.name);
        ++seen;
        const auto it = reference.find(p.name);
        REQUIRE(it != reference.end());
        CHECK(same_bits(Values(p.value.data(), p.value.data() + p.numel()), it->second));
      });
    });
    CHECK(seen == reference.size());
  }, nccl_rules());
}

TEST_CASE("shard-only initialisation: every layout holds bitwise the one-rank values, and no rank the whole") {
  const std::vector<std::string> two_kv_heads = {"--model.n_kv_heads", "2"};
  const std::vector<std::string> no_loss_parallel = {"--parallelism.disable_loss_parallel", "true"};
  // The fractions: the share each rank holds, with room for the padding of flat shards,
  // parameters every tensor-parallel rank holds whole (norms; kv heads held by several)
  // and the RoPE table.
  const Layout layouts[] = {
      {"FSDP 4", {1, 1, 4, 1}, {}, 0.30},
      {"HSDP 2x2", {1, 2, 2, 1}, {}, 0.55},
      {"DDP 2", {1, 2, 1, 1}, {}, 1.05},
      {"TP 2", {1, 1, 1, 2}, {}, 0.55},
      {"TP 4, kv heads held by 2 ranks each", {1, 1, 1, 4}, two_kv_heads, 0.40},
      {"TP 2 without loss parallelism", {1, 1, 1, 2}, no_loss_parallel, 0.80},
      {"FSDP 2 x TP 2", {1, 1, 2, 2}, {}, 0.30},
      {"PP 2 x FSDP 2", {2, 1, 2, 1}, {}, 0.30},
      {"PP 2 x TP 2", {2, 1, 1, 2}, {}, 0.30},
  };
  for (const Layout& l : layouts) check_layout(l);
}

}  // namespace test_shard_init
