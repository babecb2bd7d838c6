// The ops functors and the CPU backend's GEMM and attention against plain reference loops.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../support/documents.hpp"
#include "../support/gradcheck.hpp"
#include "../support/naive_attention.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/ops.hpp"
#include "tessera/ops/ragged_documents.hpp"

namespace test_ops {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using tessera::testing::fill_normal;

TEST_CASE("RoPE frequencies: plain and Llama 3.1 scaled") {
  ops::RopeScaling none;
  auto f = ops::rope_inv_freq(8, 10000.0, none);
  REQUIRE(f.size() == 4);
  CHECK(f[0] == 1.0);
  CHECK(f[1] == doctest::Approx(std::pow(10000.0, -0.25)));
  // Llama 3.1 (factor 8, low 1, high 4, original 8192) on head_dim 128, theta 500000:
  // the highest frequencies stay, the lowest are divided by 8, the middle band blends.
  ops::RopeScaling s{true, 8.0, 1.0, 4.0, 8192};
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

TEST_CASE("Cross-entropy row into a bf16 gradient: bit for bit the in-place gradient rounded to bf16") {
  // float logits, a padded leading dimension, a row without a target and a target at
  // each end of its row; the separate gradient has its own leading dimension.
  const std::int64_t rows = 4, vocab = 37, ld = 40, gld = 48;
  std::vector<float> z(static_cast<std::size_t>(rows * ld));
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)) * 9);
  const std::vector<std::int32_t> t = {0, ops::kIgnoreIndex, 36, 11};
  for (bool write_grad : {true, false}) {
    CAPTURE(write_grad);
    std::vector<float> in_place = z, read_only = z;
    std::vector<double> loss(rows, -1), loss_to(rows, -1);
    const bf16 sentinel = from_accum<bf16>(123.0f);
    std::vector<bf16> grad(static_cast<std::size_t>(rows * gld), sentinel);
    Cpu::for_each(rows, ops::CrossEntropyRow<float>{in_place.data(), ld, vocab, t.data(), 0.25f, write_grad, loss.data()});
    Cpu::for_each(rows, ops::CrossEntropyRow<float, bf16>{read_only.data(), ld, vocab, t.data(), 0.25f, write_grad,
                                                          loss_to.data(), grad.data(), gld});
    CHECK(loss_to == loss);
    CHECK(read_only == z);  // the logits are only read
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < gld; ++j) {
        const bf16 got = grad[static_cast<std::size_t>(r * gld + j)];
        const bf16 want = j < vocab && write_grad ? from_accum<bf16>(in_place[static_cast<std::size_t>(r * ld + j)])
                                                  : sentinel;  // past the row, or no gradient: untouched
        CHECK(got.bits == want.bits);
      }
  }
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

TEST_CASE("GEMM of one row (a decoded token's) is the reference loop's: every transpose, strided, beta 0 over NaN") {
  const std::int64_t k = 6, n = 5;
  for (const Trans ta : {Trans::no, Trans::yes})
    for (const Trans tb : {Trans::no, Trans::yes}) {
      CAPTURE(static_cast<int>(ta));
      CAPTURE(static_cast<int>(tb));
      // A and B as columns of wider matrices: leading dimensions past their widths.
      Tensor<double> row_a(Shape{2, k + 2}), wide_a(Shape{k, 3}), wide_b(Shape{k, n + 2});
      fill_normal(row_a, 3, "a row");
      fill_normal(wide_a, 4, "a");
      fill_normal(wide_b, 5, "b");
      const TensorView<const double> a = ta == Trans::no ? row_a.cview().slice_rows(1, 2).slice_cols(1, k + 1)
                                                         : wide_a.cview().slice_cols(1, 2);
      Tensor<double> b_nk(Shape{n, k + 1});
      fill_normal(b_nk, 6, "bt");
      const TensorView<const double> b = tb == Trans::no ? wide_b.cview().slice_cols(1, n + 1)
                                                         : b_nk.cview().slice_cols(0, k);
      const auto op_a = [&](std::int64_t i) { return ta == Trans::no ? a(0, i) : a(i, 0); };
      const auto op_b = [&](std::int64_t i, std::int64_t j) { return tb == Trans::no ? b(i, j) : b(j, i); };
      for (const double beta : {0.0, 0.5}) {
        Tensor<double> c(Shape{1, n});
        for (std::int64_t j = 0; j < n; ++j) c[j] = beta == 0 ? std::nan("") : double(j);
        Cpu::gemm(ta, tb, 2.0, a, b, beta, c.view());
        for (std::int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (std::int64_t i = 0; i < k; ++i) want += op_a(i) * op_b(i, j);
          want = 2 * want + (beta == 0 ? 0.0 : beta * double(j));
          CHECK(c[j] == doctest::Approx(want).epsilon(1e-12));
        }
      }
    }
}

