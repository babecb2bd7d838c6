// AdamW, the learning-rate schedule and gradient clipping against hand-computed values.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
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

namespace {
// Parameters of awkward sizes: empty, one element, across a block of the multi-tensor
// launch (ops::kAdamWBlock), and across several chunks of the norm (ops::kNormChunk).
struct ManyParams {
  using scalar_type = float;
  std::vector<nn::Parameter<float>> ps;
  ManyParams() {
    const std::int64_t sizes[] = {0, 1, ops::kAdamWBlock - 1, ops::kAdamWBlock + 3, 3 * ops::kNormChunk + 17, 5};
    const char* names[] = {"empty", "one", "below_block", "above_block", "chunks", "five"};
    for (std::size_t k = 0; k < std::size(sizes); ++k) {
      ps.emplace_back(names[k], Shape{sizes[k]}, nn::Init{});
      for (std::int64_t i = 0; i < sizes[k]; ++i) {
        ps.back().value[i] = std::sin(0.37f * float(i + 11 * k));
        ps.back().grad[i] = std::cos(0.53f * float(i + 7 * k)) * 0.01f;
      }
    }
  }
  template <class F>
  void for_each_parameter(F&& f) {
    for (auto& p : ps) f(p);
  }
};

// One tensor's AdamW by the single-tensor functor: the reference for the launch over all.
void reference_step(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v,
                    const AdamWOptions& o, int t, float lr, float scale) {
  const float bc1 = float(1 - std::pow(o.beta1, t)), bc2 = float(1 - std::pow(o.beta2, t));
  ops::AdamWStep<float> step{p.data(), g.data(), m.data(), v.data(), lr, float(o.beta1), float(o.beta2),
                             float(o.eps), float(o.weight_decay), bc1, bc2, scale};
  for (std::size_t i = 0; i < p.size(); ++i) step(static_cast<std::int64_t>(i));
}

std::vector<float> values(const Tensor<float>& t) { return std::vector<float>(t.data(), t.data() + t.numel()); }

// A bf16 model's parameters for the optimizer.
struct Bf16Params {
  using scalar_type = bf16;
  std::vector<nn::Parameter<bf16>> ps;
  template <class F>
  void for_each_parameter(F&& f) {
    for (auto& p : ps) f(p);
  }
};
}  // namespace

TEST_CASE("AdamW updates every tensor in one launch exactly as tensor by tensor") {
  ManyParams model;
  AdamWOptions o;
  o.lr = 1e-2;
  std::vector<std::vector<float>> p, m, v;
  for (auto& q : model.ps) {
    p.push_back(values(q.value));
    m.emplace_back(q.numel(), 0.0f);
    v.emplace_back(q.numel(), 0.0f);
  }
  AdamW<float, Cpu> opt(model, o);
  for (int t = 1; t <= 3; ++t) {
    const float scale = t == 2 ? 0.5f : 1.0f;
    opt.step(o.lr, scale);
    for (std::size_t k = 0; k < model.ps.size(); ++k) {
      reference_step(p[k], values(model.ps[k].grad), m[k], v[k], o, t, float(o.lr), scale);
      CAPTURE(k);
      CHECK(values(model.ps[k].value) == p[k]);  // bitwise: the same arithmetic in the same order
    }
  }
  // A parameter whose tensors are replaced (as loading does) is updated where it now lives.
  nn::Parameter<float>& moved = model.ps[3];
  Tensor<float> fresh(moved.shape());
  for (std::int64_t i = 0; i < fresh.numel(); ++i) fresh[i] = 1.0f;
  moved.value = fresh;
  opt.step(o.lr);
  CHECK(fresh[0] != 1.0f);
  reference_step(p[3] = std::vector<float>(fresh.numel(), 1.0f), values(moved.grad), m[3], v[3], o, 4, float(o.lr),
                 1.0f);
  CHECK(values(fresh) == p[3]);
}

