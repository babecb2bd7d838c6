// The CPU backend on bf16 tensors. GEMM: operands widened to float, the product in
// float, C written as bf16 (rounded once) or as float (a weight gradient accumulated in
// fp32), and the GEMM reading C apart from the D it writes (float, double and bf16).
// Attention: bf16 q, k, v, o and gradients, fp32 log-sum-exp and row statistics.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "../support/errors.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace test_cpu_bf16 {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {
Tensor<float> values(Shape shape, float phase) {
  Tensor<float> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = round_to_bf16(std::sin(0.7f * float(i) + phase) * 2.0f);
  return t;
}
Tensor<bf16> to_bf16(const Tensor<float>& t) {
  Tensor<bf16> r(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = bf16(t[i]);
  return r;
}
}  // namespace

TEST_CASE("Cpu::gemm on bf16 operands is the float GEMM of their values, into bf16 or float") {
  const Trans kTrans[] = {Trans::no, Trans::yes};
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      for (float beta : {0.0f, 1.0f}) {
        CAPTURE(int(ta));
        CAPTURE(int(tb));
        CAPTURE(beta);
        const std::int64_t m = 7, n = 5, k = 9;
        // Stores one column wider than the views: strided operands.
        const Tensor<float> a = values(ta == Trans::no ? Shape{m, k + 1} : Shape{k, m + 1}, 0.1f);
        const Tensor<float> b = values(tb == Trans::no ? Shape{k, n + 1} : Shape{n, k + 1}, 0.2f);
        const Tensor<float> c = values(Shape{m, n + 1}, 0.3f);
        const Tensor<bf16> ab = to_bf16(a), bb = to_bf16(b), cb = to_bf16(c);
        auto cols = [](const auto& t) { return t.size(1) - 1; };
        const auto av = a.cview().slice_cols(0, cols(a));
        const auto bv = b.cview().slice_cols(0, cols(b));
        const auto abv = ab.cview().slice_cols(0, cols(ab));
        const auto bbv = bb.cview().slice_cols(0, cols(bb));

        Tensor<float> expected = c.clone();
        Cpu::gemm(ta, tb, 0.5f, av, bv, beta, expected.view().slice_cols(0, n));

        Tensor<float> into_float = c.clone();  // bf16 operands, fp32 C: exactly the float GEMM
        Cpu::gemm(ta, tb, 0.5f, abv, bbv, beta, into_float.view().slice_cols(0, n));
        Tensor<bf16> into_bf16 = cb.clone();  // bf16 C: the float result rounded once
        Cpu::gemm(ta, tb, 0.5f, abv, bbv, beta, into_bf16.view().slice_cols(0, n));
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j <= n; ++j) {
            const std::int64_t e = i * (n + 1) + j;
            if (j < n) {
              CHECK(into_float[e] == expected[e]);
              CHECK(static_cast<float>(into_bf16[e]) == round_to_bf16(expected[e]));
            } else {  // outside the view: untouched
              CHECK(into_float[e] == c[e]);
              CHECK(into_bf16[e].bits == cb[e].bits);
            }
          }
      }
}

TEST_CASE("Cpu::gemm in bf16 with beta zero ignores what C held, and with k == 0 scales C") {
  const Tensor<bf16> a = to_bf16(values(Shape{3, 4}, 0.4f)), b = to_bf16(values(Shape{4, 2}, 0.5f));
  Tensor<bf16> c(Shape{3, 2});
  for (std::int64_t i = 0; i < c.numel(); ++i) c[i] = bf16(std::numeric_limits<float>::quiet_NaN());
  Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 0.0f, c.view());
  for (std::int64_t i = 0; i < c.numel(); ++i) CHECK(!std::isnan(static_cast<float>(c[i])));

  const Tensor<bf16> empty_a(Shape{3, 0}), empty_b(Shape{0, 2});
  Tensor<float> g(Shape{3, 2});
  for (std::int64_t i = 0; i < g.numel(); ++i) g[i] = float(i) + 0.5f;
  Cpu::gemm(Trans::no, Trans::no, 1.0f, empty_a.cview(), empty_b.cview(), 2.0f, g.view());
  for (std::int64_t i = 0; i < g.numel(); ++i) CHECK(g[i] == 2.0f * (float(i) + 0.5f));
}

