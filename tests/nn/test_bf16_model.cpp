// The Llama model in bf16 storage (Transformer<bf16, Cpu>): activations and parameters
// in bf16, arithmetic, statistics, logits and gradients in fp32. It is held against
// the fp32 model run on the same bf16-rounded parameters: the losses and gradients
// agree to bf16 accuracy, gradients are fp32 tensors, and every activation-checkpoint
// mode gives bitwise the gradients of none.
#include <doctest/doctest.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/temp_dir.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

namespace test_bf16_model {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;

namespace {

static_assert(std::is_same_v<Parameter<bf16>::grad_type, float>, "a bf16 parameter's gradient is fp32");
static_assert(std::is_same_v<Parameter<float>::grad_type, float>);

ModelArgs small_args() {
  ModelArgs a = model_flavor("debugmodel");
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 96;
  return a;
}

struct Batch {
  Geometry g{2, 24};
  std::vector<std::int32_t> inputs, targets;
  Batch() {
    for (std::int64_t i = 0; i < g.rows(); ++i) {
      inputs.push_back(static_cast<std::int32_t>((i * 37 + 11) % 96));
      targets.push_back(static_cast<std::int32_t>((i * 53 + 5) % 96));
    }
    targets[7] = ops::kIgnoreIndex;
  }
};

/// The float model's initial values, each rounded to bf16, written to both models.
template <class ModelF, class ModelH>
void same_bf16_values(ModelF& f, ModelH& h) {
  std::vector<std::vector<float>> values;
  f.for_each_parameter([&](Parameter<float>& p) {
    for (std::int64_t i = 0; i < p.numel(); ++i) p.value[i] = round_to_bf16(p.value[i]);
    values.emplace_back(p.value.data(), p.value.data() + p.numel());
  });
  std::size_t k = 0;
  h.for_each_parameter([&](Parameter<bf16>& p) {
    REQUIRE(static_cast<std::int64_t>(values[k].size()) == p.numel());
    for (std::int64_t i = 0; i < p.numel(); ++i) p.value[i] = bf16(values[k][static_cast<std::size_t>(i)]);
    ++k;
  });
}

/// ||a - b|| / ||b||.
double relative_error(const float* a, const float* b, std::int64_t n) {
  double d = 0, r = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return std::sqrt(d / std::max(r, 1e-300));
}

template <class Model>
std::vector<std::vector<float>> gradients(Model& m) {
  std::vector<std::vector<float>> g;
  m.for_each_parameter([&](auto& p) { g.emplace_back(p.grad.data(), p.grad.data() + p.numel()); });
  return g;
}

}  // namespace

TEST_CASE("bf16 model: loss and gradients agree with the fp32 model on the same bf16 values") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    ModelArgs a = small_args();
    a.tie_embeddings = tied;
    Transformer<float, Cpu> f(a);
    Transformer<bf16, Cpu> h(a);
    f.init_weights(5);
    same_bf16_values(f, h);
    const Batch b;
    f.zero_grad();
    h.zero_grad();
    const double scale = 1.0 / (b.g.rows() - 1);
    const double lf = f.forward_backward(b.inputs, b.targets, b.g, scale);
    const double lh = h.forward_backward(b.inputs, b.targets, b.g, scale);
    MESSAGE("loss fp32 ", lf, ", bf16 ", lh);
    // Activations rounded to bf16 (8 bits of mantissa) at every layer boundary: the
    // loss moves by well under a part in a thousand (7e-5 seen), each gradient by
    // about 1% (relative L2 error; 0.9% seen at worst).
    CHECK(std::fabs(lh - lf) <= 1e-3 * std::fabs(lf));
    const auto gf = gradients(f), gh = gradients(h);
    REQUIRE(gf.size() == gh.size());
    std::vector<std::string> names;
    f.for_each_parameter([&](Parameter<float>& p) { names.push_back(p.name); });
    double worst = 0;
    for (std::size_t i = 0; i < gf.size(); ++i) {
      const double e = relative_error(gh[i].data(), gf[i].data(), static_cast<std::int64_t>(gf[i].size()));
      CAPTURE(names[i]);
      CHECK(e < 2e-2);
      worst = std::max(worst, e);
    }
    MESSAGE("worst relative gradient error ", worst);
    // Evaluation and the logits agree too; the logits are fp32 from bf16 operands.
    const Tensor<float> zf = f.logits(b.inputs, b.g), zh = h.logits(b.inputs, b.g);
    CHECK(relative_error(zh.data(), zf.data(), zf.numel()) < 2e-2);
    CHECK(std::fabs(h.loss(b.inputs, b.targets, b.g) - lh) <= 1e-6 * std::fabs(lh));
  }
}

