// Model construction, parameter naming and counts, initialisation.
#include <doctest/doctest.h>

#include <map>
#include <set>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"

namespace test_model {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;

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