TEST_CASE("AdamW with bf16 parameters: one launch updates the masters and rounds the parameters") {
  ManyParams model, reference;
  AdamWOptions o;
  o.lr = 1e-2;
  o.param_dtype = DType::bf16;
  AdamW<float, Cpu> opt(model, o);
  std::vector<std::vector<float>> master, m, v;
  for (auto& q : reference.ps) {
    master.push_back(values(q.value));
    m.emplace_back(q.numel(), 0.0f);
    v.emplace_back(q.numel(), 0.0f);
  }
  for (int t = 1; t <= 2; ++t) {
    opt.step(o.lr);
    for (std::size_t k = 0; k < model.ps.size(); ++k) {
      reference_step(master[k], values(reference.ps[k].grad), m[k], v[k], o, t, float(o.lr), 1.0f);
      std::vector<float> rounded(master[k].size());
      for (std::size_t i = 0; i < rounded.size(); ++i) rounded[i] = round_to_bf16(master[k][i]);
      CAPTURE(k);
      CHECK(values(model.ps[k].value) == rounded);
    }
  }
}

TEST_CASE("AdamW on a bf16 model: fp32 masters, moments and gradients; the parameters their rounding") {
  ManyParams reference;  // fp32 values and gradients; the bf16 model starts from their rounding
  Bf16Params model;
  static_assert(std::is_same_v<decltype(model.ps[0].grad), Tensor<float>>);
  std::vector<std::vector<float>> master, m, v;
  for (auto& q : reference.ps) {
    model.ps.emplace_back(q.name, q.shape(), nn::Init{});
    master.emplace_back();
    for (std::int64_t i = 0; i < q.numel(); ++i) {
      model.ps.back().value[i] = bf16(q.value[i]);
      model.ps.back().grad[i] = q.grad[i];
      master.back().push_back(round_to_bf16(q.value[i]));
    }
    m.emplace_back(q.numel(), 0.0f);
    v.emplace_back(q.numel(), 0.0f);
  }
  AdamWOptions o;
  o.lr = 1e-2;
  o.param_dtype = DType::bf16;
  AdamW<bf16, Cpu> opt(model, o);
  for (int t = 1; t <= 3; ++t) {
    const float scale = t == 2 ? 0.5f : 1.0f;
    opt.step(o.lr, scale);
    for (std::size_t k = 0; k < model.ps.size(); ++k) {
      reference_step(master[k], values(reference.ps[k].grad), m[k], v[k], o, t, float(o.lr), scale);
      CAPTURE(k);
      for (std::size_t i = 0; i < master[k].size(); ++i)
        REQUIRE(static_cast<float>(model.ps[k].value[static_cast<std::int64_t>(i)]) == round_to_bf16(master[k][i]));
    }
  }
  // Moments and masters: three fp32 tensors per parameter.
  std::size_t elements = 0;
  for (const auto& q : model.ps) elements += static_cast<std::size_t>(q.numel());
  CHECK(opt.state_bytes() == 3 * sizeof(float) * elements);
  o.param_dtype = DType::f32;
  using Bf16AdamW = AdamW<bf16, Cpu>;
  CHECK_THROWS_WITH_AS(Bf16AdamW(model, o),
                       doctest::Contains("AdamW: a bfloat16 model has bfloat16 parameters: param_dtype float32 "
                                         "contradicts it (leave it unset)"),
                       Error);
}

namespace {
/// A chunk's sum of squares in the order ops/norm.hpp defines, from that definition:
/// lane l holds elements l, l + L, ... added in turn (L = kNormLanes); then
/// V(l, L) = lane l and V(l, h) = V(l, 2h) + V(l + h, 2h), and the sum is V(0, 1).
/// The same order over f(x[i]).
template <class X, class F>
double lane_order(const X* x, std::int64_t n, F f) {
  std::vector<double> lane(ops::kNormLanes, 0.0);
  for (std::int64_t i = 0; i < n; ++i) lane[std::size_t(i % ops::kNormLanes)] += f(x[i]);
  const auto v = [&](auto&& self, int l, int h) -> double {
    return h == ops::kNormLanes ? lane[std::size_t(l)] : self(self, l, 2 * h) + self(self, l + h, 2 * h);
  };
  return v(v, 0, 1);
}
double lane_order_sum(const float* x, std::int64_t n) {
  return lane_order(x, n, [](float e) { return double(e) * double(e); });
}
/// n doubles added in lane order (ops::LaneSum's definition).
double lane_order_total(const double* x, std::int64_t n) {
  return lane_order(x, n, [](double e) { return e; });
}
}  // namespace

