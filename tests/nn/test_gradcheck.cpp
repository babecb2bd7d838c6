// tessera::testing::check_gradients, the gradient checker shipped for users' layers: it
// passes a correct backward, and names the gradient a wrong one gets wrong.
#include <doctest/doctest.h>

#include <memory>
#include <string>

#include "../../examples/custom_layer.hpp"
#include "../support/gradcheck.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/nn/rope.hpp"
#include "tessera/testing/gradcheck.hpp"

namespace test_gradcheck {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;
using testing::check_gradients;
using testing::GradientReport;

namespace {

/// y = x + x W^T, with a backward that forgets the residual's gradient when told to;
/// `unused` is a parameter nothing reads.
class Residual : public LayerTypes<double, Cpu> {
 public:
  Residual(std::int64_t dim, bool drop_residual, bool with_unused)
      : proj_("proj", dim, dim, Init::truncated_normal(0.5)),
        unused_(Parameter<double>::on<Cpu>("unused", Shape{3}, Init::normal(1.0))),
        drop_residual_(drop_residual),
        with_unused_(with_unused) {
    proj_.for_each_parameter([](Parameter<double>& p) { testing::fill_normal(p.value, 5, p.name, 0.5); });
  }
  Tensor<double> forward(const Context<double>& ctx, const Tensor<double>& x) {
    Tensor<double> y = proj_.forward(ctx.child("proj"), x);
    for (std::int64_t i = 0; i < y.numel(); ++i) y[i] += x[i];
    return y;
  }
  Tensor<double> backward(const Context<double>& ctx, const Tensor<double>& dy) {
    Tensor<double> dx = proj_.backward(ctx.child("proj"), dy);
    if (!drop_residual_)
      for (std::int64_t i = 0; i < dx.numel(); ++i) dx[i] += dy[i];
    return dx;
  }
  template <class F>
  void for_each_parameter(F&& f) {
    proj_.for_each_parameter(f);
    if (with_unused_) f(unused_);
  }

 private:
  Linear<double, Cpu> proj_;
  Parameter<double> unused_;
  bool drop_residual_, with_unused_;
};

const testing::GradientCheck& check_named(const GradientReport& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return c;
  FAIL("no check named " << name);
  return r.checks.front();
}

}  // namespace

TEST_CASE("check_gradients: the Llama block's backward passes, every gradient reported") {
  const ModelArgs a = testing::tiny_args();
  auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  LlamaBlock<double, Cpu> block(BlockArgs<double, Cpu>{a, 0, "layers.0", rope});
  // A block made alone holds zeros (a model's init_weights draws its values): values of a
  // larger scale than the init, so that every path carries gradient well above noise.
  block.for_each_parameter([](Parameter<double>& p) { testing::fill_normal(p.value, 9, p.name, 0.5); });
  int parameters = 0;
  block.for_each_parameter([&](Parameter<double>&) { ++parameters; });
  const GradientReport r = check_gradients(block, Geometry{2, 5}, a.dim);
  INFO(r.str());
  CHECK(r.passed());
  REQUIRE(r.checks.size() == static_cast<std::size_t>(1 + parameters));
  CHECK(r.checks.front().name == "input");
  CHECK(r.checks.front().elements == 2 * 5 * a.dim);
  CHECK(check_named(r, "layers.0.attention.wq.weight").passed);
  CHECK(r.str().find("FAIL") == std::string::npos);
}

TEST_CASE("check_gradients: a block with its own options (the ReLU^2 block, scaled residuals) passes") {
  const ModelArgs a = testing::tiny_args();
  auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  const examples::ReluSquaredOptions options{12, 0.5};
  examples::ReluSquaredBlock<double, Cpu> block(
      BlockArgs<double, Cpu>{a, 0, "layers.0", rope, nullptr, nullptr, BlockOptionsRef(options)});
  block.for_each_parameter([](Parameter<double>& p) { testing::fill_normal(p.value, 9, p.name, 0.5); });
  const GradientReport r = check_gradients(block, Geometry{2, 5}, a.dim);
  INFO(r.str());
  CHECK(r.passed());
  CHECK(check_named(r, "layers.0.mlp.w1.weight").elements == 12 * a.dim);
}

TEST_CASE("check_gradients: a backward that drops the residual fails on the input, named in the report") {
  Residual right(6, false, false), wrong(6, true, false);
  const GradientReport good = check_gradients(right, Geometry{2, 3}, 6);
  INFO(good.str());
  CHECK(good.passed());
  const GradientReport bad = check_gradients(wrong, Geometry{2, 3}, 6);
  INFO(bad.str());
  CHECK_FALSE(bad.passed());
  CHECK_FALSE(check_named(bad, "input").passed);
  CHECK(check_named(bad, "input").relative_error > 0.1);
  CHECK(check_named(bad, "proj.weight").passed);  // the projection's own gradient is right
  CHECK(bad.str().find("FAIL input: relative error") != std::string::npos);
  CHECK(bad.str().find("backward") != std::string::npos);
}

TEST_CASE("check_gradients: a parameter nothing reaches fails, said as such") {
  Residual layer(4, false, true);
  const GradientReport r = check_gradients(layer, Geometry{1, 2}, 4);
  INFO(r.str());
  CHECK_FALSE(r.passed());
  CHECK(check_named(r, "input").passed);
  CHECK_FALSE(check_named(r, "unused").passed);
  CHECK(check_named(r, "unused").norm == 0);
  CHECK(r.str().find("nothing reaches it") != std::string::npos);
}

TEST_CASE("check_gradients: LoRA adapters beside a frozen block pass, fused and one by one, every target") {
  const ModelArgs a = testing::tiny_args();
  auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  for (const bool fuse : {true, false}) {
    for (const std::vector<std::string>& targets :
         {std::vector<std::string>{}, std::vector<std::string>{"wq", "wv", "w2"}}) {
      CAPTURE(fuse);
      CAPTURE(targets.size());
      parallel::Plan plan;
      plan.fuse_projections = fuse;
      plan.lora = LoraPolicy{true, 3, 5.0, targets};
      FreezeParameters frozen;  // as the model makes its blocks under LoRA
      LlamaBlock<double, Cpu> block(BlockArgs<double, Cpu>{a, 0, "layers.0", rope, &plan});
      // B starts at zero (the model starts as it was): values of the init's scale or more
      // everywhere, so that every path carries gradient.
      block.for_each_parameter([](Parameter<double>& p) { testing::fill_normal(p.value, 9, p.name, 0.5); });
      int trainable = 0, frozen_weights = 0;
      block.for_each_parameter([&](Parameter<double>& p) {
        const bool adapter = p.name.find(".lora_") != std::string::npos;
        CHECK_MESSAGE(p.frozen != adapter, p.name);
        CHECK_MESSAGE(p.grad.empty() == p.frozen, p.name);
        (p.frozen ? frozen_weights : trainable) += 1;
      });
      CHECK(trainable == 2 * (targets.empty() ? 7 : 3));
      CHECK(frozen_weights == 9);  // seven projections and two norms
      const GradientReport r = check_gradients(block, Geometry{2, 5}, a.dim);
      INFO(r.str());
      CHECK(r.passed());
      CHECK(r.checks.size() == static_cast<std::size_t>(1 + trainable));
    }
  }
}

}  // namespace test_gradcheck