TEST_CASE("CPU attention after a KV cache's keys gives the whole sequence's last rows") {
  // 70 rows: a block of 64 and a partial one; the cache holds all but the last 5, or 1.
  const std::int64_t t = 70, hd = 3;
  AttentionShape whole{1, t, 4, 2, hd};
  Tensor<double> q(Shape{t, 4 * hd}), k(Shape{t, 2 * hd}), v(Shape{t, 2 * hd}), o(Shape{t, 4 * hd}),
      lse(Shape{1, 4, t});
  fill_normal(q, 7, "q");
  fill_normal(k, 8, "k");
  fill_normal(v, 9, "v");
  Cpu::attention_forward(whole, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  for (const std::int64_t fresh : {5, 1}) {
    CAPTURE(fresh);
    AttentionShape s = whole;
    s.seq_len = fresh;
    s.past = t - fresh;
    CHECK(s.key_len() == t);
    CHECK(s.pairs() == doctest::Approx(4.0 * (fresh * (fresh + 1) / 2 + fresh * (t - fresh))));
    Tensor<double> o_new(Shape{fresh, 4 * hd}), lse_new(Shape{1, 4, fresh});
    Cpu::attention_forward(s, q.cview().slice_rows(t - fresh, t), k.cview(), v.cview(), o_new.view(), lse_new.data());
    for (std::int64_t r = 0; r < fresh; ++r)
      for (std::int64_t h = 0; h < 4; ++h) {
        CHECK(lse_new[h * fresh + r] == doctest::Approx(lse[h * t + t - fresh + r]).epsilon(1e-12));
        for (std::int64_t e = 0; e < hd; ++e)
          CHECK(o_new.view()(r, h * hd + e) == doctest::Approx(o.view()(t - fresh + r, h * hd + e)).epsilon(1e-12));
      }
  }
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

namespace {

std::vector<double> dense(const Tensor<double>& t) { return std::vector<double>(t.data(), t.data() + t.numel()); }

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // infinities too: the -inf lse of a row that sees no key
    diff = std::max(diff, std::isnan(a[i]) ? HUGE_VAL : std::abs(a[i] - b[i]));
    if (std::isfinite(b[i])) ref = std::max(ref, std::abs(b[i]));
  }
  return diff == 0 ? 0 : diff / ref;
}

/// Cpu's attention forward and backward on `s` (q heads 4, whatever kv heads) against the
/// naive reference in double (1e-12: o, lse, dq, dk, dv), and that reference far from
/// `other`'s (the inputs tell the two masks apart).
void check_cpu_attention(const AttentionShape& s, const AttentionShape& other) {
  const std::int64_t rows = s.batch * s.seq_len, hd = s.head_dim, kv = s.n_kv_heads;
  Tensor<double> q(Shape{rows, 4 * hd}), k(Shape{rows, kv * hd}), v(Shape{rows, kv * hd}), d_o(Shape{rows, 4 * hd});
  fill_normal(q, 8, "q");
  fill_normal(k, 9, "k");
  fill_normal(v, 10, "v");
  fill_normal(d_o, 11, "dO");
  Tensor<double> o(q.shape()), lse(Shape{s.batch, 4, s.seq_len}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Cpu::attention_forward(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  Cpu::attention_backward(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(), dq.view(),
                          dk.view(), dv.view());
  const auto ref = testing::naive_attention(s, dense(q), dense(k), dense(v), dense(d_o));
  CHECK(max_rel_diff(dense(o), ref.o) < 1e-12);
  CHECK(max_rel_diff(dense(lse), ref.lse) < 1e-12);
  CHECK(max_rel_diff(dense(dq), ref.dq) < 1e-12);
  CHECK(max_rel_diff(dense(dk), ref.dk) < 1e-12);
  CHECK(max_rel_diff(dense(dv), ref.dv) < 1e-12);
  const auto wrong = testing::naive_attention(other, dense(q), dense(k), dense(v), dense(d_o));
  CHECK(max_rel_diff(wrong.o, ref.o) > 1e-2);
  CHECK(max_rel_diff(wrong.dq, ref.dq) > 1e-2);
  CHECK(max_rel_diff(wrong.dk, ref.dk) > 1e-2);
}

}  // namespace

TEST_CASE("CPU attention, causal and full, matches a naive reference in double: o, lse, dq, dk, dv") {
  // 150 rows: two whole blocks of 64 and a partial one (full attention gives every
  // block every key); groups of 2 and 4 q heads per kv head and heads of their own.
  for (bool causal : {true, false})
    for (std::int64_t kv : {1, 2, 4}) {
      CAPTURE(causal);
      CAPTURE(kv);
      const AttentionShape s{2, 150, 4, kv, 8, causal};
      AttentionShape other = s;
      other.causal = !causal;
      check_cpu_attention(s, other);
    }
}

TEST_CASE("document spans: a document starts at each BOS and at each sequence's first token") {
  // Two sequences of 6: [x B x x B x] and [B x x x x x].
  const std::vector<std::int32_t> ids = {5, 1, 7, 8, 1, 9, 1, 2, 3, 4, 5, 6};
  const auto spans = ops::document_spans(ids, 2, 6, 1);
  const std::vector<ops::DocumentSpan> want = {{0, 1}, {1, 4}, {1, 4}, {1, 4}, {4, 6}, {4, 6},
                                               {0, 6}, {0, 6}, {0, 6}, {0, 6}, {0, 6}, {0, 6}};
  CHECK(spans == want);
  // Positions restart at each document: RoPE's rows read them through RowPositions.
  const ops::RowPositions pos(2, 6, ops::ContextShard{}, spans.data());
  const std::vector<std::int64_t> want_pos = {0, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5};
  for (std::int64_t r = 0; r < 12; ++r) CHECK(pos(r) == want_pos[static_cast<std::size_t>(r)]);
  CHECK_THROWS_WITH_AS(ops::document_spans(ids, 2, 5, 1), doctest::Contains("12 ids for a batch of 2 x 5"), Error);
}

TEST_CASE("CPU attention over packed documents matches a naive masked reference in double") {
  // 150 rows a sequence: documents that start mid-block, on a block's first row (64),
  // one token long, and one that spans two blocks; the second sequence is one document.
  const std::int64_t t = 150;
  const std::vector<ops::DocumentSpan> spans = testing::spans_starting_at(2, t, {10, 64, 65, 66, 140});
  for (std::int64_t kv : {1, 4}) {
    CAPTURE(kv);
    const AttentionShape s{2, t, 4, kv, 8, true, spans.data()};
    AttentionShape whole = s;  // the documents matter: without them the reference is far
    whole.documents = nullptr;
    check_cpu_attention(s, whole);
  }
}

TEST_CASE("a ring block's document bounds: each query's first key and each key's last query, as the whole mask") {
  // Sequences of 24 in 4 chunks of 6: documents starting mid-chunk, on a chunk's first
  // position (6, 18), one token long (6), and one spanning two chunks; the second
  // sequence is one document.
  const std::int64_t S = 24, c = 6;
  const auto spans = testing::spans_starting_at(2, S, {3, 6, 7, 18, 22});
  auto doc = [&](std::int64_t b, std::int64_t p) { return spans[static_cast<std::size_t>(b * S + p)]; };
  for (std::int64_t qc = 0; qc < 4; ++qc)
    for (std::int64_t kc = 0; kc <= qc; ++kc) {
      CAPTURE(qc);
      CAPTURE(kc);
      const auto bounds = testing::ring_block_bounds(spans, 2, S, c, qc, kc);
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t r = 0; r < c; ++r) {
          // Row r as a query: the first key of the block in its document (c: none); as a
          // key: one past the last query of the block in its document (0: none).
          std::int64_t first_key = c, query_end = 0;
          for (std::int64_t j = c - 1; j >= 0; --j)
            if (doc(b, kc * c + j) == doc(b, qc * c + r)) first_key = j;
          for (std::int64_t i = 0; i < c; ++i)
            if (doc(b, qc * c + i) == doc(b, kc * c + r)) query_end = i + 1;
          const ops::DocumentSpan got = bounds[static_cast<std::size_t>(b * c + r)];
          CAPTURE(b);
          CAPTURE(r);
          CHECK(got.begin == first_key);
          CHECK(got.end == query_end);
        }
    }
}

TEST_CASE("CPU attention over a full ring block of packed documents: rows and whole blocks that see no key") {
  // Queries at positions 450..599 and keys at 0..149 of sequences of 600 (a CP 2 block
  // below the diagonal): the document from 100 to 470 reaches 20 queries, so the rest of
  // the first 64-row block and every later block see no key (lse -inf, o and dq zero).
  const std::int64_t S = 600, c = 150;
  const auto bounds = testing::ring_block_bounds(testing::spans_starting_at(2, S, {100, 470, 520}), 2, S, c, 3, 0);
  AttentionShape s{2, c, 4, 2, 8, false, bounds.data()};
  AttentionShape whole = s;  // without the bounds: every key
  whole.documents = nullptr;
  check_cpu_attention(s, whole);
}

TEST_CASE("a document table: each sequence's documents in order, power-of-two slots, empty spans past the last") {
  // Two sequences of 6: [x B x x B x] (3 documents) and [B x x x x x] (1).
  const std::vector<std::int32_t> ids = {5, 1, 7, 8, 1, 9, 1, 2, 3, 4, 5, 6};
  const auto spans = ops::document_spans(ids, 2, 6, 1);
  const ops::DocumentTable t = ops::document_table(spans, 2, 6);
  CHECK(t.slots == 4);
  const std::vector<ops::DocumentSpan> want = {{0, 1}, {1, 4}, {4, 6}, {6, 6}, {0, 6}, {6, 6}, {6, 6}, {6, 6}};
  CHECK(t.spans == want);
  // A table staged again keeps its slots; more documents than that grow them.
  CHECK(ops::document_table(spans, 2, 6, 8).slots == 8);
  CHECK(ops::document_table(spans, 2, 6, 3).slots == 4);
  CHECK(ops::document_table(std::span(spans).subspan(6), 1, 6).slots == 1);
  CHECK(ops::document_slots_for(0) == 1);
  CHECK(ops::document_slots_for(5) == 8);
  CHECK(ops::document_slots_for(64) == 64);
  // Spans that do not tile their sequence are refused, naming the sequence and the row.
  std::vector<ops::DocumentSpan> broken = spans;
  broken[4] = {3, 6};
  CHECK_THROWS_WITH_AS(ops::document_table(broken, 2, 6), doctest::Contains("sequence 0, row 4: span [3, 6)"), Error);
  CHECK_THROWS_WITH_AS(ops::document_table(spans, 3, 6), doctest::Contains("12 row spans for a batch of 3 x 6"), Error);
}

TEST_CASE("ragged offsets and lengths: each document's first row times each tensor's leading dimension") {
  const std::int64_t batch = 2, t = 150;
  const auto spans = testing::spans_starting_at(batch, t, {10, 64, 65, 66, 140});
  const ops::DocumentTable table = ops::document_table(spans, batch, t);
  REQUIRE(table.slots == 8);  // 6 documents in the first sequence
  const std::int64_t entries = batch * table.slots;
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(ops::kRaggedTensors * (entries + 1)), -1);
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(entries), -1);
  ops::RaggedOffsets f{table.spans.data(), entries, table.slots, t};
  const std::int64_t scale[ops::kRaggedTensors] = {256, 64, 72, 264, 256, 256, 64, 64, 4};
  std::copy(scale, scale + ops::kRaggedTensors, f.scale);
  f.offsets = offsets.data();
  f.lengths = lengths.data();
  Cpu::for_each(entries + 1, f);
  // The documents' first rows and lengths, by hand; the slots past a sequence's last
  // document are empty at its end.
  const std::vector<std::int64_t> first = {0, 10, 64, 65, 66, 140, 150, 150, 150, 300, 300, 300, 300, 300, 300, 300, 300};
  const std::vector<std::int32_t> length = {10, 54, 1, 1, 74, 10, 0, 0, 150, 0, 0, 0, 0, 0, 0, 0};
  CHECK(lengths == length);
  for (int k = 0; k < ops::kRaggedTensors; ++k)
    for (std::int64_t e = 0; e <= entries; ++e) {
      CAPTURE(k);
      CAPTURE(e);
      CHECK(offsets[static_cast<std::size_t>(k * (entries + 1) + e)] == first[static_cast<std::size_t>(e)] * scale[k]);
    }
}