TEST_CASE("A chunk's sum of squares follows the lane order, which is not the sequential one") {
  // Full-mantissa values of mixed sizes: the order of the additions shows in the bits.
  std::vector<float> x(std::size_t(ops::kNormChunk));
  std::uint64_t r = 0x2545f4914f6cdd1dull;
  for (auto& v : x) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    v = std::ldexp(float(r >> 40) / float(1 << 24) + 0.5f, int(r >> 36 & 15) - 8);
  }
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{255}, std::int64_t{257}, std::int64_t{5000}, ops::kNormChunk}) {
    CAPTURE(n);
    const double want = lane_order_sum(x.data(), n);
    SquaredNorms<Cpu, float> norms;
    norms.add(x.data(), n);
    CHECK(norms.sum() == want);
    long double exact = 0;
    double sequential = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      exact += static_cast<long double>(x[i]) * x[i];
      sequential += double(x[i]) * x[i];
    }
    CHECK(want == doctest::Approx(double(exact)).epsilon(1e-14));
    if (n == ops::kNormChunk) CHECK(want != sequential);  // the check above can tell the orders apart
  }
}

TEST_CASE("SquaredNorms sums many pieces in one launch, the chunks' sums added in lane order") {
  ManyParams model;
  SquaredNorms<Cpu, float> norms;
  std::vector<double> chunks;  // each chunk's sum, piece after piece
  for (auto& p : model.ps) {
    for (std::int64_t c = 0; c < p.numel(); c += ops::kNormChunk)
      chunks.push_back(lane_order_sum(p.grad.data() + c, std::min(p.numel() - c, ops::kNormChunk)));
    norms.add(p.grad);
  }
  const double expected = lane_order_total(chunks.data(), static_cast<std::int64_t>(chunks.size()));
  CHECK(norms.sum() == expected);  // bitwise: chunk sums, then their lane-order total
  // Left on the device: the same bits, into memory the host did not read.
  double out = -1;
  for (auto& p : model.ps) norms.add(p.grad);
  norms.sum_into(&out);
  CHECK(out == expected);
  SquaredNorms<Cpu, float> none;
  none.sum_into(&out);
  CHECK(out == 0.0);
  CHECK(norms.sum() == 0.0);       // sum() forgets what it summed
  // The same pieces again reuse the uploaded table; a changed piece is seen.
  for (auto& p : model.ps) norms.add(p.grad);
  CHECK(norms.sum() == expected);
  model.ps[4].grad[ops::kNormChunk + 1] += 1.0f;
  for (auto& p : model.ps) norms.add(p.grad);
  CHECK(norms.sum() != expected);
  // Part of a tensor, as a shard's slice of a parameter.
  norms.add(model.ps[2].grad.data() + 1, 2);
  CHECK(norms.sum() == double(model.ps[2].grad[1]) * model.ps[2].grad[1] + double(model.ps[2].grad[2]) * model.ps[2].grad[2]);
  double per_tensor = 0;
  for (auto& p : model.ps) per_tensor += squared_norm<Cpu>(p.grad);
  CHECK(grad_norm<Cpu>(model) == doctest::Approx(std::sqrt(per_tensor)).epsilon(1e-14));
}

