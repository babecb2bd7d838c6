// The ops functors and the CPU backend's GEMM and attention against plain reference loops.
#include <doctest/doctest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "../support/gradcheck.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/ops/ops.hpp"

using namespace tessera;
using tessera::testing::fill_normal;

TEST_CASE("RoPE frequencies: plain and Llama 3.1 scaled") {
  nn::RopeScaling none;
  auto f = ops::rope_inv_freq(8, 10000.0, none);
  REQUIRE(f.size() == 4);
  CHECK(f[0] == 1.0);
  CHECK(f[1] == doctest::Approx(std::pow(10000.0, -0.25)));
  // Llama 3.1 (factor 8, low 1, high 4, original 8192) on head_dim 128, theta 500000:
  // the highest frequencies stay, the lowest are divided by 8, the middle band blends.
  nn::RopeScaling s{true, 8.0, 1.0, 4.0, 8192};
  auto plain = ops::rope_inv_freq(128, 500000.0, none);
  auto scaled = ops::rope_inv_freq(128, 500000.0, s);
  CHECK(scaled[0] == plain[0]);
  CHECK(scaled[63] == doctest::Approx(plain[63] / 8));
  int blended = 0;
  for (std::size_t i = 0; i < 64; ++i) {
    const double wavelen = 2 * M_PI / plain[i];
    if (wavelen < 8192 / 4.0) CHECK(scaled[i] == plain[i]);
    else if (wavelen > 8192 / 1.0) CHECK(scaled[i] == doctest::Approx(plain[i] / 8));
    else {
      ++blended;
      CHECK(scaled[i] < plain[i]);
      CHECK(scaled[i] > plain[i] / 8);
    }
  }
  CHECK(blended > 0);
}

TEST_CASE("RoPE rotation keeps norms, pairs i with i + d/2, and its inverse undoes it") {
  const std::int64_t heads = 2, hd = 8, seq = 5, rows = 10;
  auto inv = ops::rope_inv_freq(hd, 10000.0, {});
  std::vector<double> cs(seq * hd / 2), sn(seq * hd / 2);
  for (std::int64_t p = 0; p < seq; ++p)
    for (std::int64_t i = 0; i < hd / 2; ++i) cs[p * hd / 2 + i] = std::cos(p * inv[i]), sn[p * hd / 2 + i] = std::sin(p * inv[i]);
  Tensor<double> x(Shape{rows, heads * hd});
  fill_normal(x, 1, "x");
  Tensor<double> y = x.clone();
  Cpu::for_each(rows, ops::RopeRotate<double>{y.data(), heads * hd, heads, hd, seq, cs.data(), sn.data(), false});
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t pos = r % seq;
    for (std::int64_t h = 0; h < heads; ++h) {
      const double* a = x.data() + r * heads * hd + h * hd;
      const double* b = y.data() + r * heads * hd + h * hd;
      // Hugging Face: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
      for (std::int64_t i = 0; i < hd / 2; ++i) {
        const double c = std::cos(pos * inv[i]), s = std::sin(pos * inv[i]);
        CHECK(b[i] == doctest::Approx(a[i] * c - a[i + hd / 2] * s));
        CHECK(b[i + hd / 2] == doctest::Approx(a[i + hd / 2] * c + a[i] * s));
      }
    }
  }
  Cpu::for_each(rows, ops::RopeRotate<double>{y.data(), heads * hd, heads, hd, seq, cs.data(), sn.data(), true});
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(y[i] == doctest::Approx(x[i]).epsilon(1e-12));
}