TEST_CASE("the log-sum-exp moves between (batch, heads, seq) and token-major (rows, heads) and back") {
  const std::int64_t batch = 2, heads = 3, t = 5, n = batch * heads * t;
  std::vector<float> bht(static_cast<std::size_t>(n)), tokens(static_cast<std::size_t>(n), -1), back(bht.size(), -1);
  for (std::int64_t i = 0; i < n; ++i) bht[static_cast<std::size_t>(i)] = static_cast<float>(i);
  Cpu::for_each(n, ops::StatsLayout{bht.data(), tokens.data(), t, heads, true});
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t p = 0; p < t; ++p)
        CHECK(tokens[static_cast<std::size_t>((b * t + p) * heads + h)] == bht[static_cast<std::size_t>((b * heads + h) * t + p)]);
  Cpu::for_each(n, ops::StatsLayout{tokens.data(), back.data(), t, heads, false});
  CHECK(back == bht);
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

// ---------------------------------------------------------------------------------
// bf16 storage: every functor against its float instantiation on the same values.
//
// Inputs are drawn in float and rounded to bf16, so both runs see the same numbers, and
// the bf16 functor is meant to do the float functor's arithmetic and round each output
// once. Tolerances:
//   kRoundRel (2^-8), for a bf16 output against the float result: rounding to nearest
//     even moves a value by at most 2^-9 of its magnitude (8 significant bits); the
//     factor 2 leaves room for the float results to differ in their last bits. A bf16
//     intermediate (a product or partial sum rounded before the end) adds another error
//     of up to 2^-9 of that intermediate, which the cases below make visible.
//   kStatRel (1e-6), for statistics (rstd, max, sums, lse, D, losses) and gradients
//     accumulated in accum_t = float: the same float arithmetic, so equal up to a few
//     float ulps (2^-24 = 6e-8 each); one bf16 rounding anywhere (up to 2e-3) is far
//     outside it.
//   An absolute term, only where an output is a sum whose terms cancel (noted at each
//     use): there the float result is itself only accurate to about 2^-24 of the terms,
//     so a relative bound on a result near zero would compare rounding noise.
// The long rows (thousands of terms) are the cases where a reduction kept in bf16 fails
// visibly: past 256 terms of similar size a bf16 running sum stops growing (its ulp
// exceeds the terms).

namespace {

constexpr double kRoundRel = 0x1p-8;
constexpr double kStatRel = 1e-6;

/// n values drawn normal(mean, std) from `name`, rounded to bf16: exactly the same
/// numbers as bf16, float and double.
std::vector<float> bf16_values(std::int64_t n, const std::string& name, double std = 1.0, double mean = 0.0) {
  Tensor<double> d(Shape{n});
  fill_normal(d, 11, name, std);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = round_to_bf16(static_cast<float>(mean + d[i]));
  return v;
}

std::vector<bf16> as_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = bf16(v[i]);
    REQUIRE(static_cast<float>(out[i]) == v[i]);  // the inputs are bf16 values: exact
  }
  return out;
}

std::vector<float> as_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

/// Checks |got_i - ref_i| <= rel |ref_i| + abs for every i and reports the worst element.
void check_within(const char* what, const std::vector<float>& got, const std::vector<float>& ref, double rel,
                  double abs = 0.0) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(static_cast<double>(got[i]) - ref[i]);
    const double bound = rel * std::abs(static_cast<double>(ref[i])) + abs;
    const double ratio = std::isnan(diff) ? HUGE_VAL : (diff == 0 ? 0.0 : (bound > 0 ? diff / bound : HUGE_VAL));
    if (ratio > worst) worst = ratio, at = i;
  }
  INFO(std::string(what), ": worst element ", at, " is ", got[at], " against ", ref[at], ", ", worst, " of its bound");
  CHECK(worst <= 1.0);
}

void check_within(const char* what, const std::vector<bf16>& got, const std::vector<float>& ref, double rel,
                  double abs = 0.0) {
  check_within(what, as_float(got), ref, rel, abs);
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

}  // namespace

TEST_CASE("accum_t, to_accum and from_accum: float arithmetic for bf16, the identity otherwise") {
  static_assert(std::is_same_v<accum_t<bf16>, float>);
  static_assert(std::is_same_v<accum_t<float>, float>);
  static_assert(std::is_same_v<accum_t<double>, double>);
  static_assert(std::is_same_v<decltype(to_accum(bf16(1.0f))), float>);
  static_assert(std::is_same_v<decltype(from_accum<bf16>(1.0f)), bf16>);
  CHECK(to_accum(bf16(-2.5f)) == -2.5f);
  CHECK(to_accum(bf16::from_bits(0x3f81)) == 1.0f + 0x1p-7f);  // exact: every bf16 is a float
  // Nearest, ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  CHECK(from_accum<bf16>(1.0f + 0x1p-8f).bits == 0x3f80);
  CHECK(from_accum<bf16>(1.0f + 3 * 0x1p-8f).bits == 0x3f82);
  CHECK(from_accum<bf16>(1.0f + 0x1p-8f + 0x1p-20f).bits == 0x3f81);
  CHECK(std::isnan(to_accum(from_accum<bf16>(std::nanf("")))));
  // float and double pass through unchanged, low bits included.
  CHECK(from_accum<float>(1.0f + 0x1p-23f) == 1.0f + 0x1p-23f);
  CHECK(to_accum(1.0f + 0x1p-23f) == 1.0f + 0x1p-23f);
  CHECK(from_accum<double>(1.0 + 0x1p-52) == 1.0 + 0x1p-52);
  CHECK(to_accum(1.0 + 0x1p-52) == 1.0 + 0x1p-52);
}

