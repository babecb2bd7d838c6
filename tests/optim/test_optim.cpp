// AdamW, the learning-rate schedule and gradient clipping against hand-computed values.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/optim/lr_schedule.hpp"

using namespace tessera;
using namespace tessera::optim;

namespace {
// A one-parameter "model" for the optimizer.
struct OneParam {
  using scalar_type = double;
  nn::Parameter<double> p{"w", Shape{3}, nn::Init::ones()};
  template <class F>
  void for_each_parameter(F&& f) {
    f(p);
  }
};
struct OneFloat {
  using scalar_type = float;
  nn::Parameter<float> p{"w", Shape{1}, nn::Init::ones()};
  template <class F>
  void for_each_parameter(F&& f) {
    f(p);
  }
};
}  // namespace

TEST_CASE("AdamW matches torch.optim.AdamW's update") {
  OneParam m;
  std::vector<double> w = {1.0, -2.0, 0.5}, g1 = {0.1, -0.3, 0.0}, g2 = {-0.2, 0.4, 1.0};
  for (int i = 0; i < 3; ++i) m.p.value[i] = w[i];
  AdamWOptions o;
  o.lr = 0.01, o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8, o.weight_decay = 0.1;
  AdamW<double, Cpu> opt(m, o);
  std::vector<double> mm(3, 0), vv(3, 0);
  for (int t = 1; t <= 2; ++t) {
    const auto& g = t == 1 ? g1 : g2;
    for (int i = 0; i < 3; ++i) m.p.grad[i] = g[i];
    opt.step(o.lr);
    for (int i = 0; i < 3; ++i) {
      w[i] *= 1 - o.lr * o.weight_decay;
      mm[i] = 0.9 * mm[i] + 0.1 * g[i];
      vv[i] = 0.95 * vv[i] + 0.05 * g[i] * g[i];
      double mhat = mm[i] / (1 - std::pow(0.9, t)), vhat = vv[i] / (1 - std::pow(0.95, t));
      w[i] -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
      CHECK(m.p.value[i] == doctest::Approx(w[i]).epsilon(1e-14));
    }
  }
  CHECK(opt.steps_taken() == 2);
}

TEST_CASE("AdamW with bf16 parameters keeps fp32 masters and rounds the parameters") {
  OneFloat m;
  m.p.value[0] = 1.0f;
  AdamWOptions o;
  o.lr = 1e-4, o.weight_decay = 0, o.param_dtype = DType::bf16;
  AdamW<float, Cpu> opt(m, o);
  for (int i = 0; i < 10; ++i) {
    m.p.grad[0] = 1.0f;
    opt.step(o.lr);
  }
  // Ten steps of ~1e-4 move the master to ~0.999, below bf16's resolution at 1 (2^-8):
  // the parameter is the master's rounding, not an accumulation of rounded steps.
  CHECK(m.p.value[0] == round_to_bf16(1.0f - 10 * 1e-4f));
  CHECK(m.p.value[0] == 1.0f);
  CHECK(opt.state_bytes() == 3 * sizeof(float));
}

TEST_CASE("LR schedule follows torchtitan's warmup-stable-decay") {
  SUBCASE("warmup then linear decay to the end when decay_ratio is unset") {
    LrSchedule s(10, 2, std::nullopt, DecayType::linear, 0.0);
    CHECK(s.decay_steps() == 8);
    CHECK(s.factor(0) == doctest::Approx(1.0 / 3));
    CHECK(s.factor(1) == doctest::Approx(2.0 / 3));
    CHECK(s.factor(2) == doctest::Approx(1 - 1.0 / 9));
    CHECK(s.factor(9) == doctest::Approx(1 - 8.0 / 9));
    CHECK(s.factor(50) == s.factor(10));
  }
  SUBCASE("stable phase and cosine decay onto min_lr_factor") {
    LrSchedule s(100, 10, 0.5, DecayType::cosine, 0.1);
    CHECK(s.warmup_steps() == 10);
    CHECK(s.stable_steps() == 40);
    CHECK(s.decay_steps() == 50);
    CHECK(s.factor(30) == 1.0);
    const double p = (60 + 1 - 50) / 51.0;
    CHECK(s.factor(60) == doctest::Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * p))));
  }
  SUBCASE("sqrt decay") {
    LrSchedule s(10, 0, 1.0, DecayType::sqrt, 0.0);
    CHECK(s.factor(0) == doctest::Approx(1 - std::sqrt(1.0 / 11)));
  }
  CHECK_THROWS_WITH_AS(parse_decay_type("exp"), doctest::Contains("lr_scheduler.decay_type"), Error);
  CHECK_THROWS_WITH_AS(LrSchedule(10, 0, 1.5, DecayType::linear, 0), doctest::Contains("decay_ratio"), Error);
}

TEST_CASE("Gradient norm and clipping coefficient") {
  OneParam m;
  m.p.grad[0] = 3, m.p.grad[1] = 4, m.p.grad[2] = 0;
  CHECK(grad_norm<Cpu>(m) == doctest::Approx(5.0));
  CHECK(clip_coefficient(5.0, 1.0) == doctest::Approx(1.0 / (5.0 + 1e-6)));
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(50.0, 0.0) == 1.0);
  // A long tensor: the chunked sum equals the plain one.
  Tensor<float> big(Shape{100000});
  double ref = 0;
  for (std::int64_t i = 0; i < big.numel(); ++i) big[i] = float(i % 7) - 3, ref += double(big[i]) * big[i];
  CHECK(squared_norm<Cpu>(big) == ref);
}