TEST_CASE("Cross-entropy row: loss is lse - z_t and the gradient is softmax - onehot") {
  std::vector<double> z = {1.0, 2.0, -1.0, 0.5, 3.0, 3.0, 3.0, 3.0};
  std::vector<std::int32_t> t = {1, ops::kIgnoreIndex};
  std::vector<double> loss(2);
  Cpu::for_each(2, ops::CrossEntropyRow<double>{z.data(), 4, 4, t.data(), 0.5, true, loss.data()});
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(-1.0) + std::exp(0.5));
  CHECK(loss[0] == doctest::Approx(lse - 2.0));
  CHECK(loss[1] == 0.0);
  CHECK(z[0] == doctest::Approx(0.5 * std::exp(1.0 - lse)));
  CHECK(z[1] == doctest::Approx(0.5 * (std::exp(2.0 - lse) - 1)));
  double sum = 0;
  for (int j = 0; j < 4; ++j) sum += z[j];
  CHECK(sum == doctest::Approx(0.0).epsilon(1e-15));
  for (int j = 4; j < 8; ++j) CHECK(z[j] == 0.0);
  // Huge logits do not overflow.
  std::vector<float> big = {1000.f, 0.f};
  std::vector<std::int32_t> t0 = {0};
  std::vector<double> l0(1);
  ops::CrossEntropyRow<float>{big.data(), 2, 2, t0.data(), 1.f, false, l0.data()}(0);
  CHECK(l0[0] == doctest::Approx(0.0));
}

TEST_CASE("SwiGLU and RMSNorm forward values") {
  double a = 1.5, b = -2.0, g = 0;
  ops::SwiGluForward<double>{&a, &b, &g}(0);
  CHECK(g == doctest::Approx(1.5 / (1 + std::exp(-1.5)) * -2.0));
  std::vector<double> x = {3, 4}, w = {1, 2}, y(2), rstd(1);
  ops::RmsNormForward<double>{x.data(), 2, w.data(), y.data(), 2, rstd.data(), 2, 0.0}(0);
  CHECK(rstd[0] == doctest::Approx(1 / std::sqrt(12.5)));
  CHECK(y[1] == doctest::Approx(8 / std::sqrt(12.5)));
}

TEST_CASE("GEMM with transposes and strided operands matches a reference loop") {
  Tensor<double> a(Shape{5, 7}), b(Shape{4, 5}), c(Shape{7, 8});
  fill_normal(a, 1, "a");
  fill_normal(b, 2, "b");
  fill_normal(c, 3, "c");
  Tensor<double> ref = c.clone();
  // C[:, 2:6] = 2 * A^T B^T + 0.5 * C[:, 2:6]
  auto cv = c.view().slice_cols(2, 6);
  Cpu::gemm(Trans::yes, Trans::yes, 2.0, a.cview(), b.cview(), 0.5, cv);
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 8; ++j) {
      double expect = ref[i * 8 + j];
      if (j >= 2 && j < 6) {
        double s = 0;
        for (int k = 0; k < 5; ++k) s += a[k * 7 + i] * b[(j - 2) * 5 + k];
        expect = 2 * s + 0.5 * expect;
      }
      CHECK(c[i * 8 + j] == doctest::Approx(expect).epsilon(1e-12));
    }
  CHECK_THROWS_WITH_AS(Cpu::gemm(Trans::no, Trans::no, 1.0, a.cview(), b.cview(), 0.0, c.view()),
                       doctest::Contains("do not chain"), Error);
}

TEST_CASE("CPU attention matches a naive causal grouped-query reference") {
  // 6 rows: one partial block; 150 rows: two whole blocks of 64 and a partial one.
  for (std::int64_t t : {6, 150}) {
    CAPTURE(t);
    const std::int64_t hd = 3, rows = 2 * t;
    AttentionShape s{2, t, 4, 2, hd};
    Tensor<double> q(Shape{rows, 4 * hd}), k(Shape{rows, 2 * hd}), v(Shape{rows, 2 * hd}), o(Shape{rows, 4 * hd}),
        lse(Shape{2, 4, t});
    fill_normal(q, 1, "q");
    fill_normal(k, 2, "k");
    fill_normal(v, 3, "v");
    Cpu::attention_forward(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
    const double scale = 1 / std::sqrt(double(hd));
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t i = 0; i < t; ++i) {
          const std::int64_t kvh = h / 2;
          std::vector<double> p(i + 1);
          double m = -1e300, sum = 0;
          for (std::int64_t j = 0; j <= i; ++j) {
            double d = 0;
            for (std::int64_t e = 0; e < hd; ++e) d += q.view()(b * t + i, h * hd + e) * k.view()(b * t + j, kvh * hd + e);
            p[j] = d * scale;
            m = std::max(m, p[j]);
          }
          for (std::int64_t j = 0; j <= i; ++j) sum += p[j] = std::exp(p[j] - m);
          REQUIRE(lse[(b * 4 + h) * t + i] == doctest::Approx(m + std::log(sum)));
          for (std::int64_t e = 0; e < hd; ++e) {
            double out = 0;
            for (std::int64_t j = 0; j <= i; ++j) out += p[j] / sum * v.view()(b * t + j, kvh * hd + e);
            REQUIRE(o.view()(b * t + i, h * hd + e) == doctest::Approx(out).epsilon(1e-12));
          }
        }
  }
}