TEST_CASE("bf16 element-wise functors stay within one rounding of float") {
  const std::int64_t n = 1001;
  const auto a = bf16_values(n, "ew.a", 2.0), b = bf16_values(n, "ew.b", 2.0);
  const auto ab = as_bf16(a), bb = as_bf16(b);

  std::vector<bf16> sum(n);
  std::vector<float> sum_f(n);
  Cpu::for_each(n, ops::Add<bf16>{ab.data(), bb.data(), sum.data()});
  Cpu::for_each(n, ops::Add<float>{a.data(), b.data(), sum_f.data()});
  check_within("add", sum, sum_f, kRoundRel);

  std::vector<bf16> copy(n);
  Cpu::for_each(n, ops::Copy<bf16>{ab.data(), copy.data()});
  CHECK(as_float(copy) == a);
  std::vector<bf16> filled(n);
  Cpu::for_each(n, ops::Fill<bf16>{bf16(0.375f), filled.data()});
  CHECK(std::all_of(filled.begin(), filled.end(), [](bf16 v) { return v.bits == bf16(0.375f).bits; }));

  // y close to -alpha x: y + alpha x cancels to about 1% of its terms. Rounding alpha x
  // to bf16 before the add would err by 2^-9 of alpha x, about 20% of the result.
  const float alpha = 0.3f;  // not a bf16 value
  const auto noise = bf16_values(n, "ew.noise", 0.01);
  std::vector<float> y(n);
  for (std::int64_t i = 0; i < n; ++i) y[i] = round_to_bf16(-alpha * a[i] + noise[i]);
  auto yb = as_bf16(y);
  auto y_f = y;
  Cpu::for_each(n, ops::Axpy<bf16>{alpha, ab.data(), yb.data()});
  Cpu::for_each(n, ops::Axpy<float>{alpha, a.data(), y_f.data()});
  // Absolute term: the float sum is exact to 2^-24 of alpha |x| (the product's rounding).
  check_within("axpy", yb, y_f, kRoundRel, 0x1p-22 * alpha * max_abs(a));

  auto sb = ab;
  auto s_f = a;
  Cpu::for_each(n, ops::Scale<bf16>{alpha, sb.data()});
  Cpu::for_each(n, ops::Scale<float>{alpha, s_f.data()});
  check_within("scale", sb, s_f, kRoundRel);

  // Squared-norm partials accumulate in double whatever the storage: equal to float's.
  std::vector<double> pb(11), pf(11);
  Cpu::for_each(11, ops::SquaredNormPartial<bf16>{ab.data(), n, 91, pb.data()});
  Cpu::for_each(11, ops::SquaredNormPartial<float>{a.data(), n, 91, pf.data()});
  CHECK(pb == pf);
}

TEST_CASE("bf16 SwiGLU forward and backward stay within one rounding of float") {
  const std::int64_t n = 1003;
  const auto a = bf16_values(n, "sw.a", 3.0), b = bf16_values(n, "sw.b"), dg = bf16_values(n, "sw.dg");
  const auto ab = as_bf16(a), bb = as_bf16(b), dgb = as_bf16(dg);
  std::vector<bf16> g(n), da(n), db(n);
  std::vector<float> g_f(n), da_f(n), db_f(n);
  Cpu::for_each(n, ops::SwiGluForward<bf16>{ab.data(), bb.data(), g.data()});
  Cpu::for_each(n, ops::SwiGluForward<float>{a.data(), b.data(), g_f.data()});
  Cpu::for_each(n, ops::SwiGluBackward<bf16>{ab.data(), bb.data(), dgb.data(), da.data(), db.data()});
  Cpu::for_each(n, ops::SwiGluBackward<float>{a.data(), b.data(), dg.data(), da_f.data(), db_f.data()});
  // Products only, except 1 + a (1 - s), which crosses zero near a = -1.28: the float
  // factor there is exact to 2^-24 of its terms (|a| up to about 10).
  check_within("g", g, g_f, kRoundRel);
  check_within("db", db, db_f, kRoundRel);
  check_within("da", da, da_f, kRoundRel, 1e-6 * max_abs(da_f));
}

namespace {

/// The stored values of x and the amaxes of its rows as RowAbsMax takes them.
template <class T>
std::vector<float> row_abs_max(const std::vector<T>& x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> m(static_cast<std::size_t>(rows));
  Cpu::for_each(rows, ops::RowAbsMax<T>{x.data(), cols, cols, m.data()});
  return m;
}

template <class T>
std::vector<std::uint32_t> bits_of(const std::vector<T>& v) {
  std::vector<std::uint32_t> b;
  for (const T& x : v) b.push_back(std::bit_cast<std::uint32_t>(static_cast<float>(to_accum(x))));
  return b;
}

/// v as T stores it (bf16: rounded).
template <class T>
std::vector<T> stored_as(const std::vector<float>& v) {
  if constexpr (std::is_same_v<T, bf16>) return as_bf16(v);
  else return v;
}

template <class T>
void check_row_amaxes(const std::vector<float>& a_f, const std::vector<float>& b_f, const std::vector<float>& dg_f,
                      std::int64_t rows, std::int64_t cols) {
  std::vector<T> a = stored_as<T>(a_f), b = stored_as<T>(b_f), dg = stored_as<T>(dg_f);
  const std::size_t n = a.size();
  a[static_cast<std::size_t>(2 * cols + 5)] = T(std::numeric_limits<float>::quiet_NaN());  // row 2's amaxes: NaN
  std::vector<T> g(n), g_rows(n), da(n), db(n), da_rows(n), db_rows(n);
  std::vector<float> g_amax(static_cast<std::size_t>(rows)), da_amax(g_amax), db_amax(g_amax);
  Cpu::for_each(static_cast<std::int64_t>(n), ops::SwiGluForward<T>{a.data(), b.data(), g.data()});
  Cpu::for_each(rows, ops::SwiGluForwardRows<T>{{a.data(), b.data(), g_rows.data()}, cols, g_amax.data()});
  CHECK(bits_of(g_rows) == bits_of(g));
  CHECK(bits_of(g_amax) == bits_of(row_abs_max(g, rows, cols)));
  CHECK(std::isnan(g_amax[2]));
  Cpu::for_each(static_cast<std::int64_t>(n), ops::SwiGluBackward<T>{a.data(), b.data(), dg.data(), da.data(), db.data()});
  Cpu::for_each(rows, ops::SwiGluBackwardRows<T>{{a.data(), b.data(), dg.data(), da_rows.data(), db_rows.data()}, cols,
                                                 da_amax.data(), db_amax.data()});
  CHECK(bits_of(da_rows) == bits_of(da));
  CHECK(bits_of(db_rows) == bits_of(db));
  CHECK(bits_of(da_amax) == bits_of(row_abs_max(da, rows, cols)));
  CHECK(bits_of(db_amax) == bits_of(row_abs_max(db, rows, cols)));
  CHECK((std::isnan(da_amax[2]) && std::isnan(db_amax[2]) && !std::isnan(da_amax[1])));

  // RMSNorm's forward over the same rows (x = b, w = the first row of dg): y as without
  // the amaxes, and the amaxes of y as stored.
  std::vector<T> y(n), y_amaxed(n);
  std::vector<accum_t<T>> rstd(static_cast<std::size_t>(rows));
  std::vector<float> y_amax(static_cast<std::size_t>(rows));
  Cpu::for_each(rows, ops::RmsNormForward<T>{b.data(), cols, dg.data(), y.data(), cols, rstd.data(), cols, 1e-5f});
  Cpu::for_each(rows, ops::RmsNormForward<T>{b.data(), cols, dg.data(), y_amaxed.data(), cols, rstd.data(), cols, 1e-5f,
                                             y_amax.data()});
  CHECK(bits_of(y_amaxed) == bits_of(y));
  CHECK(bits_of(y_amax) == bits_of(row_abs_max(y, rows, cols)));
  CHECK(y_amax[0] > 0.0f);
}

}  // namespace

TEST_CASE("SwiGLU by rows and RMSNorm's forward write their outputs' row amaxes: RowAbsMax's of the same bits") {
  // 5 rows of 37 (no whole vectors: the CPU loop is the same either way), a NaN in row 2.
  const std::int64_t rows = 5, cols = 37;
  const auto a = bf16_values(rows * cols, "rows.a", 3.0), b = bf16_values(rows * cols, "rows.b");
  const auto dg = bf16_values(rows * cols, "rows.dg");
  SUBCASE("bf16") { check_row_amaxes<bf16>(a, b, dg, rows, cols); }
  SUBCASE("float") { check_row_amaxes<float>(a, b, dg, rows, cols); }
}