TEST_CASE("LaneSum adds doubles in lane order, written or added to its output") {
  std::vector<double> x(3 * ops::kNormLanes + 41);
  std::uint64_t r = 0x9e3779b97f4a7c15ull;
  for (auto& v : x) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    v = std::ldexp(double(r >> 11) / double(1ull << 53) + 0.5, int(r >> 7 & 31) - 16);
  }
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{255}, std::int64_t{256},
                               static_cast<std::int64_t>(x.size())}) {
    CAPTURE(n);
    double out = 7.0;
    ops::LaneSum{x.data(), n, &out, false}(0);
    CHECK(out == lane_order_total(x.data(), n));
    double acc = 0.25;
    ops::LaneSum{x.data(), n, &acc, true}(0);
    CHECK(acc == 0.25 + lane_order_total(x.data(), n));
  }
  double sequential = 0;
  for (double v : x) sequential += v;
  CHECK(lane_order_total(x.data(), std::int64_t(x.size())) != sequential);  // the orders differ, so the check can tell
}

TEST_CASE("ClipScale: the clip coefficient from the device's squared norm; NaN where the norm or loss is not finite") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  auto scale = [](double squared, double loss, double max_norm) {
    float s = -1;
    ops::ClipScale<float>{&squared, &loss, max_norm, &s}(0);
    return s;
  };
  CHECK(scale(25.0, 3.0, 1.0) == float(clip_coefficient(5.0, 1.0)));
  CHECK(scale(25.0, 3.0, 1.0) == float(1.0 / (5.0 + 1e-6)));
  CHECK(scale(0.25, 3.0, 1.0) == 1.0f);
  CHECK(scale(2500.0, 3.0, 0.0) == 1.0f);  // max_norm <= 0: no clipping
  CHECK(std::isnan(scale(inf, 3.0, 1.0)));
  CHECK(std::isnan(scale(nan, 3.0, 1.0)));
  CHECK(std::isnan(scale(25.0, inf, 1.0)));
  CHECK(std::isnan(scale(25.0, -inf, 0.0)));  // even with clipping off
  CHECK(std::isnan(scale(25.0, nan, 1.0)));
  double squared = 25.0;
  double s = -1;
  ops::ClipScale<double>{&squared, nullptr, 1.0, &s}(0);  // no loss given: the norm alone
  CHECK(s == clip_coefficient(5.0, 1.0));
}

TEST_CASE("AdamW reading its gradient scale from the backend's memory: the host scale's update bit for bit; NaN skips it") {
  ManyParams by_host, by_device;
  AdamWOptions o;
  o.lr = 1e-2;
  AdamW<float, Cpu> host(by_host, o), device(by_device, o);
  for (int t = 1; t <= 3; ++t) {
    const float scale = t == 2 ? 0.37f : 1.0f;
    host.step(o.lr, scale);
    device.step(o.lr, &scale);
    for (std::size_t k = 0; k < by_host.ps.size(); ++k) {
      CAPTURE(k);
      CHECK(values(by_device.ps[k].value) == values(by_host.ps[k].value));
    }
  }
  const std::vector<float> before = values(by_device.ps[4].value);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  device.step(o.lr, &nan);
  CHECK(values(by_device.ps[4].value) == before);  // nothing changed: not the parameters ...
  host.step(o.lr, 1.0f);
  device.set_steps_taken(3);
  device.step(o.lr, 1.0f);  // ... nor the moments: the next step is the host's fourth
  for (std::size_t k = 0; k < by_host.ps.size(); ++k) {
    CAPTURE(k);
    CHECK(values(by_device.ps[k].value) == values(by_host.ps[k].value));
  }
}