TEST_CASE("bf16 model: every activation-checkpoint mode gives bitwise the gradients of none, float8 GEMMs too") {
  // With float8 GEMMs (emulated) too: a tensorwise linear layer's backward casts x and W
  // by the scales its forward saved, which the recompute saves again, or, where selective
  // checkpointing replays the forward's output, by their own amax: the same scales.
  using Block = Parallel<LlamaBlock<bf16, Cpu>, Checkpoint<Dynamic>>;
  const parallel::CheckpointMode modes[] = {
      {parallel::CheckpointMode::Kind::none, 0},
      {parallel::CheckpointMode::Kind::full, 0},
      {parallel::CheckpointMode::Kind::selective_op, 0},
      {parallel::CheckpointMode::Kind::selective_layer, 2},
  };
  const Batch b;
  const std::optional<ops::Float8Recipe> recipes[] = {std::nullopt, ops::Float8Recipe::tensorwise,
                                                      ops::Float8Recipe::rowwise};
  double bf16_loss = 0;
  // In bf16 twice: with the projections run as one (selective "op" runs them one by one,
  // so it is compared in the second pass only) and one by one. Float8 layers run one by one.
  struct Pass {
    std::optional<ops::Float8Recipe> recipe;
    bool fuse;
  };
  const Pass passes[] = {{recipes[0], true}, {recipes[0], false}, {recipes[1], true}, {recipes[2], true}};
  for (const auto& [recipe, fuse] : passes) {
    CAPTURE(recipe ? std::string(ops::name_of(*recipe)) : std::string("bf16"));
    CAPTURE(fuse);
    std::vector<std::vector<float>> reference;
    double reference_loss = 0;
    for (const auto& mode : modes) {
      CAPTURE(mode.str());
      if (!recipe && fuse && mode.kind == parallel::CheckpointMode::Kind::selective_op) continue;
      parallel::Plan plan;
      plan.checkpoint = mode;
      plan.fuse_projections = fuse;
      if (recipe) {
        plan.float8.enabled = true;
        plan.float8.emulate = true;
        plan.float8.recipe = *recipe;
      }
      Transformer<bf16, Cpu, Block> m(small_args(), plan);
      m.init_weights(9);
      m.shard();
      m.zero_grad();
      const double loss = m.forward_backward(b.inputs, b.targets, b.g, 1.0 / b.g.rows());
      const auto g = gradients(m);
      if (reference.empty()) {
        reference = g;
        reference_loss = loss;
        if (!recipe) bf16_loss = loss;  // (the second bf16 pass: with the projections one by one)
        else CHECK(loss != bf16_loss);  // the float8 GEMMs ran
        continue;
      }
      CHECK(loss == reference_loss);
      REQUIRE(g.size() == reference.size());
      for (std::size_t i = 0; i < g.size(); ++i) CHECK(g[i] == reference[i]);
    }
  }
}

TEST_CASE("bf16 model: a saved statistic read as an activation is refused by name") {
  ActivationStore<bf16> store("layers.0.attention");
  store.save("lse", SaveKind::attention, Saved<bf16>(Tensor<float>(Shape{4})));
  CHECK(store.find<float>("lse") != nullptr);
  CHECK(store.find<bf16>("lse") == nullptr);
  CHECK_THROWS_WITH_AS(store.load<bf16>("lse"),
                       doctest::Contains("activation 'layers.0.attention.lse' was saved with another element type"),
                       Error);
  CHECK_THROWS_WITH_AS(store.load<float>("o"), doctest::Contains("'layers.0.attention.o' was not saved"), Error);
}

TEST_CASE("bf16 model: saved and loaded, as tessera checkpoints and Hugging Face directories, in either dtype") {
  const test::TempDir dir("tessera_bf16_model");
  Transformer<bf16, Cpu> h(small_args());
  h.init_weights(11);
  std::vector<std::vector<float>> values;
  h.for_each_parameter([&](Parameter<bf16>& p) {
    values.emplace_back();
    for (std::int64_t i = 0; i < p.numel(); ++i) values.back().push_back(static_cast<float>(p.value[i]));
  });
  auto same_values = [&](auto& model) {
    std::size_t k = 0;
    bool same = true;
    model.for_each_parameter([&](auto& p) {
      for (std::int64_t i = 0; i < p.numel(); ++i)
        same = same && static_cast<float>(p.value[i]) == values[k][static_cast<std::size_t>(i)];
      ++k;
    });
    return same && k == values.size();
  };
  for (DType stored : {DType::bf16, DType::f32}) {
    CAPTURE(name_of(stored));
    // bf16 values are exact in either dtype: a bf16 model and an fp32 one load them alike.
    train::save_model(h, dir.file("model.safetensors"), stored);
    Transformer<bf16, Cpu> back(small_args());
    train::load_model(back, dir.file("model.safetensors"));
    CHECK(same_values(back));
    Transformer<float, Cpu> wide(small_args());
    train::load_model(wide, dir.file("model.safetensors"));
    CHECK(same_values(wide));
    train::HfSaveOptions as_stored;
    as_stored.dtype = stored;
    train::save_hf_model(h, dir.file("hf"), as_stored);
    Transformer<bf16, Cpu> from_hf(train::read_hf_config(dir.file("hf")));
    train::load_hf_model(from_hf, dir.file("hf"));
    CHECK(same_values(from_hf));
  }
}

}  // namespace test_bf16_model
