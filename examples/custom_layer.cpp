// A trainer of one's own, in C++ without a config file, around a block of one's own.
//
// ParallelBlock (custom_layer.hpp) computes attention and feed-forward side by side from
// one norm. The program
//   1. checks its hand-written backward against finite differences in double
//      (tessera/testing/gradcheck.hpp);
//   2. trains a model of it on one rank, with the Trainer's options in code and the
//      token stream in memory;
//   3. trains the same model, from the same weights and batches, on thread ranks under
//      the policies: a composition fixed at compile time (FSDP 2 x TP 2 with selective
//      checkpointing) and, with one model type whose policies read the mesh at run
//      time, FSDP 2, TP 2, a 1F1B pipeline of 2 stages and PP 2 x TP 2;
//   4. prints each layout's losses against one rank's and fails if any differs by more
//      than 1e-5 (relative).
// tests/consumer builds this file against an installed tessera, as a user would.
//
//   custom-layer [steps]     (default 30)
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "custom_layer.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/data/batch_source.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/testing/gradcheck.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;
using tessera::examples::ParallelBlock;

static_assert(nn::Layer<ParallelBlock<float, Cpu>>, "ParallelBlock must satisfy tessera::nn::Layer");

namespace {

using Block = ParallelBlock<float, Cpu>;
using OneRank = nn::Transformer<float, Cpu, Block>;
// The layout in the type: every rank of it runs FSDP over 2 and TP over 2.
using Composed = nn::Transformer<float, Cpu, Parallel<Block, Sharding<FSDP>, TensorParallel<2>, Checkpoint<Selective<Op>>>>;
// The layout from the mesh and the plan: one type for every layout.
using AnyLayout = nn::Transformer<float, Cpu, Parallel<Block, Sharding<Dynamic>, TensorParallel<dynamic>,
                                                       Pipeline<dynamic>, Checkpoint<Dynamic>>>;

constexpr std::int64_t kSeqLen = 128, kGlobalBatch = 8;

/// ParallelBlock<double, Cpu>'s backward against finite differences, on a small shape;
/// prints one line per gradient and returns whether every one agrees.
bool backward_is_right(nn::ModelArgs a) {
  a.dim = 16;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  auto rope = std::make_shared<nn::RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  ParallelBlock<double, Cpu> block(nn::BlockArgs<double, Cpu>{a, 0, "layers.0", rope});
  // Made alone, it holds zeros: values at a larger scale than the init.
  block.for_each_parameter([](nn::Parameter<double>& p) { testing::fill_normal(p.value, 1, p.name, 0.5); });
  const testing::GradientReport report = testing::check_gradients(block, nn::Geometry{2, 4}, a.dim);
  std::fputs(report.str().c_str(), stdout);
  return report.passed();
}

struct Layout {
  const char* name;
  comm::MeshShape shape;  // {pp, dp_replicate, dp_shard, tp}
  parallel::CheckpointMode checkpoint{};
};

/// `steps` steps of Model on `world` laid out as `layout`: the losses (the same on every rank).
template <class Model>
std::vector<double> losses_of(comm::Communicator world, const Layout& layout, const nn::ModelArgs& args,
                          const std::vector<std::uint32_t>& tokens, std::int64_t steps) {
  if (world.size() > 1) omp_set_num_threads(1);  // the ranks share the cores
  comm::DeviceMesh mesh(std::move(world), layout.shape);
  parallel::Plan plan;
  plan.mesh = &mesh;
  plan.checkpoint = layout.checkpoint;
  Model model(args, plan);
  model.init_weights(0);  // the same weights on every layout
  train::TrainerOptions options;
  options.optimizer.lr = 3e-3;
  options.schedule.steps = steps;
  options.schedule.warmup_steps = std::min<std::int64_t>(10, steps / 3);
  options.global_batch_size = kGlobalBatch;  // the same batches on every layout
  // Each data-parallel rank reads its share of each global batch of the stream.
  train::Trainer<Model> trainer(model, options,
                                data::BatchSource::tokens(tokens, kSeqLen, kGlobalBatch / layout.shape.dp()));
  std::vector<double> losses;
  for (std::int64_t s = 0; s < steps; ++s) losses.push_back(trainer.step().loss);
  return losses;
}

/// The same on `layout.shape.world()` thread ranks of this process: rank 0's losses.
template <class Model>
std::vector<double> losses_on_threads(const Layout& layout, const nn::ModelArgs& args,
                                     const std::vector<std::uint32_t>& tokens, std::int64_t steps) {
  std::vector<double> losses;
  comm::run_thread_ranks(layout.shape.world(), [&](comm::Communicator& world) {
    const bool lead = world.rank() == 0;
    std::vector<double> mine = losses_of<Model>(world, layout, args, tokens, steps);
    if (lead) losses = std::move(mine);
  });
  return losses;
}

double largest_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = a.size() == b.size() ? 0 : INFINITY;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = std::fabs(a[i] - b[i]) / std::fabs(b[i]);
    worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // No config file: the model's arguments, the data and the trainer's options in code.
    nn::ModelArgs args = nn::model_flavor("debugmodel");  // the byte tokenizer's vocabulary
    args.n_layers = 2;
    args.dim = 128;
    args.n_heads = 8;
    const std::int64_t steps = argc > 1 ? std::stoll(argv[1]) : 30;
    if (steps < 1) {
      std::fprintf(stderr, "custom-layer: steps must be positive, got %lld\n", static_cast<long long>(steps));
      return 1;
    }
    if (!backward_is_right(args)) {
      std::fprintf(stderr, "custom-layer: ParallelBlock's backward disagrees with finite differences (above)\n");
      return 1;
    }
    const std::vector<std::uint32_t> tokens =
        data::pack_documents(data::synthetic_corpus(0, 2000), tessera::io::ByteTokenizer{});

    const std::vector<double> alone = losses_of<OneRank>(comm::Communicator(), Layout{"one rank", {}}, args, tokens, steps);
    std::printf("one rank: loss %.4f -> %.4f in %lld steps\n", alone.front(), alone.back(), static_cast<long long>(steps));

    using K = parallel::CheckpointMode::Kind;
    bool all_agree = true;
    auto report = [&](const Layout& layout, const std::vector<double>& losses) {
      const double d = largest_relative_difference(losses, alone);
      const bool agrees = d <= 1e-5;
      all_agree = all_agree && agrees;
      std::printf("%-36s loss %.4f -> %.4f, largest relative difference from one rank %.1e%s\n", layout.name,
                  losses.front(), losses.back(), d, agrees ? "" : "  (over 1e-5)");
    };
    const Layout composed{"FSDP 2 x TP 2, selective (op), static", {1, 1, 2, 2}};
    report(composed, losses_on_threads<Composed>(composed, args, tokens, steps));
    for (const Layout& layout : {Layout{"FSDP 2", {1, 1, 2, 1}}, Layout{"TP 2", {1, 1, 1, 2}},
                                 Layout{"PP 2 (1F1B), full checkpointing", {2, 1, 1, 1}, {K::full, 0}},
                                 Layout{"PP 2 x TP 2", {2, 1, 1, 2}}})
      report(layout, losses_on_threads<AnyLayout>(layout, args, tokens, steps));
    if (!all_agree) {
      std::fprintf(stderr, "custom-layer: a layout's losses differ from one rank's by more than 1e-5 (above)\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom-layer: error: %s\n", e.what());
    return 1;
  }
}