namespace {
/// x rounded to the nearer of its two bf16 neighbours, the even one on a tie: written
/// from the definition, apart from core/dtype.hpp's bit trick.
float bf16_nearest_even(float x) {
  const auto u = std::bit_cast<std::uint32_t>(x);
  const float toward_zero = std::bit_cast<float>(u & 0xffff0000u);
  const float away = std::bit_cast<float>((u & 0xffff0000u) + 0x10000u);
  const double below = std::fabs(double(x) - toward_zero), above = std::fabs(double(away) - x);
  if (below != above) return below < above ? toward_zero : away;
  return (u >> 16) & 1u ? away : toward_zero;
}

/// The gradients of step t: a different pattern each step, ~1e-2.
void set_gradients(ManyParams& model, int t) {
  for (std::size_t k = 0; k < model.ps.size(); ++k)
    for (std::int64_t i = 0; i < model.ps[k].numel(); ++i)
      model.ps[k].grad[i] = std::cos(0.53f * float(i + 7 * k) + 1.7f * float(t)) * 0.01f;
}

/// What a multi-tensor launch over ManyParams holds on the host: parameters P (float or
/// bf16), fp32 masters or none, bf16 moments.
template <class P>
struct HostTensors {
  std::vector<std::vector<P>> param;
  std::vector<std::vector<float>> grad, master;
  std::vector<std::vector<bf16>> m, v;
  std::vector<ops::AdamWTensor<P, bf16>> table;
  std::vector<std::int32_t> blocks;

  HostTensors(const ManyParams& model, bool masters) {
    std::int64_t begin = 0;
    for (const auto& q : model.ps) {
      param.emplace_back(), grad.emplace_back(), master.emplace_back();
      for (std::int64_t i = 0; i < q.numel(); ++i) {
        param.back().push_back(convert<P>(q.value[i]));
        grad.back().push_back(q.grad[i]);
        if (masters) master.back().push_back(to_accum(param.back().back()));
      }
      m.emplace_back(q.numel(), bf16(0.0f)), v.emplace_back(q.numel(), bf16(0.0f));
    }
    for (std::size_t k = 0; k < param.size(); ++k) {
      if (param[k].empty()) continue;
      const auto n = static_cast<std::int64_t>(param[k].size());
      table.push_back({param[k].data(), grad[k].data(), m[k].data(), v[k].data(), masters ? master[k].data() : nullptr,
                       n, begin});
      for (std::int64_t b = 0; b < (n + ops::kAdamWBlock - 1) / ops::kAdamWBlock; ++b)
        blocks.push_back(static_cast<std::int32_t>(table.size() - 1));
      begin += (n + ops::kAdamWBlock - 1) / ops::kAdamWBlock * ops::kAdamWBlock;
    }
  }
};
}  // namespace

TEST_CASE("AdamW with bf16 moments: each moment is its fp32 update rounded to nearest even") {
  // The functor over fp32 parameters without masters, with masters, and over a bf16 model.
  auto check = [](auto param_tag, bool masters) {
    using P = decltype(param_tag);
    CAPTURE(sizeof(P));
    CAPTURE(masters);
    ManyParams model;
    HostTensors<P> h(model, masters);
    // The reference: plain fp32 values, the moments rounded by bf16_nearest_even.
    std::vector<std::vector<float>> p, m, v;
    for (std::size_t k = 0; k < h.param.size(); ++k) {
      p.emplace_back();
      for (const P& x : h.param[k]) p.back().push_back(to_accum(x));
      m.emplace_back(h.param[k].size(), 0.0f), v.emplace_back(h.param[k].size(), 0.0f);
    }
    std::size_t rounded = 0, elements = 0;
    for (int t = 1; t <= 4; ++t) {
      set_gradients(model, t);
      for (std::size_t k = 0; k < h.grad.size(); ++k)
        for (std::size_t i = 0; i < h.grad[k].size(); ++i) h.grad[k][i] = model.ps[k].grad[static_cast<std::int64_t>(i)];
      const ops::AdamWScalars<float> s{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, float(1 - std::pow(0.9, t)),
                                       float(1 - std::pow(0.95, t)), t == 3 ? 0.5f : 1.0f};
      const ops::AdamWMultiStep<P, bf16> step{h.table.data(), h.blocks.data(), s, 0, 0, masters};
      Cpu::for_each(static_cast<std::int64_t>(h.blocks.size()) * ops::kAdamWBlock, step);
      for (std::size_t k = 0; k < p.size(); ++k) {
        CAPTURE(k);
        for (std::size_t i = 0; i < p[k].size(); ++i) {
          ops::adamw_update(p[k][i], m[k][i], v[k][i], h.grad[k][i], s);  // the fp32 update
          rounded += (m[k][i] != bf16_nearest_even(m[k][i])) + (v[k][i] != bf16_nearest_even(v[k][i]));
          elements += 2;
          m[k][i] = bf16_nearest_even(m[k][i]), v[k][i] = bf16_nearest_even(v[k][i]);
          REQUIRE(h.m[k][i].bits == bf16(m[k][i]).bits);
          REQUIRE(h.v[k][i].bits == bf16(v[k][i]).bits);
          REQUIRE(static_cast<float>(h.m[k][i]) == m[k][i]);  // bitwise, from the definition
          REQUIRE(static_cast<float>(h.v[k][i]) == v[k][i]);
          if (masters) {
            REQUIRE(h.master[k][i] == p[k][i]);
            REQUIRE(to_accum(h.param[k][i]) == bf16_nearest_even(p[k][i]));
          } else {
            REQUIRE(to_accum(h.param[k][i]) == p[k][i]);
          }
        }
      }
    }
    // The rounding is not idle: most fp32 moments are not bf16 values.
    CHECK(rounded > elements / 2);
  };
  check(float{}, false);
  check(float{}, true);
  check(bf16{}, true);
}