namespace {
template <class T>
void check_paired(const std::vector<float>& a_f, const std::vector<float>& b_f, const std::vector<float>& dg_f,
                  std::int64_t rows, std::int64_t cols) {
  const std::vector<T> a = stored_as<T>(a_f), b = stored_as<T>(b_f), dg = stored_as<T>(dg_f);
  const std::size_t n = a.size();
  // a and b side by side in each row of ab, as w1 and w3 run as one GEMM write them.
  std::vector<T> ab(2 * n);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      ab[static_cast<std::size_t>(2 * r * cols + j)] = a[static_cast<std::size_t>(r * cols + j)];
      ab[static_cast<std::size_t>(2 * r * cols + cols + j)] = b[static_cast<std::size_t>(r * cols + j)];
    }
  std::vector<T> g(n), g_paired(n), da(n), db(n), dab(2 * n);
  Cpu::for_each(static_cast<std::int64_t>(n), ops::SwiGluForward<T>{a.data(), b.data(), g.data()});
  Cpu::for_each(rows, ops::SwiGluForwardPaired<T>{ab.data(), g_paired.data(), cols});
  CHECK(bits_of(g_paired) == bits_of(g));
  Cpu::for_each(static_cast<std::int64_t>(n), ops::SwiGluBackward<T>{a.data(), b.data(), dg.data(), da.data(), db.data()});
  Cpu::for_each(rows, ops::SwiGluBackwardPaired<T>{ab.data(), dg.data(), dab.data(), cols});
  std::vector<T> da_paired, db_paired;
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto row = dab.begin() + 2 * r * cols;
    da_paired.insert(da_paired.end(), row, row + cols);
    db_paired.insert(db_paired.end(), row + cols, row + 2 * cols);
  }
  CHECK(bits_of(da_paired) == bits_of(da));
  CHECK(bits_of(db_paired) == bits_of(db));
}
}  // namespace

TEST_CASE("SwiGLU over a and b side by side in each row (w1 and w3 run as one GEMM): the elementwise bits") {
  const std::int64_t rows = 5, cols = 37;
  const auto a = bf16_values(rows * cols, "paired.a", 3.0), b = bf16_values(rows * cols, "paired.b");
  const auto dg = bf16_values(rows * cols, "paired.dg");
  SUBCASE("bf16") { check_paired<bf16>(a, b, dg, rows, cols); }
  SUBCASE("float") { check_paired<float>(a, b, dg, rows, cols); }
}

TEST_CASE("bf16 RoPE rotation and its inverse stay within one rounding of float") {
  const std::int64_t heads = 3, hd = 16, seq = 5, rows = 7, width = heads * hd;
  auto inv = ops::rope_inv_freq(hd, 10000.0, {});
  std::vector<float> cs(seq * hd / 2), sn(seq * hd / 2);  // bf16 values, as a bf16 model's tables
  for (std::int64_t p = 0; p < seq; ++p)
    for (std::int64_t i = 0; i < hd / 2; ++i) {
      cs[p * hd / 2 + i] = round_to_bf16(static_cast<float>(std::cos(p * inv[i])));
      sn[p * hd / 2 + i] = round_to_bf16(static_cast<float>(std::sin(p * inv[i])));
    }
  const auto csb = as_bf16(cs), snb = as_bf16(sn);
  const auto x = bf16_values(rows * width, "rope.x");
  for (bool inverse : {false, true}) {
    CAPTURE(inverse);
    // In place, and from a separate source.
    auto xb = as_bf16(x);
    auto x_f = x;
    Cpu::for_each(rows, ops::RopeRotate<bf16>{xb.data(), width, heads, hd, seq, csb.data(), snb.data(), inverse});
    Cpu::for_each(rows, ops::RopeRotate<float>{x_f.data(), width, heads, hd, seq, cs.data(), sn.data(), inverse});
    // Absolute term: x cos - y sin cancels; the float result is exact to 2^-24 of |x| + |y|.
    check_within("in place", xb, x_f, kRoundRel, 1e-6 * max_abs(x));
    const auto src = as_bf16(x);
    std::vector<bf16> out(x.size());
    Cpu::for_each(rows, ops::RopeRotate<bf16>{out.data(), width, heads, hd, seq, csb.data(), snb.data(), inverse,
                                              src.data()});
    CHECK(as_float(out) == as_float(xb));
  }
}

TEST_CASE("RMSNorm's backward in one launch: rows + n indices, the two functors' results in any order") {
  // Index r < rows is row r's dx, index rows + j column j's dw: the CPU backend (as its
  // two loops), every index in turn, and every index in reverse all give the two
  // functors' own results, bit for bit.
  const std::int64_t rows = 300, n = 40;
  std::vector<float> x(rows * n), dy(rows * n), res(rows * n), w(n), rstd(rows);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(0.37f * static_cast<float>(i));
    dy[i] = std::cos(0.11f * static_cast<float>(i));
    res[i] = 0.25f * std::sin(0.05f * static_cast<float>(i));
  }
  for (std::int64_t j = 0; j < n; ++j) w[j] = 0.5f + 0.01f * static_cast<float>(j);
  for (std::int64_t r = 0; r < rows; ++r) rstd[r] = 0.8f + 0.001f * static_cast<float>(r);
  for (const bool add : {false, true}) {
    std::vector<float> dx_want(rows * n), dw_want(n, 0.5f);
    Cpu::for_each(rows, ops::RmsNormBackwardInput<float>{x.data(), n, w.data(), rstd.data(), dy.data(), n,
                                                         dx_want.data(), n, n, res.data(), n});
    Cpu::for_each(n, ops::RmsNormBackwardWeight<float>{x.data(), n, rstd.data(), dy.data(), n, dw_want.data(), rows,
                                                       add});
    for (int how = 0; how < 3; ++how) {
      std::vector<float> dx(rows * n, -1.0f), dw(n, 0.5f);
      const ops::RmsNormBackward<float> f{
          {x.data(), n, w.data(), rstd.data(), dy.data(), n, dx.data(), n, n, res.data(), n},
          {x.data(), n, rstd.data(), dy.data(), n, dw.data(), rows, add}};
      if (how == 0) Cpu::for_each(rows + n, f);
      else if (how == 1)
        for (std::int64_t i = 0; i < rows + n; ++i) f(i);
      else
        for (std::int64_t i = rows + n - 1; i >= 0; --i) f(i);
      CAPTURE(how);
      CAPTURE(add);
      CHECK(dx == dx_want);
      CHECK(dw == dw_want);
    }
  }
}

