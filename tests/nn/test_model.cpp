// Model construction, parameter naming and counts, initialisation.
#include <doctest/doctest.h>

#include <map>
#include <set>

#include "../../examples/custom_layer.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

namespace test_model {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;

using ReluBlock = examples::ReluSquaredBlock<float, Cpu>;
using examples::ReluSquaredOptions;

/// Settings of some other block: what a ReluBlock must refuse to read as its own.
struct OtherOptions {
  int width = 3;
};

/// The ReLU^2 MLP of custom_layer.hpp alone, with a residual: a block without attention,
/// which says so in the FLOP count (its attention term is 0).
template <class T, Backend B>
class MlpBlock : public LayerTypes<T, B> {
 public:
  using options_type = ReluSquaredOptions;
  static double attention_flops_per_token(const ModelArgs&, const ReluSquaredOptions&, std::int64_t) { return 0; }

  explicit MlpBlock(const BlockArgs<T, B>& b)
      : mlp_(b.name + ".mlp", b.model.dim, b.template options<ReluSquaredOptions>().hidden, 0.02, b.tp) {}
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> y = mlp_.forward(ctx.child("mlp"), x);
    B::for_each(y.numel(), ops::Axpy<T>{accum_t<T>(1), x.data(), y.data()});
    return y;
  }
  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy) {
    Tensor<T> dx = mlp_.backward(ctx.child("mlp"), dy);
    B::for_each(dx.numel(), ops::Axpy<T>{accum_t<T>(1), dy.data(), dx.data()});
    return dx;
  }
  template <class F>
  void for_each_parameter(F&& f) {
    mlp_.for_each_parameter(f);
  }

 private:
  examples::ReluSquaredMlp<T, B> mlp_;
};

TEST_CASE("Parameter names and counts follow torchtitan") {
  ModelArgs a = model_flavor("debugmodel");
  a.n_layers = 2;
  Transformer<float, Cpu> model(a);
  std::map<std::string, Shape> shapes;
  model.for_each_parameter([&](Parameter<float>& p) { shapes[p.name] = p.shape(); });
  CHECK(shapes.at("tok_embeddings.weight") == Shape{260, 256});
  CHECK(shapes.at("layers.1.attention.wq.weight") == Shape{256, 256});
  CHECK(shapes.at("layers.0.attention.wk.weight") == Shape{256, 256});
  CHECK(shapes.at("layers.0.feed_forward.w1.weight") == Shape{768, 256});
  CHECK(shapes.at("layers.0.feed_forward.w2.weight") == Shape{256, 768});
  CHECK(shapes.at("layers.0.attention_norm.weight") == Shape{256});
  CHECK(shapes.at("norm.weight") == Shape{256});
  CHECK(shapes.at("output.weight") == Shape{260, 256});
  CHECK(model.num_params() == a.num_params());
}

TEST_CASE("Flavor sizes match the published parameter counts") {
  CHECK(model_flavor("llama2_7b").num_params() == 6738415616);
  CHECK(model_flavor("llama3_8b").num_params() == 8030261248);
  CHECK(model_flavor("llama3.2_1b").num_params() == 1235814400);
  CHECK(model_flavor("llama3.2_3b").num_params() == 3212749824);
  CHECK(model_flavor("llama3_8b").ffn_hidden_dim() == 14336);
  CHECK(model_flavor("llama2_13b").ffn_hidden_dim() == 13824);
  CHECK(model_flavor("llama3.1_405b").ffn_hidden_dim() == 53248);
  CHECK_THROWS_WITH_AS(model_flavor("llama4"), doctest::Contains("unknown flavor 'llama4'"), Error);
}

TEST_CASE("Bad shapes are rejected with the fields named") {
  ModelArgs a;
  a.dim = 250;
  a.n_heads = 16;
  CHECK_THROWS_WITH_AS(a.validate("cfg.toml: [model]"), doctest::Contains("n_heads (16) does not divide dim (250)"),
                       Error);
  a.dim = 256;
  a.n_kv_heads = 5;
  CHECK_THROWS_WITH_AS(a.validate(), doctest::Contains("n_kv_heads (5) does not divide n_heads (16)"), Error);
}