TEST_CASE("CPU attention backward across several query blocks matches finite differences") {
  const std::int64_t t = 150, hd = 4, rows = t;
  AttentionShape s{1, t, 2, 1, hd};
  Tensor<double> q(Shape{rows, 2 * hd}), k(Shape{rows, hd}), v(Shape{rows, hd}), c(Shape{rows, 2 * hd});
  fill_normal(q, 4, "q");
  fill_normal(k, 5, "k");
  fill_normal(v, 6, "v");
  fill_normal(c, 7, "c");
  auto f = [&] {
    Tensor<double> o(Shape{rows, 2 * hd}), lse(Shape{1, 2, t});
    Cpu::attention_forward(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
    double sum = 0;
    for (std::int64_t i = 0; i < o.numel(); ++i) sum += c[i] * o[i];
    return sum;
  };
  Tensor<double> o(Shape{rows, 2 * hd}), lse(Shape{1, 2, t});
  Cpu::attention_forward(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  Tensor<double> dq(q.shape()), dk(k.shape()), dv(v.shape());
  Cpu::attention_backward(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), c.cview(), dq.view(), dk.view(),
                          dv.view());
  // Spot checks spread over every block, first and last rows included.
  for (auto [x, g, name] : {std::tuple{&q, &dq, "dq"}, std::tuple{&k, &dk, "dk"}, std::tuple{&v, &dv, "dv"}}) {
    for (std::int64_t idx : {std::int64_t{0}, x->numel() / 7, x->numel() / 2, 3 * x->numel() / 5, x->numel() - 1}) {
      const double saved = (*x)[idx], h = 1e-5;
      (*x)[idx] = saved + h;
      const double fp = f();
      (*x)[idx] = saved - h;
      const double fm = f();
      (*x)[idx] = saved;
      CAPTURE(name);
      CAPTURE(idx);
      CHECK((*g)[idx] == doctest::Approx((fp - fm) / (2 * h)).epsilon(1e-6));
    }
  }
}

TEST_CASE("Squared-norm partials do not depend on the chunking") {
  std::vector<float> x(1000);
  for (int i = 0; i < 1000; ++i) x[i] = static_cast<float>(i % 10) * 0.1f;
  std::vector<double> p(10);
  Cpu::for_each(10, ops::SquaredNormPartial<float>{x.data(), 1000, 100, p.data()});
  double s = 0, ref = 0;
  for (double v : p) s += v;
  for (float v : x) ref += double(v) * v;
  CHECK(s == doctest::Approx(ref).epsilon(1e-14));
}

TEST_CASE("The vectorisable float exp is within one ulp on [-87.3, 0]") {
  double worst = 0;
  for (float x = -87.3f; x <= 0.0f; x += 0.000731f) {
    const double exact = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(static_cast<double>(ops::exp_poly(x)) - exact) / exact);
  }
  CHECK(worst < 0x1p-23);
  CHECK(ops::exp_poly(0.0f) == 1.0f);
  CHECK(ops::exp_poly(-1.0f) == doctest::Approx(std::exp(-1.0)).epsilon(1e-7));
  CHECK(std::isnan(ops::exp_poly(std::nanf(""))));
  CHECK(ops::exp_poly(-1000.0f) <= 1.2e-38f);
  CHECK(ops::exp_poly(-1000.0f) >= 0.0f);
  CHECK(ops::exp_nonpositive(-2.0) == std::exp(-2.0));  // double keeps std::exp
}
