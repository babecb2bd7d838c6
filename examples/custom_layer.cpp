// A user-defined block trained by tessera's model, trainer and optimizer.
//
// ParallelBlock (custom_layer.hpp) computes attention and feed-forward side by side from
// one norm. Before training, its hand-written backward is checked against finite
// differences in double (tessera/testing/gradcheck.hpp); then a model of it trains on
// one rank (tests/parallel/test_user_layer.cpp trains it under FSDP, DDP and TP 2).
//
//   custom-layer [steps]     (default 60)
#include <cstdio>
#include <memory>
#include <string>

#include "custom_layer.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/testing/gradcheck.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;
using tessera::examples::ParallelBlock;

static_assert(nn::Layer<ParallelBlock<float, Cpu>>, "ParallelBlock must satisfy tessera::nn::Layer");

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

int main(int argc, char** argv) {
  try {
    train::JobConfig c = train::parse_config(R"(
      [model]
      flavor = "debugmodel"
      n_layers = 2
      dim = 128
      n_heads = 8
      [training]
      local_batch_size = 8
      seq_len = 128
      steps = 60
      mixed_precision_param = "float32"
      synthetic_documents = 2000
      [optimizer]
      lr = 3e-3
      [lr_scheduler]
      warmup_steps = 10
      [activation_checkpoint]
      mode = "none"
    )",
                                             "custom_layer.cpp", {});
    if (argc > 1) c.training.steps = std::stoll(argv[1]);
    if (!backward_is_right(c.model.args)) {
      std::fprintf(stderr, "custom-layer: ParallelBlock's backward disagrees with finite differences (above)\n");
      return 1;
    }
    using Model = nn::Transformer<float, Cpu, ParallelBlock<float, Cpu>>;
    Model model(c.model.args);
    model.init_weights(0);
    data::DataLoader loader(train::load_training_tokens(c, tessera::io::ByteTokenizer{}), c.training.seq_len, c.training.local_batch_size);
    train::Trainer<Model> trainer(model, c, std::move(loader), 0.0);
    for (std::int64_t s = 1; s <= c.training.steps; ++s) {
      auto m = trainer.step();
      if (s == 1 || s % 10 == 0) std::printf("step %3lld  loss %.4f\n", static_cast<long long>(m.step), m.loss);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom-layer: error: %s\n", e.what());
    return 1;
  }
}
