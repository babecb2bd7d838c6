// llama-plan --search's library (plan/search.hpp): a layout priced from small traces,
// extrapolated in depth and batch, against the same layout priced from its full traces;
// the enumeration; the ranking and its pruning.
#include <doctest/doctest.h>

#include <set>
#include <string>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/plan/search.hpp"

#ifndef TESSERA_MACHINES
#error "TESSERA_MACHINES: the folder of the machine profiles"
#endif

namespace test_search {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

plan::Machine h100() { return plan::load_machine(std::string(TESSERA_MACHINES) + "/h100-sxm.toml"); }

const plan::TraceRank kTrace = [](const train::JobConfig& c, int world, int rank) {
  return plan::dry_run_step<float>(c, 0, world, rank);
};

/// The debug model with `layers` blocks, global batch `global`, laid out by `keys`.
train::JobConfig job(int layers, std::int64_t local, std::int64_t global, std::vector<std::string> keys) {
  keys.insert(keys.end(), {"--model.n_layers", std::to_string(layers)});
  return test::debug_job(local, global, 2, keys);
}

}  // namespace

TEST_CASE("search: a layout extrapolated from small traces prices as its full traces do") {
  const plan::Machine m = h100();
  const plan::GpuPricer gpu(m);
  struct Case {
    const char* name;
    int world, layers;
    std::int64_t local, global;
    std::vector<std::string> keys;
  };
  const std::vector<Case> cases = {
      {"FSDP 2, 8 accumulation steps", 2, 10, 1, 16,
       {"--parallelism.data_parallel_shard_degree", "2"}},
      {"DDP 2, full checkpointing", 2, 9, 1, 12,
       {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
        "--activation_checkpoint.mode", "full"}},
      {"FSDP 2 x TP 2, selective per op", 4, 8, 1, 10,
       {"--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}},
      {"FSDP 2 x PP 2, 1F1B, 8 microbatches", 4, 10, 8, 16,
       {"--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree", "2"}},
      {"PP 2, Interleaved1F1B, 12 microbatches of 1", 2, 18, 12, 12,
       {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.data_parallel_shard_degree", "1"}},
      {"PP 2, GPipe, reshard never, every 2nd block recomputed", 4, 16, 10, 20,
       {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe",
        "--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_reshard_after_forward", "never",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"}},
  };
  for (const Case& k : cases) {
    CAPTURE(std::string(k.name));
    const train::JobConfig c = job(k.layers, k.local, k.global, k.keys);
    const plan::SearchResult small = plan::price_layout(c, k.world, kTrace, gpu, *m.network);
    const plan::SearchResult full = plan::price_layout(c, k.world, kTrace, gpu, *m.network, true);
    CHECK(small.extrapolated);
    CHECK(!full.extrapolated);
    CHECK(small.dry_runs == 4 * full.dry_runs);  // four small traces per position
    // The step to a part in a thousand, the memory peak to the byte (both are affine in
    // the blocks per stage and in the batch count once the schedule is in its steady state).
    CHECK(small.step_seconds == doctest::Approx(full.step_seconds).epsilon(1e-3));
    CHECK(small.peak_memory_bytes == full.peak_memory_bytes);
    CHECK(small.fits == full.fits);
    CHECK(small.tokens_per_sec == doctest::Approx(full.tokens_per_sec).epsilon(1e-3));
    CHECK(small.mfu_pct == doctest::Approx(full.mfu_pct).epsilon(1e-3));
  }
}

TEST_CASE("search: the layouts of 8 GPUs, each once, every one with the global batch held") {
  const train::JobConfig base = job(6, 2, 16, {});
  plan::SearchSpace space;
  space.gpus = 8;
  space.max_microbatch = 4;
  const std::vector<train::JobConfig> all = plan::enumerate_layouts(base, space, 16);
  std::set<std::string> seen;
  std::set<std::int64_t> tps, pps;
  for (const auto& c : all) {
    const auto& p = c.parallelism;
    CHECK(p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree *
              p.pipeline_parallel_degree == 8);
    CHECK(c.training.global_batch_size == 16);
    const std::int64_t dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree;
    if (p.pipeline_parallel_degree > 1) CHECK(c.training.local_batch_size * dp == 16);
    else CHECK(16 % (c.training.local_batch_size * dp) == 0);
    tps.insert(p.tensor_parallel_degree);
    pps.insert(p.pipeline_parallel_degree);
    seen.insert(train::to_toml(c));
  }
  CHECK(seen.size() == all.size());
  CHECK(tps == std::set<std::int64_t>{1, 2, 4, 8});
  CHECK(pps == std::set<std::int64_t>{1, 2, 4, 8});
  // Two nodes of 4: tensor parallelism stays within one.
  space.gpus_per_node = 4;
  for (const auto& c : plan::enumerate_layouts(base, space, 16)) CHECK(c.parallelism.tensor_parallel_degree <= 4);
}

TEST_CASE("search: fitting layouts first, fastest first; the first predicted in full") {
  const plan::Machine m = h100();
  const plan::GpuPricer gpu(m);
  const train::JobConfig base = job(6, 2, 8, {});
  plan::SearchSpace space;
  space.gpus = 4;
  space.max_microbatch = 2;
  space.threads = 2;
  const plan::SearchReport r = plan::search_layouts(base, space, 8, kTrace, gpu, *m.network);
  REQUIRE(!r.layouts.empty());
  CHECK(r.enumerated == plan::enumerate_layouts(base, space, 8).size());
  CHECK(r.priced + r.refused <= r.enumerated);
  CHECK(r.priced == r.layouts.size());
  CHECK(r.layouts.front().fits);
  CHECK(!r.layouts.front().extrapolated);
  for (std::size_t i = 1; i < r.layouts.size(); ++i) {
    const auto &a = r.layouts[i - 1], &b = r.layouts[i];
    CHECK((a.fits || !b.fits));
    if (a.fits && b.fits) CHECK(a.tokens_per_sec >= b.tokens_per_sec);
  }
  // Side by side or one at a time, the same ranking to the last figure: each dry run sees
  // its own device (meta::DeviceMemory is per thread; the loss head sizes its chunk from it).
  const std::size_t device = static_cast<std::size_t>(m.capacity_bytes.value);
  const plan::TraceRank sized = [device](const train::JobConfig& c, int world, int rank) {
    return plan::dry_run_step<float>(c, device, world, rank);
  };
  plan::SearchSpace alone = space;
  alone.threads = 1;
  const plan::SearchReport a = plan::search_layouts(base, alone, 8, sized, gpu, *m.network);
  const plan::SearchReport b = plan::search_layouts(base, space, 8, sized, gpu, *m.network);
  REQUIRE(a.layouts.size() == b.layouts.size());
  for (std::size_t i = 0; i < a.layouts.size(); ++i) {
    CHECK(train::to_toml(a.layouts[i].config) == train::to_toml(b.layouts[i].config));
    CHECK(a.layouts[i].step_seconds == b.layouts[i].step_seconds);
    CHECK(a.layouts[i].peak_memory_bytes == b.layouts[i].peak_memory_bytes);
  }
  // The debug model fits everywhere, so no layout is priced with more recomputation than
  // none, or with its parameters freed after forward: a variant doing less work fits.
  for (const auto& l : r.layouts) {
    CHECK(l.config.activation_checkpoint.mode == "none");
    CHECK(l.config.parallelism.fsdp_reshard_after_forward != "always");
  }
  // A device too small for any layout: nothing fits.
  struct Tiny final : plan::Pricer {
    const plan::Pricer& inner;
    explicit Tiny(const plan::Pricer& p) : inner(p) {}
    double seconds(const trace::Op& op) const override { return inner.seconds(op); }
    double peak_flops(DType d) const override { return inner.peak_flops(d); }
    double usable_bytes() const override { return 1e5; }
    std::string name() const override { return "tiny"; }
  } tiny(gpu);
  const plan::SearchReport none = plan::search_layouts(base, space, 8, kTrace, tiny, *m.network);
  for (const auto& l : none.layouts) CHECK(!l.fits);
  CHECK(!none.checked);
}

}  // namespace test_search