TEST_CASE("bf16 RMSNorm: statistics and dw in float, outputs within one rounding of float") {
  // 5 rows of 37 and 4 rows of 3001; the long rows' sums of squares and dot products, and
  // dw's sums over 3001 rows, are where a bf16 accumulator fails.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{5, 37}, {4, 3001}, {3001, 3}};
  for (const auto& shape : shapes) {
    const std::int64_t rows = shape.first, n = shape.second;
    CAPTURE(rows);
    CAPTURE(n);
    const std::int64_t ld = n + 2;  // padded rows
    const auto x = bf16_values(rows * ld, "rms.x", 1.5), w = bf16_values(n, "rms.w", 0.2, 1.0);
    const auto dy = bf16_values(rows * ld, "rms.dy");
    const auto xb = as_bf16(x), wb = as_bf16(w), dyb = as_bf16(dy);
    const float eps = 1e-5f;

    std::vector<bf16> y(rows * ld);
    std::vector<float> y_f(rows * ld), rstd(rows), rstd_f(rows);
    Cpu::for_each(rows, ops::RmsNormForward<bf16>{xb.data(), ld, wb.data(), y.data(), ld, rstd.data(), n, eps});
    Cpu::for_each(rows, ops::RmsNormForward<float>{x.data(), ld, w.data(), y_f.data(), ld, rstd_f.data(), n, eps});
    check_within("rstd", rstd, rstd_f, kStatRel);
    for (std::int64_t r = 0; r < rows; ++r) {  // against double as well
      double ss = 0;
      for (std::int64_t j = 0; j < n; ++j) ss += double(x[r * ld + j]) * x[r * ld + j];
      REQUIRE(rstd[r] == doctest::Approx(1 / std::sqrt(ss / n + eps)).epsilon(1e-5));
    }
    std::vector<float> y_rows, yf_rows;  // the rows' n columns (the padding is not written)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        y_rows.push_back(static_cast<float>(y[r * ld + j]));
        yf_rows.push_back(y_f[r * ld + j]);
      }
    check_within("y", y_rows, yf_rows, kRoundRel);

    std::vector<bf16> dx(rows * ld);
    std::vector<float> dx_f(rows * ld);
    Cpu::for_each(rows, ops::RmsNormBackwardInput<bf16>{xb.data(), ld, wb.data(), rstd.data(), dyb.data(), ld,
                                                        dx.data(), ld, n});
    Cpu::for_each(rows, ops::RmsNormBackwardInput<float>{x.data(), ld, w.data(), rstd_f.data(), dy.data(), ld,
                                                         dx_f.data(), ld, n});
    std::vector<float> dx_rows, dxf_rows;
    double term = 0;  // the largest term of dx_j = r w_j dy_j - c x_j
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        dx_rows.push_back(static_cast<float>(dx[r * ld + j]));
        dxf_rows.push_back(dx_f[r * ld + j]);
        term = std::max(term, std::abs(double(rstd_f[r]) * w[j] * dy[r * ld + j]));
      }
    // Absolute term: the two terms of dx_j cancel; float holds their difference to 2^-24
    // of the terms.
    check_within("dx", dx_rows, dxf_rows, kRoundRel, 1e-6 * term);

    // With a residual's gradient: float, bitwise dx then its separate addition (one
    // rounding either way); bf16, dx's exact value plus the residual rounded once.
    const auto res = bf16_values(rows * ld, "rms.residual");
    const auto resb = as_bf16(res);
    std::vector<float> dx_res_f(rows * ld), dx_added = dx_f;
    Cpu::for_each(rows, ops::RmsNormBackwardInput<float>{x.data(), ld, w.data(), rstd_f.data(), dy.data(), ld,
                                                         dx_res_f.data(), ld, n, res.data(), ld});
    Cpu::for_each(rows * ld, ops::Axpy<float>{1.0f, res.data(), dx_added.data()});
    bool float_same = true;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) float_same = float_same && dx_res_f[r * ld + j] == dx_added[r * ld + j];
    CHECK(float_same);
    std::vector<bf16> dx_res(rows * ld);
    Cpu::for_each(rows, ops::RmsNormBackwardInput<bf16>{xb.data(), ld, wb.data(), rstd.data(), dyb.data(), ld,
                                                        dx_res.data(), ld, n, resb.data(), ld});
    std::vector<float> with_res, want_res;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        with_res.push_back(static_cast<float>(dx_res[r * ld + j]));
        want_res.push_back(dx_f[r * ld + j] + static_cast<float>(resb[r * ld + j]));
      }
    check_within("dx + residual", with_res, want_res, kRoundRel, 1e-6 * term);
    CHECK(ops::RmsNormBackwardInput<float>{nullptr, ld, nullptr, nullptr, nullptr, ld, nullptr, ld, n, res.data(), ld}
              .traffic(rows)
              .bytes_read ==
          ops::RmsNormBackwardInput<float>{nullptr, ld, nullptr, nullptr, nullptr, ld, nullptr, ld, n}.traffic(rows)
                  .bytes_read +
              static_cast<double>(rows * n) * sizeof(float));

    // dw is added into, in float for bf16 parameters.
    std::vector<float> dw = bf16_values(n, "rms.dw0"), dw_f = dw;
    Cpu::for_each(n, ops::RmsNormBackwardWeight<bf16>{xb.data(), ld, rstd.data(), dyb.data(), ld, dw.data(), rows});
    Cpu::for_each(n, ops::RmsNormBackwardWeight<float>{x.data(), ld, rstd_f.data(), dy.data(), ld, dw_f.data(), rows});
    // Written, not added (the step's first write): the sum alone, bit for bit what adding
    // it to zeros gives.
    std::vector<float> zeros(n, 0.0f), written(n, std::numeric_limits<float>::quiet_NaN());
    Cpu::for_each(n, ops::RmsNormBackwardWeight<bf16>{xb.data(), ld, rstd.data(), dyb.data(), ld, zeros.data(), rows});
    Cpu::for_each(n,
                  ops::RmsNormBackwardWeight<bf16>{xb.data(), ld, rstd.data(), dyb.data(), ld, written.data(), rows, false});
    CHECK(written == zeros);
    // Absolute term: a sum over rows of terms of both signs; 1e-6 of the terms' total
    // magnitude (16 float ulps of it) covers float's rounding of the partial sums.
    double terms = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      double t = 0;
      for (std::int64_t r = 0; r < rows; ++r) t += std::abs(double(dy[r * ld + j]) * x[r * ld + j] * rstd_f[r]);
      terms = std::max(terms, t);
    }
    check_within("dw", dw, dw_f, kStatRel, 1e-6 * terms);
  }
}

TEST_CASE("bf16 causal softmax rows and RowDot: lse and D in float, probabilities within one rounding") {
  // Rows 0..8 of a tile at offset 1992 over 2001 keys: row r sees r + 1993 keys (the last
  // one all of them), so the sums run over about 2000 exponentials.
  const std::int64_t rows = 9, cols = 2001, offset = cols - rows, ld = cols + 3;
  const float scale = 0.0883883f;  // 1/sqrt(128): scaled scores are not bf16 values
  const auto scores = bf16_values(rows * ld, "sm.s", 8.0);
  auto sb = as_bf16(scores);
  auto s_f = scores;
  std::vector<float> lse(rows), lse_f(rows);
  Cpu::for_each(rows, ops::CausalSoftmaxForward<bf16>{sb.data(), ld, cols, offset, scale, lse.data()});
  Cpu::for_each(rows, ops::CausalSoftmaxForward<float>{s_f.data(), ld, cols, offset, scale, lse_f.data()});
  check_within("lse", lse, lse_f, kStatRel);
  std::vector<float> p, p_f;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      p.push_back(static_cast<float>(sb[r * ld + j]));
      p_f.push_back(s_f[r * ld + j]);
      if (j > r + offset) REQUIRE(p.back() == 0.0f);  // above the diagonal
    }
  check_within("p", p, p_f, kRoundRel);

  // Recompute from the raw scores and the (float) lse: the same probabilities.
  auto rb = as_bf16(scores);
  auto r_f = scores;
  Cpu::for_each(rows, ops::CausalSoftmaxRecompute<bf16>{rb.data(), ld, cols, offset, scale, lse.data()});
  Cpu::for_each(rows, ops::CausalSoftmaxRecompute<float>{r_f.data(), ld, cols, offset, scale, lse_f.data()});
  std::vector<float> q, q_f;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      q.push_back(static_cast<float>(rb[r * ld + j]));
      q_f.push_back(r_f[r * ld + j]);
    }
  check_within("recomputed p", q, q_f, kRoundRel);
  check_within("recomputed p against the forward's", q, p_f, kRoundRel);

  // D over rows of 2001 values, then dS = scale p (dP - D) from the bf16 probabilities.
  const auto o = bf16_values(rows * ld, "sm.o"), d_o = bf16_values(rows * ld, "sm.do");
  const auto ob = as_bf16(o), dob = as_bf16(d_o);
  std::vector<float> d(rows), d_f(rows);
  Cpu::for_each(rows, ops::RowDot<bf16>{dob.data(), ld, ob.data(), ld, cols, d.data()});
  Cpu::for_each(rows, ops::RowDot<float>{d_o.data(), ld, o.data(), ld, cols, d_f.data()});
  // Absolute term: D sums products of both signs; 1e-6 of the terms' total magnitude.
  double d_terms = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double t = 0;
    for (std::int64_t j = 0; j < cols; ++j) t += std::abs(double(d_o[r * ld + j]) * o[r * ld + j]);
    d_terms = std::max(d_terms, t);
  }
  check_within("D", d, d_f, kStatRel, 1e-6 * d_terms);
  const auto pb = as_bf16(as_float(sb));  // the forward's bf16 probabilities, for both runs
  const auto pf = as_float(pb);
  auto dpb = as_bf16(d_o);
  auto dp_f = d_o;
  Cpu::for_each(rows, ops::CausalSoftmaxBackward<bf16>{pb.data(), ld, dpb.data(), ld, d.data(), cols, offset, scale});
  Cpu::for_each(rows,
                ops::CausalSoftmaxBackward<float>{pf.data(), ld, dp_f.data(), ld, d_f.data(), cols, offset, scale});
  std::vector<float> ds, ds_f;
  double term = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      ds.push_back(static_cast<float>(dpb[r * ld + j]));
      ds_f.push_back(dp_f[r * ld + j]);
      term = std::max(term, scale * double(pf[r * ld + j]) * (std::abs(d_o[r * ld + j]) + std::abs(d_f[r])));
    }
  // Absolute term: dP - D cancels; float holds it to 2^-24 of |dP| + |D|.
  check_within("dS", ds, ds_f, kRoundRel, 1e-6 * term);
}