/// A backend with Cpu's in-place gemm only: gemm_out_of_place's fallback.
struct InPlaceGemmCpu : Cpu {
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<C> c) {
    Cpu::gemm(ta, tb, alpha, a, b, beta, c);
  }
};
static_assert(HasOutOfPlaceGemm<Cpu> && !HasOutOfPlaceGemm<InPlaceGemmCpu>);

TEST_CASE("Cpu::gemm reading C apart from D: the product rounded to D's type, then beta C added, C unchanged") {
  // As cuBLASLt with a bf16 C (tests/gpu's product_term), and as the product followed by
  // ops::Axpy: a residual added in the GEMM is bitwise the GEMM then the add, in float,
  // double and bf16, and a backend without the out-of-place gemm gives the same.
  const Trans kTrans[] = {Trans::no, Trans::yes};
  auto check = [&]<class T, class C>(std::type_identity<T>, std::type_identity<C>) {
    for (Trans ta : kTrans)
      for (Trans tb : kTrans)
        for (float beta : {1.0f, -0.75f, 0.0f}) {
          CAPTURE(int(ta));
          CAPTURE(int(tb));
          CAPTURE(beta);
          const std::int64_t m = 6, n = 5, k = 11;
          auto cast = [](const Tensor<float>& t) {
            Tensor<T> r(t.shape());
            for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = T(t[i]);
            return r;
          };
          auto cast_c = [](const Tensor<float>& t) {
            Tensor<C> r(t.shape());
            for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = C(t[i]);
            return r;
          };
          const Tensor<T> a = cast(values(ta == Trans::no ? Shape{m, k} : Shape{k, m}, 0.1f));
          const Tensor<T> b = cast(values(tb == Trans::no ? Shape{k, n} : Shape{n, k}, 0.2f));
          const Tensor<C> c = cast_c(values(Shape{m, n}, 0.3f));
          const Tensor<C> c_before = c.clone();
          Tensor<C> expected(Shape{m, n});
          Cpu::gemm(ta, tb, accum_t<T>(0.5f), a.cview(), b.cview(), accum_t<T>(0), expected.view());
          if (beta != 0.0f)
            Cpu::for_each(expected.numel(), ops::Axpy<C>{accum_t<C>(beta), c.data(), expected.data()});
          Tensor<C> d(Shape{m, n}), fallback(Shape{m, n});
          Cpu::gemm(ta, tb, accum_t<T>(0.5f), a.cview(), b.cview(), accum_t<T>(beta), c.cview(), d.view());
          gemm_out_of_place<InPlaceGemmCpu>(ta, tb, accum_t<T>(0.5f), a.cview(), b.cview(), accum_t<T>(beta),
                                            c.cview(), fallback.view());
          for (std::int64_t i = 0; i < d.numel(); ++i) {
            CHECK(std::memcmp(&d[i], &expected[i], sizeof(C)) == 0);
            CHECK(std::memcmp(&fallback[i], &expected[i], sizeof(C)) == 0);
            CHECK(std::memcmp(&c[i], &c_before[i], sizeof(C)) == 0);
          }
        }
  };
  check(std::type_identity<float>{}, std::type_identity<float>{});
  check(std::type_identity<double>{}, std::type_identity<double>{});
  check(std::type_identity<bf16>{}, std::type_identity<bf16>{});
  check(std::type_identity<bf16>{}, std::type_identity<float>{});
}