TEST_CASE("Sizes past 2^48 parameters are refused before anything counts them in integers") {
  for (const ModelArgs& a : model_flavors()) CHECK_NOTHROW(a.validate());  // 405B is 1/700 of the bound
  ModelArgs a = model_flavor("llama3.1_405b");
  a.dim = std::int64_t{1} << 40;  // dim^2 overflows an int64 (a config.json's hidden_size, fuzz_model_config)
  CHECK_THROWS_WITH_AS(a.validate("config.json"),
                       doctest::Contains("config.json: the parameter count is 1.78601e+27, past the 2.81475e+14 "
                                         "(2^48) parameters tessera takes for a whole model"),
                       Error);
  a = model_flavor("debugmodel");
  a.vocab_size = std::int64_t{1} << 50;
  CHECK_THROWS_WITH_AS(a.validate(), doctest::Contains("model: vocab_size is 1.1259e+15, past the"), Error);
  a = model_flavor("debugmodel");
  a.ffn_dim_multiplier = 1e300;  // the hidden size, a double, would not fit an int64
  CHECK_THROWS_WITH_AS(a.validate(), doctest::Contains("model: the feed-forward hidden size is"), Error);
  a = model_flavor("debugmodel");
  a.n_layers = std::int64_t{1} << 30;  // 2^30 blocks of 0.8M parameters: 2^49.7
  CHECK_THROWS_WITH_AS(a.validate(), doctest::Contains("model: the parameter count is"), Error);
  a.n_layers = std::int64_t{1} << 20;  // 2^39.7: counted exactly
  a.validate();
  CHECK(a.num_params() > (std::int64_t{1} << 39));
}

TEST_CASE("Tied embeddings share one parameter") {
  ModelArgs a = model_flavor("debugmodel");
  a.n_layers = 1;
  a.tie_embeddings = true;
  Transformer<float, Cpu> model(a);
  std::set<std::string> names;
  model.for_each_parameter([&](Parameter<float>& p) { names.insert(p.name); });
  CHECK(names.count("output.weight") == 0);
  CHECK(model.num_params() == a.num_params());
}

TEST_CASE("The Llama model counts its parameters and FLOPs exactly as ModelArgs does, for every flavor") {
  for (const ModelArgs& a : model_flavors()) {
    CAPTURE(a.flavor);
    const DeferParameterStorage shapes_only;  // the 405B model too, with no storage
    const Transformer<float, Cpu> model(a);
    CHECK(model.num_params() == a.num_params());
    for (std::int64_t seq : {32, 2048, 8192}) {
      // torchtitan's formula as ModelArgs wrote it before the model asked its blocks.
      const double n = static_cast<double>(a.num_params() - a.vocab_size * a.dim);
      const double attention = 12.0 * static_cast<double>(a.n_layers * a.n_heads * a.head_dim() * seq);
      CHECK(a.flops_per_token(seq) == 6.0 * n + attention);
      CHECK(a.flops_per_token(seq, true) == 6.0 * n + attention / 2);
      CHECK(model.flops_per_token(seq) == a.flops_per_token(seq));
      CHECK(model.flops_per_token(seq, true) == a.flops_per_token(seq, true));
    }
  }
}

TEST_CASE("A block's own options reach every block, and the model counts the block as it is made") {
  ModelArgs a = model_flavor("debugmodel");
  a.dim = 64;
  a.n_layers = 3;
  const ReluSquaredOptions options{96, 0.5};
  Transformer<float, Cpu, ReluBlock> model(a, {}, options);
  CHECK(model.block_options().hidden == 96);
  std::map<std::string, Shape> shapes;
  std::int64_t held = 0;  // every parameter, on one rank whole
  model.for_each_parameter([&](Parameter<float>& p) {
    shapes[p.name] = p.shape();
    held += p.numel();
  });
  CHECK(shapes.at("layers.0.mlp.w1.weight") == Shape{96, 64});
  CHECK(shapes.at("layers.2.mlp.w2.weight") == Shape{64, 96});
  CHECK(model.num_params() == held);
  // Norms, wq wk wv wo (16 heads of 4), w1 w2: not the Llama block's count.
  const std::int64_t d = a.dim, block = 2 * d + 4 * d * d + 2 * 96 * d;
  CHECK(held == 2 * a.vocab_size * d + d + a.n_layers * block);
  CHECK(model.num_params() != a.num_params());
  // Its attention is the model's: torchtitan's term, 12 H hd T a layer.
  const double six_n = 6.0 * static_cast<double>(held - a.vocab_size * d);
  CHECK(model.flops_per_token(64) == six_n + 3 * 12.0 * 16 * 4 * 64);
  CHECK(model.flops_per_token(64, true) == six_n + 3 * 12.0 * 16 * 4 * 64 / 2);
  // Through the policy wrapper the same options reach the same blocks.
  Transformer<float, Cpu, Parallel<ReluBlock, Checkpoint<Full>>> wrapped(a, {}, options);
  std::int64_t wrapped_held = 0;
  wrapped.for_each_parameter([&](Parameter<float>& p) { wrapped_held += p.numel(); });
  CHECK(wrapped_held == held);
  CHECK(wrapped.num_params() == held);
  CHECK(wrapped.parameter_names() == model.parameter_names());
}