TEST_CASE("bf16 cross-entropy rows: loss in float, gradient within one rounding, ignored rows zero") {
  // 4 rows of 3001 logits (a sum of 3001 exponentials each), the third ignored.
  const std::int64_t rows = 4, vocab = 3001, ld = vocab + 1;
  const std::vector<std::int32_t> targets = {17, 3000, ops::kIgnoreIndex, 0};
  const float scale = 1.0f / 3;
  const auto logits = bf16_values(rows * ld, "ce.z", 3.0);
  for (bool write_grad : {true, false}) {
    CAPTURE(write_grad);
    auto zb = as_bf16(logits);
    auto z_f = logits;
    std::vector<double> loss(rows, -1), loss_f(rows, -1);
    Cpu::for_each(rows, ops::CrossEntropyRow<bf16>{zb.data(), ld, vocab, targets.data(), scale, write_grad,
                                                   loss.data()});
    Cpu::for_each(rows, ops::CrossEntropyRow<float>{z_f.data(), ld, vocab, targets.data(), scale, write_grad,
                                                    loss_f.data()});
    CHECK(loss[2] == 0.0);
    for (std::int64_t r : {0, 1, 3}) {
      CAPTURE(r);
      CHECK(loss[r] == doctest::Approx(loss_f[r]).epsilon(kStatRel));
      // And against double on the same logits.
      double m = -HUGE_VAL, sum = 0;
      for (std::int64_t j = 0; j < vocab; ++j) m = std::max(m, double(logits[r * ld + j]));
      for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(logits[r * ld + j] - m);
      CHECK(loss[r] == doctest::Approx(m + std::log(sum) - logits[r * ld + targets[r]]).epsilon(1e-5));
    }
    if (!write_grad) continue;  // the row is scratch
    std::vector<float> g, g_f;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < vocab; ++j) {
        g.push_back(static_cast<float>(zb[r * ld + j]));
        g_f.push_back(z_f[r * ld + j]);
        if (r == 2) REQUIRE(g.back() == 0.0f);
      }
    // Absolute term: at the target, scale (p_t - 1) cancels; float holds it to 2^-24 of scale.
    check_within("gradient", g, g_f, kRoundRel, 1e-6 * scale);
  }
}

TEST_CASE("bf16 vocabulary-parallel cross-entropy over two shards matches float and the whole-row loss") {
  // Shards of 1500 and 1501 columns; targets in each shard, and an ignored row.
  const std::int64_t rows = 4, vocab = 3001, ld = vocab;
  const std::int64_t lo[2] = {0, 1500}, width[2] = {1500, 1501};
  const std::vector<std::int32_t> targets = {5, 2999, ops::kIgnoreIndex, 1500};
  const float scale = 0.25f;
  const auto logits = bf16_values(rows * ld, "ces.z", 3.0);

  // The three passes on both shards, with the all-reduces done here; returns the losses
  // and fills z with the gradient.
  auto run = [&]<class T>(std::vector<T>& z, std::vector<accum_t<T>>& max, std::vector<accum_t<T>>& sums) {
    std::vector<accum_t<T>> part_max[2], part_sums[2];
    for (int k = 0; k < 2; ++k) {
      part_max[k].assign(rows, -1);
      Cpu::for_each(rows, ops::CrossEntropyShardMax<T>{z.data() + lo[k], ld, width[k], targets.data(),
                                                       part_max[k].data()});
    }
    max.assign(rows, 0);
    for (std::int64_t r = 0; r < rows; ++r) max[r] = std::max(part_max[0][r], part_max[1][r]);
    sums.assign(2 * rows, 0);
    for (int k = 0; k < 2; ++k) {
      part_sums[k].assign(2 * rows, -1);
      Cpu::for_each(rows, ops::CrossEntropyShardExp<T>{z.data() + lo[k], ld, width[k], lo[k], targets.data(),
                                                       max.data(), part_sums[k].data()});
      for (std::int64_t i = 0; i < 2 * rows; ++i) sums[i] += part_sums[k][i];
    }
    std::vector<double> loss[2];
    for (int k = 0; k < 2; ++k) {
      loss[k].assign(rows, -1);
      Cpu::for_each(rows, ops::CrossEntropyShardGrad<T>{z.data() + lo[k], ld, width[k], lo[k], targets.data(),
                                                        max.data(), sums.data(), scale, true, loss[k].data()});
    }
    CHECK(loss[0] == loss[1]);  // every rank ends with the same losses
    return loss[0];
  };
  auto zb = as_bf16(logits);
  auto z_f = logits;
  std::vector<float> max, max_f, sums, sums_f;
  const auto loss = run(zb, max, sums);
  const auto loss_f = run(z_f, max_f, sums_f);
  CHECK(max == max_f);  // the max of the same values
  check_within("sums", sums, sums_f, kStatRel);
  CHECK(sums[2 * 2] == 0.0f);
  CHECK(sums[2 * 2 + 1] == 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) CHECK(loss[r] == doctest::Approx(loss_f[r]).epsilon(kStatRel));
  check_within("gradient", zb, z_f, kRoundRel, 1e-6 * scale);  // absolute term as for CrossEntropyRow
  for (std::int64_t j = 0; j < vocab; ++j) REQUIRE(static_cast<float>(zb[2 * ld + j]) == 0.0f);

  // The whole row in one functor: the same losses and gradients.
  auto whole = as_bf16(logits);
  std::vector<double> whole_loss(rows);
  Cpu::for_each(rows, ops::CrossEntropyRow<bf16>{whole.data(), ld, vocab, targets.data(), scale, true,
                                                 whole_loss.data()});
  for (std::int64_t r = 0; r < rows; ++r) CHECK(loss[r] == doctest::Approx(whole_loss[r]).epsilon(kStatRel));
  check_within("gradient against the whole row", zb, as_float(whole), kRoundRel, 1e-6 * scale);
}