TEST_CASE("Cpu::gemm reading C apart: C where D is runs in place, k == 0 gives beta C, and a C unlike D is refused") {
  const Tensor<float> a = values(Shape{4, 3}, 0.4f), b = values(Shape{3, 2}, 0.5f);
  Tensor<float> c = values(Shape{4, 2}, 0.6f), in_place = c.clone();
  Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 1.0f, in_place.view());
  Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 1.0f, c.cview(), c.view());
  for (std::int64_t i = 0; i < c.numel(); ++i) CHECK(c[i] == in_place[i]);

  const Tensor<float> empty_a(Shape{4, 0}), empty_b(Shape{0, 2});
  const Tensor<float> c0 = values(Shape{4, 2}, 0.7f);
  Tensor<float> d(Shape{4, 2});
  Cpu::gemm(Trans::no, Trans::no, 1.0f, empty_a.cview(), empty_b.cview(), 2.0f, c0.cview(), d.view());
  for (std::int64_t i = 0; i < d.numel(); ++i) CHECK(d[i] == 2.0f * c0[i]);

  const Tensor<float> wide = values(Shape{4, 3}, 0.8f);
  CHECK_THROWS_WITH_AS(Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 1.0f, wide.cview(), d.view()),
                       doctest::Contains("gemm: C read apart from D needs D's shape and leading dimension: C 4x3"),
                       Error);
  CHECK_THROWS_WITH_AS(Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 1.0f,
                                 wide.cview().slice_cols(0, 2), d.view()),
                       doctest::Contains("C 4x2 (leading dimension 3), D 4x2 (2)"), Error);
}

TEST_CASE("Cpu attention on bf16 tensors follows the float attention of the same values") {
  AttentionShape s;
  s.batch = 2;
  s.seq_len = 19;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 16;
  const Shape qs{s.batch * s.seq_len, s.n_heads * s.head_dim}, ks{s.batch * s.seq_len, s.n_kv_heads * s.head_dim};
  const Tensor<float> q = values(qs, 0.6f), k = values(ks, 0.7f), v = values(ks, 0.8f), d_o = values(qs, 0.9f);
  const Tensor<bf16> qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), dob = to_bf16(d_o);

  Tensor<float> o(qs), lse(Shape{s.batch, s.n_heads, s.seq_len});
  Cpu::attention_forward<float>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  Tensor<bf16> ob(qs);
  Tensor<float> lseb(Shape{s.batch, s.n_heads, s.seq_len});
  Cpu::attention_forward<bf16>(s, qb.cview(), kb.cview(), vb.cview(), ob.view(), lseb.data());
  // The scores are rounded to bf16 (|score| < 2 * 2 * 16 = 64, so by at most 2^-3 before
  // the 1/4 scale: 1/32 in a logit), and so are the probabilities (2^-9 relative):
  // lse moves by at most 1/32, o (a convex combination of values in [-2, 2]) by a few
  // hundredths.
  for (std::int64_t i = 0; i < lse.numel(); ++i) CHECK(std::fabs(lseb[i] - lse[i]) <= 1.0f / 32);
  for (std::int64_t i = 0; i < o.numel(); ++i) CHECK(std::fabs(static_cast<float>(ob[i]) - o[i]) <= 0.06f);

  Tensor<float> dq(qs), dk(ks), dv(ks);
  Cpu::attention_backward<float>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(), dq.view(),
                                 dk.view(), dv.view());
  Tensor<bf16> dqb(qs), dkb(ks), dvb(ks);
  Cpu::attention_backward<bf16>(s, qb.cview(), kb.cview(), vb.cview(), ob.cview(), lseb.data(), dob.cview(),
                                dqb.view(), dkb.view(), dvb.view());
  // Gradients: dP and the statistics stay fp32, P and dS are rounded once to bf16, but
  // the bf16 o (itself within the forward's bound) enters D = rowsum(dO o), and dk, dv
  // are summed over the group's heads in bf16. Measured worst: 3.0% of the largest float
  // gradient (dk), 2.4% (dq), 0.4% (dv); bound 5%. (With dP rounded to bf16 before
  // dP - D, as a plain bf16 implementation would, dk was off by 6.3%.)
  auto max_abs = [](const Tensor<float>& t) {
    float m = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t[i]));
    return m;
  };
  for (auto [got, want] : {std::pair{&dqb, &dq}, std::pair{&dkb, &dk}, std::pair{&dvb, &dv}}) {
    const float bound = 0.05f * max_abs(*want);
    int bad = 0;
    float worst = 0;
    for (std::int64_t i = 0; i < want->numel(); ++i) {
      bad += std::fabs(static_cast<float>((*got)[i]) - (*want)[i]) > bound;
      worst = std::max(worst, std::fabs(static_cast<float>((*got)[i]) - (*want)[i]) / max_abs(*want));
    }
    CAPTURE(worst);
    CHECK(bad == 0);
  }
}

}  // namespace test_cpu_bf16
