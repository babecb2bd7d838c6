// A user-defined block trained by tessera's model, trainer and optimizer.
//
// ParallelBlock computes attention and feed-forward side by side from one norm
// (the GPT-J / PaLM layout) instead of one after the other:
//   y = x + attention(norm(x)) + feed_forward(norm(x))
// It satisfies tessera::nn::Layer (forward and backward over a Context, named
// parameters), so Transformer<float, Cpu, ParallelBlock> is a whole model, and the
// policies of later releases wrap it without changes to this file. Before training,
// its hand-written backward is checked against finite differences in double
// (tessera/testing/gradcheck.hpp).
//
//   custom-layer [steps]     (default 60)
#include <cstdio>
#include <memory>
#include <string>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/testing/gradcheck.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;

template <class T, Backend B>
class ParallelBlock {
 public:
  using scalar_type = T;
  using backend_type = B;

  explicit ParallelBlock(const nn::BlockArgs<T, B>& b)
      : norm_(b.name + ".norm", b.model.dim, b.model.norm_eps),
        attention_(b.name + ".attention", b.model, nn::output_init_std(b.model, b.layer_id), b.rope),
        feed_forward_(b.name + ".feed_forward", b.model, nn::output_init_std(b.model, b.layer_id)) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> n = norm_.forward(ctx.child("norm"), x);
    Tensor<T> y = attention_.forward(ctx.child("attention"), n);
    Tensor<T> f = feed_forward_.forward(ctx.child("feed_forward"), n);
    B::for_each(y.numel(), ops::Axpy<T>{T(1), f.data(), y.data()});
    B::for_each(y.numel(), ops::Axpy<T>{T(1), x.data(), y.data()});
    return y;
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    // Both branches read norm(x): their input gradients add up before the norm.
    Tensor<T> dn = attention_.backward(ctx.child("attention"), dy);
    Tensor<T> df = feed_forward_.backward(ctx.child("feed_forward"), dy);
    B::for_each(dn.numel(), ops::Axpy<T>{T(1), df.data(), dn.data()});
    Tensor<T> dx = norm_.backward(ctx.child("norm"), dn);
    B::for_each(dx.numel(), ops::Axpy<T>{T(1), dy.data(), dx.data()});  // the residual
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    norm_.for_each_parameter(f);
    attention_.for_each_parameter(f);
    feed_forward_.for_each_parameter(f);
  }

 private:
  nn::RmsNorm<T, B> norm_;
  nn::Attention<T, B> attention_;
  nn::FeedForward<T, B> feed_forward_;
};

static_assert(nn::Layer<ParallelBlock<float, Cpu>>, "ParallelBlock must satisfy tessera::nn::Layer");

/// ParallelBlock<double, Cpu>'s backward against finite differences, on a small shape;
/// prints one line per gradient and returns whether every one agrees.
bool backward_is_right(nn::ModelArgs a) {
  a.dim = 16;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  auto rope = std::make_shared<nn::RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  ParallelBlock<double, Cpu> block(nn::BlockArgs<double, Cpu>{a, 0, "layers.0", rope});
  block.for_each_parameter([](nn::Parameter<double>& p) {  // made alone, it holds zeros
    auto rng = parameter_rng(1, p.name);
    for (std::int64_t i = 0; i < p.numel(); ++i) p.value[i] = normal(rng, static_cast<std::uint64_t>(i), 0.0, 0.5);
  });
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