TEST_CASE("parameter initialisation: the functor draws core/rng.hpp's values, with their moments") {
  const std::uint64_t key = parameter_key(7, "layers.0.attention.wq.weight");
  const Philox4x32 rng(key);
  const std::int64_t n = 100000;
  std::vector<float> normal_values(n), trunc_values(n), piece(100);
  std::vector<bf16> bf(n);
  std::vector<double> ones(10, 0.0);
  Cpu::for_each(n, ops::InitValues<float>{normal_values.data(), key, ops::InitKind::normal, 0.5});
  Cpu::for_each(n, ops::InitValues<float>{trunc_values.data(), key, ops::InitKind::truncated_normal, 1.0, -0.5, 0.5});
  Cpu::for_each(n, ops::InitValues<bf16>{bf.data(), key, ops::InitKind::normal, 0.5});
  Cpu::for_each(100, ops::InitValues<float>{piece.data(), key, ops::InitKind::normal, 0.5, -2, 2, ops::PieceIndex{1000}});
  Cpu::for_each(10, ops::InitValues<double>{ones.data(), key, ops::InitKind::ones});
  double s = 0, s2 = 0, worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto idx = static_cast<std::uint64_t>(i);
    REQUIRE(normal_values[i] == static_cast<float>(normal(rng, idx, 0, 0.5)));
    REQUIRE(trunc_values[i] == static_cast<float>(truncated_normal(rng, idx, 0, 1.0, -0.5, 0.5)));
    REQUIRE(bf[i].bits == bf16(normal_values[i]).bits);
    REQUIRE(trunc_values[i] >= -0.5f);
    REQUIRE(trunc_values[i] <= 0.5f);
    // Against Box-Muller through libm on the same words: a few ulp apart in double,
    // so the float values agree but for a rare rounding boundary.
    std::uint32_t w[4];
    rng.draw(idx, 0, 0, w);
    const double ref = 0.5 * std::sqrt(-2.0 * std::log(uniform_open(w[0], w[1]))) *
                       std::cos(6.283185307179586 * uniform_open(w[2], w[3]));
    worst = std::max(worst, std::abs(static_cast<double>(normal_values[i]) - ref) / std::max(std::abs(ref), 1e-3));
    s += normal_values[i];
    s2 += static_cast<double>(normal_values[i]) * normal_values[i];
  }
  CHECK(worst < 1e-7);  // float rounding of the value, nothing more
  CHECK(std::abs(s / n) < 0.005);
  CHECK(std::abs(s2 / n - 0.25) < 0.005);
  // Truncated to [-0.5, 0.5] from a standard normal: mean 0, variance 0.0806.
  double t1 = 0, t2 = 0;
  for (float x : trunc_values) t1 += x, t2 += static_cast<double>(x) * x;
  CHECK(std::abs(t1 / n) < 0.003);
  CHECK(std::abs(t2 / n - 0.08059) < 0.002);
  // A piece starting at element 1000 holds the whole parameter's elements 1000.. .
  for (std::size_t i = 0; i < 100; ++i) CHECK(piece[i] == normal_values[1000 + i]);
  // Columns [30, 40) of a (1000, 100) whole, from the piece's element 25 (row 2, column 5):
  // each holds the whole's element at its row and column.
  std::vector<float> columns(50);
  Cpu::for_each(50, ops::InitValues<float>{columns.data(), key, ops::InitKind::normal, 0.5, -2, 2,
                                           ops::PieceIndex{25, 100, 10, 0, 30}});
  for (std::size_t i = 0; i < 50; ++i) {
    const std::size_t e = 25 + i, row = e / 10, col = 30 + e % 10;
    CHECK(columns[i] == normal_values[row * 100 + col]);
  }
  for (double x : ones) CHECK(x == 1.0);
  // Uniform on (-0.25, 0.25) (a LoRA adapter's A, torch.nn.Linear's default): the first
  // two words of the same counter, lo + (hi - lo) u; mean 0, variance 0.5^2 / 12.
  std::vector<float> uniform_values(n);
  Cpu::for_each(n, ops::InitValues<float>{uniform_values.data(), key, ops::InitKind::uniform, 0.0, -0.25, 0.25});
  double u1 = 0, u2 = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t w[4];
    rng.draw(static_cast<std::uint64_t>(i), 0, 0, w);
    REQUIRE(uniform_values[i] == static_cast<float>(-0.25 + 0.5 * uniform_open(w[0], w[1])));
    REQUIRE(std::abs(uniform_values[i]) < 0.25f);
    u1 += uniform_values[i];
    u2 += static_cast<double>(uniform_values[i]) * uniform_values[i];
  }
  CHECK(std::abs(u1 / n) < 0.002);
  CHECK(std::abs(u2 / n - 0.25 / 12) < 0.0005);
}

TEST_CASE("bf16 embedding: rows copied exactly, the table gradient summed in float") {
  // 3001 tokens over ids 0..10; this table holds ids [2, 9): others give zero rows and no
  // gradient. Each id collects about 270 rows: a bf16 running sum would lose them.
  const std::int64_t rows = 3001, dim = 5, lo = 2, hi = 9;
  std::vector<std::int32_t> ids(rows);
  for (std::int64_t r = 0; r < rows; ++r) ids[r] = static_cast<std::int32_t>((r * 7) % 11);
  const auto table = bf16_values((hi - lo) * dim, "emb.table");
  const auto tb = as_bf16(table);
  std::vector<bf16> out(rows * dim, bf16(5.0f));
  Cpu::for_each(rows * dim, ops::EmbeddingForward<bf16>{ids.data(), tb.data(), out.data(), dim, lo, hi});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < dim; ++j) {
      const float expect = ids[r] >= lo && ids[r] < hi ? table[(ids[r] - lo) * dim + j] : 0.0f;
      REQUIRE(static_cast<float>(out[r * dim + j]) == expect);
    }

  const auto dout = bf16_values(rows * dim, "emb.dout");
  const auto doutb = as_bf16(dout);
  std::vector<float> dtable = bf16_values((hi - lo) * dim, "emb.dtable0"), dtable_f = dtable;  // added into
  const ops::EmbeddingSegments seg = ops::embedding_segments(ids, lo, hi);
  const std::int32_t* base = seg.packed.data();
  Cpu::for_each(seg.count * dim, ops::EmbeddingBackward<bf16>{seg.ids(base), seg.offsets(base), seg.order(base),
                                                              doutb.data(), dtable.data(), dim, lo, seg.positions});
  Cpu::for_each(seg.count * dim, ops::EmbeddingBackward<float>{seg.ids(base), seg.offsets(base), seg.order(base),
                                                               dout.data(), dtable_f.data(), dim, lo, seg.positions});
  // Bitwise the sequential scatter-add over the positions in order (one owner per
  // element, the same summation order).
  std::vector<float> seq = bf16_values((hi - lo) * dim, "emb.dtable0"), seq_f = seq;
  for (std::int64_t r = 0; r < rows; ++r)
    if (ids[r] >= lo && ids[r] < hi)
      for (std::int64_t j = 0; j < dim; ++j) {
        seq[(ids[r] - lo) * dim + j] += static_cast<float>(doutb[r * dim + j]);
        seq_f[(ids[r] - lo) * dim + j] += dout[r * dim + j];
      }
  CHECK(dtable == seq);
  CHECK(dtable_f == seq_f);
  // Against double; the absolute term: about 270 terms of both signs per entry, 1e-6 of
  // their total magnitude.
  const auto dtable0 = bf16_values((hi - lo) * dim, "emb.dtable0");
  std::vector<double> ref(dtable0.begin(), dtable0.end()), terms(ref.size());
  for (std::int64_t r = 0; r < rows; ++r)
    if (ids[r] >= lo && ids[r] < hi)
      for (std::int64_t j = 0; j < dim; ++j) {
        ref[(ids[r] - lo) * dim + j] += dout[r * dim + j];
        terms[(ids[r] - lo) * dim + j] += std::abs(dout[r * dim + j]);
      }
  const double abs = 1e-6 * *std::max_element(terms.begin(), terms.end());
  check_within("dtable", dtable, dtable_f, kStatRel, abs);
  check_within("dtable against double", dtable, std::vector<float>(ref.begin(), ref.end()), 1e-5, abs);
}

}  // namespace test_ops