TEST_CASE("A block without attention states its attention term: its FLOPs are 6 x its parameters") {
  ModelArgs a = model_flavor("debugmodel");
  a.dim = 64;
  Transformer<float, Cpu, MlpBlock<float, Cpu>> model(a, {}, ReluSquaredOptions{80, 1.0});
  std::int64_t held = 0;
  model.for_each_parameter([&](Parameter<float>& p) { held += p.numel(); });
  CHECK(model.num_params() == held);
  CHECK(held == 2 * a.vocab_size * 64 + 64 + a.n_layers * 2 * 80 * 64);
  CHECK(model.flops_per_token(2048) == 6.0 * static_cast<double>(held - a.vocab_size * 64));
}

TEST_CASE("A block reading options it was not given is refused, naming both types") {
  ModelArgs a = model_flavor("debugmodel");
  a.dim = 64;
  auto rope = std::make_shared<RopeTable<float, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  const OtherOptions other;
  CHECK_THROWS_WITH_AS(ReluBlock(BlockArgs<float, Cpu>{a, 2, "layers.2", rope, nullptr, nullptr, BlockOptionsRef(other)}),
                       doctest::Contains("layers.2: the block reads its options as examples::ReluSquaredOptions, but "
                                         "the model was given test_model::OtherOptions"),
                       Error);
  CHECK_THROWS_WITH_AS(ReluBlock(BlockArgs<float, Cpu>{a, 0, "layers.0", rope}),
                       doctest::Contains("layers.0: the block reads its options as examples::ReluSquaredOptions, but "
                                         "the model was given none"),
                       Error);
  // A model of it left without options gets the options' default, which the block refuses.
  CHECK_THROWS_WITH_AS((Transformer<float, Cpu, ReluBlock>(a)), doctest::Contains("ReluSquaredOptions::hidden must be "
                                                                                "positive, got 0"),
                       Error);
}

TEST_CASE("Initialisation depends only on seed, name and index") {
  ModelArgs a = model_flavor("debugmodel");
  a.n_layers = 2;
  Transformer<float, Cpu> m1(a), m2(a);
  m1.init_weights(7);
  m2.init_weights(7);
  std::vector<float> v1, v2;
  m1.for_each_parameter([&](Parameter<float>& p) { v1.insert(v1.end(), p.value.data(), p.value.data() + p.numel()); });
  m2.for_each_parameter([&](Parameter<float>& p) { v2.insert(v2.end(), p.value.data(), p.value.data() + p.numel()); });
  CHECK(v1 == v2);
  // The statistics torchtitan's init gives: wq ~ N(0, 0.02), layer-1 wo ~ N(0, 0.02 / 2), norms 1.
  auto stats = [&](const std::string& name) {
    double s = 0, s2 = 0;
    std::int64_t n = 0;
    m1.for_each_parameter([&](Parameter<float>& p) {
      if (p.name != name) return;
      for (std::int64_t i = 0; i < p.numel(); ++i) s += p.value[i], s2 += double(p.value[i]) * p.value[i];
      n = p.numel();
    });
    return std::pair{s / n, std::sqrt(s2 / n - (s / n) * (s / n))};
  };
  CHECK(stats("layers.0.attention.wq.weight").second == doctest::Approx(0.02).epsilon(0.02));
  CHECK(stats("layers.1.attention.wo.weight").second == doctest::Approx(0.01).epsilon(0.02));
  CHECK(stats("tok_embeddings.weight").second == doctest::Approx(1.0).epsilon(0.02));
  CHECK(stats("layers.0.ffn_norm.weight").first == 1.0);
  // A different seed gives different weights.
  m2.init_weights(8);
  v2.clear();
  m2.for_each_parameter([&](Parameter<float>& p) { v2.insert(v2.end(), p.value.data(), p.value.data() + p.numel()); });
  CHECK(v1 != v2);
}

}  // namespace test_model