TEST_CASE("AdamW with state_dtype bf16: 2-byte moments, the update the functor gives, refused where it cannot run") {
  ManyParams model, reference;
  AdamWOptions o;
  o.lr = 1e-2;
  o.state_dtype = DType::bf16;
  AdamW<float, Cpu> opt(model, o);
  std::size_t elements = 0;
  for (const auto& q : model.ps) elements += static_cast<std::size_t>(q.numel());
  CHECK(opt.state_bytes() == 2 * sizeof(bf16) * elements);
  o.param_dtype = DType::bf16;  // and an fp32 master
  ManyParams mixed;
  CHECK(AdamW<float, Cpu>(mixed, o).state_bytes() == (2 * sizeof(bf16) + sizeof(float)) * elements);
  o.param_dtype = DType::f32;
  // The optimizer's parameters follow the functor's over the same tables, bitwise.
  HostTensors<float> h(reference, false);
  for (int t = 1; t <= 3; ++t) {
    set_gradients(model, t);
    set_gradients(reference, t);
    for (std::size_t k = 0; k < h.grad.size(); ++k)  // in place: the table points into them
      std::copy_n(reference.ps[k].grad.data(), h.grad[k].size(), h.grad[k].begin());
    opt.step(o.lr);
    const ops::AdamWScalars<float> s{float(o.lr), float(o.beta1), float(o.beta2), float(o.eps), float(o.weight_decay),
                                     float(1 - std::pow(o.beta1, t)), float(1 - std::pow(o.beta2, t)), 1.0f};
    Cpu::for_each(static_cast<std::int64_t>(h.blocks.size()) * ops::kAdamWBlock,
                  ops::AdamWMultiStep<float, bf16>{h.table.data(), h.blocks.data(), s, 0, 0, false});
    for (std::size_t k = 0; k < model.ps.size(); ++k) {
      CAPTURE(k);
      CHECK(values(model.ps[k].value) == h.param[k]);
    }
  }
  // fp64 arithmetic has no bf16 moments; float64 moments are not offered.
  using DoubleAdamW = AdamW<double, Cpu>;
  using FloatAdamW = AdamW<float, Cpu>;
  OneParam d;
  CHECK_THROWS_WITH_AS(DoubleAdamW(d, o),
                       doctest::Contains("AdamW: bfloat16 moments need a float32 or bfloat16 model"), Error);
  o.state_dtype = DType::f64;
  CHECK_THROWS_WITH_AS(FloatAdamW(model, o),
                       doctest::Contains("AdamW: state_dtype float64: the moments are stored as float32 or bfloat16"),
                       Error);
}
